"""Tokenizers (byte-level BPE via `tokenizers`) with the checkpoint's chat template, rendered by
jinja2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

# The regex of GPT-2-style byte-level BPE, and Llama 3's (digits in runs of up to 3).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# DeepSeek's splits, applied one after another before the byte-level mapping, as llama.cpp's
# llama-vocab.cpp lists them for `deepseek-llm` (DeepSeek LLM, V2, V2.5), `deepseek-coder` and
# `deepseek-v3` (and as DeepSeek's own tokenizer.json Split pre-tokenizers hold them).
_DEEPSEEK_LLM_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
    "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
    "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
    "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
    "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_DEEPSEEK_SPLITS = {
    "deepseek-llm": [
        "[\r\n]",
        f"\\s?[{_DEEPSEEK_LLM_LETTERS}]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        "\\s+$",
        "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
        "\\p{N}+",
    ],
    "deepseek-coder": [
        "[\r\n]",
        "\\s?\\p{L}+",
        "\\s?\\p{P}+",
        "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
        "\\p{N}",
    ],
    "deepseek-v3": [
        "\\p{N}{1,3}",
        "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
        "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
    ],
}


def _byte_level_pre(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp's `tokenizer.ggml.pre` names (the ones we know)."""
    if pre in _DEEPSEEK_SPLITS:
        splits = [
            pre_tokenizers.Split(tokenizers.Regex(rx), behavior="isolated", invert=False)
            for rx in _DEEPSEEK_SPLITS[pre]
        ]
        return pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(
                    tokenizers.Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False
                ),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre in ("default", "gpt2", "gpt-2", ""):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raise ValueError(
        f"unsupported tokenizer pre-tokenizer {pre!r} "
        "(supported: smollm, starcoder, llama-bpe, gpt2, deepseek-llm, deepseek-coder, "
        "deepseek-v3)"
    )


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class Tokenizer:
    """encode/decode text, and chat messages through the checkpoint's chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        bos_token_id: int | None,
        eos_token_ids: set[int],
        chat_template: str | None,
        add_bos: bool = False,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = set(eos_token_ids)
        self.chat_template = chat_template
        self.add_bos = add_bos
        self._template = None
        if chat_template:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(chat_template)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text become their ids."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The chat template applied to messages, as text."""
        if self._template is None:
            raise ValueError("this model has no chat template")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"chat message needs 'role' and 'content', got {m!r}")
        bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.id_to_token(min(self.eos_token_ids)) if self.eos_token_ids else ""
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos or "",
            eos_token=eos or "",
        )

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        # The template writes any BOS itself.
        return self.encode(self.render_chat(messages, add_generation_prompt), add_bos=False)

    def to_dir(self, path: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (chat template, bos/eos) as HF does."""
        path = Path(path)
        self.backend.save(str(path / "tokenizer.json"))
        cfg: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos,
        }
        if self.bos_token_id is not None:
            cfg["bos_token"] = self.id_to_token(self.bos_token_id)
        if self.eos_token_ids:
            cfg["eos_token"] = self.id_to_token(min(self.eos_token_ids))
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def byte_level_bpe(
    tokens: list[str],
    merges: list[str] | list[tuple[str, str]],
    special: list[str],
    pre: str = "gpt2",
) -> tokenizers.Tokenizer:
    """A byte-level BPE tokenizer from a vocabulary (id order), merges and the special tokens among
    them."""
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]
    tok = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=False)
    )
    tok.pre_tokenizer = _byte_level_pre(pre)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [tokenizers.AddedToken(s, special=True, normalized=False) for s in special]
    )
    return tok


def from_gguf_fields(fields: dict[str, Any]) -> Tokenizer:
    """The tokenizer a GGUF file carries (`tokenizer.ggml.*`, `tokenizer.chat_template`)."""
    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2 byte-level BPE)"
        )
    tokens = fields["tokenizer.ggml.tokens"]
    types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    special = [t for t, ty in zip(tokens, types) if ty in (3, 4)]  # CONTROL and USER_DEFINED
    backend = byte_level_bpe(
        tokens,
        fields.get("tokenizer.ggml.merges", []),
        special,
        fields.get("tokenizer.ggml.pre", "gpt2"),
    )
    eos = {
        fields[k]
        for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        if k in fields
    }
    return Tokenizer(
        backend,
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos,
        chat_template=fields.get("tokenizer.chat_template"),
        add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
    )


def from_hf_dir(path: Path, eos_token_ids: list[int], bos_token_id: int | None) -> Tokenizer:
    """tokenizer.json plus tokenizer_config.json (chat template, special tokens) from a HF
    directory."""
    tj = path / "tokenizer.json"
    if not tj.exists():
        raise FileNotFoundError(f"{path} has no tokenizer.json")
    backend = tokenizers.Tokenizer.from_file(str(tj))
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    template = cfg.get("chat_template")
    jinja = path / "chat_template.jinja"
    if template is None and jinja.exists():
        template = jinja.read_text()
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)

    def tok_id(v: Any) -> int | None:
        if isinstance(v, dict):
            v = v.get("content")
        return backend.token_to_id(v) if isinstance(v, str) else None

    eos = set(eos_token_ids)
    if not eos and (e := tok_id(cfg.get("eos_token"))) is not None:
        eos.add(e)
    bos = bos_token_id if bos_token_id is not None else tok_id(cfg.get("bos_token"))
    # A post-processor in tokenizer.json may add BOS already; we add it ourselves when asked.
    return Tokenizer(backend, bos, eos, template, add_bos=bool(cfg.get("add_bos_token", False)))


TINY_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_byte_tokenizer() -> Tokenizer:
    """A tokenizer built in code: the 256 byte tokens (GPT-2's byte alphabet), no merges, 3 special
    tokens."""
    backend = byte_level_bpe(TINY_SPECIAL + _gpt2_byte_chars(), [], TINY_SPECIAL)
    return Tokenizer(
        backend, bos_token_id=0, eos_token_ids={0, 2}, chat_template=TINY_CHAT_TEMPLATE
    )


def _gpt2_byte_chars() -> list[str]:
    """The character GPT-2's byte-level BPE writes for each byte 0..255 (printable bytes stand for
    themselves)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, shifted = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return [chars[b] for b in range(256)]
