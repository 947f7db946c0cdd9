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


def _byte_level_pre(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp's `tokenizer.ggml.pre` names (the ones we know)."""
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
        "(supported: smollm, starcoder, llama-bpe, gpt2)"
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
