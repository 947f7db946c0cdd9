"""DeepSeek-V2-family models from GGUF files (llama.cpp's `deepseek2` architecture): small random
DeepseekV2/V3ForCausalLM checkpoints written to GGUF the way llama.cpp's convert_hf_to_gguf.py
does (its metadata keys, gguf-py's own tensor-name map, stacked experts, kv_b_proj split into
attn_k_b / attn_v_b or the older single attn_kv_b, F32 / F16 / Q8_0), loaded by `load_model`
and checked against transformers' forward, together with their byte-level BPE tokenizer."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

from model import (
    Engine,
    KVPool,
    ModelConfig,
    SamplingParams,
    load_model,
    load_model_info,
    save_hf_dir,
)
from model.deepseek import mla_rope, mla_softmax_scale

pytest.importorskip("transformers.models.deepseek_v2")
gguf = pytest.importorskip("gguf")

F32 = gguf.GGMLQuantizationType.F32
F16 = gguf.GGMLQuantizationType.F16
Q8_0 = gguf.GGMLQuantizationType.Q8_0
# fp32 on both sides over the same weights: worst difference seen 1e-5 where logits reach ~6,
# 6e-5 in the tied YaRN case where they reach ~35 (bounded as test_model_mla bounds fp32).
LOGITS_TOL = 1e-3
# Against the checkpoint's own weights, (median, worst) over a 48-token prompt of each token's
# largest logit difference. F16 rounds every matrix (seen 0.008, 0.025); Q8_0 rounds most to 8
# bits (seen 0.21, 1.7: a token whose expert choice flips moves most), the bounds ~2x that.
ROUNDED_TOL = {F32: (LOGITS_TOL, LOGITS_TOL), F16: (0.03, 0.1), Q8_0: (0.5, 4.0)}

BOS, EOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>"
MERGES = [
    "\u0120 t",
    "h e",
    "\u0120t he",
    "i n",
    "\u0120 a",
    "e r",
    "o n",
    "\u0120 o",
    "\u0120o f",
    "r e",
    "a t",
    "e n",
    "1 2",
    "12 3",
    "\u0120 c",
    "a f",
    "\u0120c af",
]
VOCAB = 300  # 2 special + 256 bytes + merges, padded as the converter pads to the model's vocab

_BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=1,
)
# GGUF holds one YaRN magnitude (yarn_log_multiplier = 0.1 * mscale_all_dim) and llama.cpp takes
# mscale equal to it, as DeepSeek's own configs have it (V2: 0.707 both).
_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 32,  # 8 * 32 = max_position_embeddings
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "beta_fast": 32,
    "beta_slow": 1,
}
# name -> (transformers config class, its fields over _BASE, tokenizer.ggml.pre)
CASES = {
    # q_lora_rank, a dense first layer, then routed experts beside two shared ones
    "v2-qlora-moe": (
        "DeepseekV2Config",
        dict(
            q_lora_rank=32,
            n_routed_experts=6,
            n_shared_experts=2,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            routed_scaling_factor=1.5,
        ),
        "deepseek-llm",
    ),
    # full-rank q_proj, group-limited softmax gating, YaRN, tied head
    "v2-yarn-grouped-tied": (
        "DeepseekV2Config",
        dict(
            q_lora_rank=None,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=3,
            first_k_dense_replace=1,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            rope_parameters=_YARN,
            tie_word_embeddings=True,
        ),
        "deepseek-llm",
    ),
    # V3: sigmoid scores, exp_probs_b (e_score_correction_bias), noaux_tc groups, renormalised
    "v3-noaux": (
        "DeepseekV3Config",
        dict(
            q_lora_rank=32,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        ),
        "deepseek-v3",
    ),
}
# the GGUF files: (case, kv_b form, weight type)
FILES = [
    ("v2-qlora-moe", "split", F32),
    ("v2-qlora-moe", "legacy", F16),
    ("v2-qlora-moe", "split", Q8_0),
    ("v2-yarn-grouped-tied", "split", F32),
    ("v3-noaux", "split", F32),
]


def _file_id(f) -> str:
    return f"{f[0]}-{f[1]}-{f[2].name}"


def _randomize(hf, seed: int) -> None:
    """Seeded weights that separate logits and expert scores well (as test_model_mla)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in hf.named_parameters():
            if "norm" in name:
                t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=g))
            elif "embed" in name:
                t.copy_(torch.randn(t.shape, generator=g))
            else:
                t.copy_(torch.randn(t.shape, generator=g) * 1.5 / math.sqrt(t.shape[-1]))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


# ---- a GGUF writer that does what convert_hf_to_gguf.py's DeepseekV2Model does ----


def _tokenizer_fields(w, pre: str) -> None:
    from tokenizers import pre_tokenizers

    tokens = [BOS, EOS, *sorted(pre_tokenizers.ByteLevel.alphabet())]
    tokens += ["".join(m.split(" ")) for m in MERGES]
    types = [gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.NORMAL] * (len(tokens) - 2)
    for i in range(len(tokens), VOCAB):  # the converter's padding up to vocab_size
        tokens.append(f"[PAD{i}]")
        types.append(gguf.TokenType.UNUSED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)


def _stored_type(gguf_name: str, arr: np.ndarray, qtype) -> gguf.GGMLQuantizationType:
    """The converter's choice: 1-D tensors, norms, biases and the router stay F32; a Q8_0 row
    that is not a whole number of 32-blocks falls back to F16."""
    if (
        arr.ndim <= 1
        or gguf_name.endswith("_norm.weight")
        or not gguf_name.endswith(".weight")
        or ".ffn_gate_inp." in gguf_name
    ):
        return F32
    if qtype == Q8_0 and arr.shape[-1] % gguf.GGML_QUANT_SIZES[Q8_0][0]:
        return F16
    return qtype


def _converted_tensors(hp: dict, sd: dict[str, torch.Tensor], split: bool):
    """(HF-side name, tensor) as the converter hands them to the name map: experts stacked per
    layer, kv_b_proj split per head with k_b transposed, lm_head dropped when tied,
    e_score_correction_bias renamed to a .bias."""
    heads, nope, v = hp["num_attention_heads"], hp["qk_nope_head_dim"], hp["v_head_dim"]
    out = []
    for name, t in sd.items():
        if hp.get("tie_word_embeddings") and name == "lm_head.weight":
            continue
        if ".mlp.experts." in name:
            continue  # stacked below
        if name.endswith("e_score_correction_bias"):
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if split and name.endswith("kv_b_proj.weight"):
            kv_b = t.view(heads, nope + v, t.shape[-1])
            k_b, v_b = torch.split(kv_b, [nope, v], dim=1)
            out.append((name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2)))
            out.append((name.replace("kv_b_proj", "v_b_proj"), v_b))
            continue
        out.append((name, t))
    for layer in range(hp["first_k_dense_replace"], hp["num_hidden_layers"]):
        for proj in ("down_proj", "gate_proj", "up_proj"):
            experts = [
                sd[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"]
                for e in range(hp["n_routed_experts"])
            ]
            out.append((f"model.layers.{layer}.mlp.experts.{proj}.weight", torch.stack(experts)))
    return out


def write_deepseek2_gguf(
    hf_dir: Path,
    path: Path,
    *,
    split: bool = True,
    qtype=F32,
    pre: str = "deepseek-llm",
    drop_keys: tuple[str, ...] = (),
    drop_tensors: tuple[str, ...] = (),
    arch: str = "deepseek2",
) -> Path:
    """A HF checkpoint directory (config.json, *.safetensors) as a GGUF file."""
    from safetensors.torch import load_file

    hp = json.loads((hf_dir / "config.json").read_text())
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        sd.update(load_file(f))
    v3 = hp["model_type"] == "deepseek_v3"
    rope = hp.get("rope_parameters") or hp.get("rope_scaling") or {}
    w = gguf.GGUFWriter(str(path), arch)
    # TextModel.set_gguf_parameters (num_key_value_heads set to 1 first by the MLA converter)
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(1 if split else hp["num_attention_heads"])
    w.add_rope_freq_base(rope.get("rope_theta", hp.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_expert_count(hp["n_routed_experts"])
    w.add_expert_used_count(hp["num_experts_per_tok"])
    if hp.get("n_group") is not None:
        w.add_expert_group_count(hp["n_group"])
    if hp.get("topk_group") is not None:
        w.add_expert_group_used_count(hp["topk_group"])
    scoring = hp.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    w.add_expert_gating_func(
        gguf.ExpertGatingFuncType.SIGMOID
        if scoring == "sigmoid"
        else gguf.ExpertGatingFuncType.SOFTMAX
    )
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_file_type({F32: 0, F16: 1, Q8_0: 7}[qtype])  # LlamaFileType ALL_F32 / MOSTLY_F16 / Q8_0
    # DeepseekV2Model.set_gguf_parameters
    w.add_leading_dense_block_count(hp["first_k_dense_replace"])
    w.add_vocab_size(hp["vocab_size"])
    if hp.get("q_lora_rank") is not None:
        w.add_q_lora_rank(hp["q_lora_rank"])
    kv_lora, rope_dim = hp["kv_lora_rank"], hp["qk_rope_head_dim"]
    w.add_kv_lora_rank(kv_lora)
    if split:  # MLA written as MQA over the latent, the per-head dims in the _mla keys
        w.add_key_length(kv_lora + rope_dim)
        w.add_value_length(kv_lora)
        w.add_key_length_mla(hp["qk_nope_head_dim"] + rope_dim)
        w.add_value_length_mla(hp["v_head_dim"])
    else:  # converters before the split
        w.add_key_length(hp["qk_nope_head_dim"] + rope_dim)
        w.add_value_length(hp["v_head_dim"])
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_shared_count(hp["n_shared_experts"])
    w.add_expert_weights_scale(hp["routed_scaling_factor"])
    if hp.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rope_dim)
    if rope.get("mscale_all_dim") is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    _tokenizer_fields(w, pre)
    for key in drop_keys:
        del w.kv_data[0][key]

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, hp["num_hidden_layers"])
    for hf_name, t in _converted_tensors(hp, sd, split):
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        if name in drop_tensors:
            continue
        arr = t.float().contiguous().numpy()
        stored = _stored_type(name, arr, qtype)
        if stored == Q8_0:
            w.add_tensor(name, gguf.quants.quantize(arr, Q8_0), raw_dtype=Q8_0)
        else:
            w.add_tensor(name, arr.astype(np.float16 if stored == F16 else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- fixtures ----


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (transformers' model, its save_pretrained directory), built on first use."""
    import transformers

    built = {}

    def get(case: str):
        if case not in built:
            cls_name, fields, _ = CASES[case]
            if not hasattr(transformers, cls_name):
                pytest.skip(f"this transformers has no {cls_name}")
            config = getattr(transformers, cls_name)(**_BASE, **fields)
            torch.manual_seed(0)
            hf = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))(config).eval()
            _randomize(hf, seed=len(case))
            path = tmp_path_factory.mktemp(case)
            hf.save_pretrained(path)
            built[case] = hf, path
        return built[case]

    return get


@pytest.fixture(scope="module")
def gguf_files(checkpoints, tmp_path_factory):
    """(case, form, qtype) -> the GGUF file written from that case's checkpoint."""
    written = {}

    def get(case: str, form: str = "split", qtype=F32, **kw):
        key = (case, form, qtype, tuple(sorted(kw.items())))
        if key not in written:
            _, hf_dir = checkpoints(case)
            path = tmp_path_factory.mktemp("gguf") / f"{case}-{form}-{qtype.name}.gguf"
            written[key] = write_deepseek2_gguf(
                hf_dir, path, split=form == "split", qtype=qtype, pre=CASES[case][2], **kw
            )
        return written[key]

    return get


class Loaded(NamedTuple):
    hf: Any  # transformers' model of the checkpoint the file was written from
    hf_file: Any  # transformers' model over the weights as the file stores them (rounded)
    lm: Any  # ours, loaded from the GGUF file
    qtype: Any  # the file's weight type
    hf_dir: Path  # the checkpoint directory


@pytest.fixture(scope="module", params=FILES, ids=_file_id)
def loaded(request, checkpoints, gguf_files, tmp_path_factory) -> Loaded:
    from transformers import AutoModelForCausalLM

    case, form, qtype = request.param
    hf, hf_dir = checkpoints(case)
    lm = load_model(str(gguf_files(case, form, qtype)))
    hf_file = hf
    if qtype != F32:  # the rounded weights, given to transformers through a HF directory
        path = save_hf_dir(lm, tmp_path_factory.mktemp("rounded"))
        hf_file = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return Loaded(hf, hf_file, lm, qtype, hf_dir)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (n,), generator=g).tolist()


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def _our_logits(lm, ids: list[int]) -> torch.Tensor:
    pool = KVPool(lm.config, 16, 16)
    return lm.model.prefill(torch.tensor(ids), pool, pool.allocate(pool.blocks_for(len(ids))))


# ---- the model ----


def test_weights_are_the_checkpoints(loaded):
    """Every weight read back (experts taken apart, kv_b_proj rebuilt from the transposed k_b
    and v_b, or read whole) is the checkpoint's: bit for bit from F32, and within the type's
    rounding of the tensor's largest value from F16 (2^-11) and Q8_0 (half a step of amax/127
    per 32 values, the fp16 scale's rounding on top)."""
    from safetensors.torch import load_file

    theirs = load_file(next(loaded.hf_dir.glob("*.safetensors")))
    ours = loaded.lm.model.hf_state_dict()
    tied = {"lm_head.weight"} if loaded.lm.config.tie_word_embeddings else set()
    assert set(ours) == set(theirs) - tied
    bound = {F32: 0.0, F16: 2.0**-11, Q8_0: 1 / 254 + 2.0**-11}[loaded.qtype]
    for name, t in ours.items():
        ref = theirs[name].float()
        assert (t - ref).abs().max().item() <= bound * ref.abs().max().item(), name


def test_logits_match_transformers(loaded):
    hf, hf_file, lm, qtype, _ = loaded
    ids = _prompt(48, 1)  # past the YaRN case's original 32 positions
    ours = _our_logits(lm, ids)
    # the same weights: as tight as fp32 allows
    assert (ours - _hf_logits(hf_file, ids)).abs().max().item() <= LOGITS_TOL
    # the checkpoint's own weights: as far as the file's rounding moves them
    per_token = (ours - _hf_logits(hf, ids)).abs().amax(dim=-1)
    median, worst = ROUNDED_TOL[qtype]
    assert per_token.median().item() <= median and per_token.max().item() <= worst


def test_greedy_tokens_agree_with_transformers(loaded):
    hf_file, lm = loaded.hf_file, loaded.lm
    ids = _prompt(20, 3)
    with torch.inference_mode():
        out = hf_file.generate(
            torch.tensor([ids]),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    ours = Engine(lm, block_size=8).generate(ids, SamplingParams(max_tokens=12, ignore_eos=True))
    assert ours == out[0, len(ids) :].tolist()


def test_config_matches_the_hf_config(checkpoints, gguf_files):
    """The GGUF metadata, either kv_b form, reads to the config read_hf_meta builds from the
    checkpoint's config.json: every field, and the RoPE frequencies and softmax scale of YaRN."""
    for case in CASES:
        _, hf_dir = checkpoints(case)
        want = ModelConfig.from_hf(json.loads((hf_dir / "config.json").read_text()))
        for form in ("split", "legacy"):
            got = load_model_info(str(gguf_files(case, form))).config
            fields = dataclasses.asdict(got)
            expected = dataclasses.asdict(want)
            # HF's YaRN dict carries keys the file does not (rope_theta, truncate): compare what
            # it computes
            assert (fields.pop("rope_scaling") is None) == (expected.pop("rope_scaling") is None)
            # the file stores floats in 32 bits (rms_norm_eps 1e-6 reads as 9.99999997e-07)
            for name, value in expected.items():
                if isinstance(value, float):
                    assert fields.pop(name) == pytest.approx(value, rel=1e-6), name
                    expected[name] = None
            assert fields == {k: v for k, v in expected.items() if v is not None}, (case, form)
            inv_freq, attention_factor = mla_rope(got)
            want_freq, want_factor = mla_rope(want)
            assert torch.allclose(inv_freq, want_freq, rtol=1e-6)
            assert attention_factor == pytest.approx(want_factor)
            assert mla_softmax_scale(got) == pytest.approx(mla_softmax_scale(want), rel=1e-6)
    yarn = load_model_info(str(gguf_files("v2-yarn-grouped-tied"))).config
    assert yarn.rope_scaling["rope_type"] == "yarn" and yarn.tie_word_embeddings
    assert mla_softmax_scale(yarn) > yarn.head_dim**-0.5  # mscale_all_dim came through
    assert yarn.q_lora_rank == 0 and yarn.topk_method == "group_limited_greedy"
    v3 = load_model_info(str(gguf_files("v3-noaux"))).config
    assert (v3.architecture, v3.scoring_func, v3.topk_method) == (
        "deepseek_v3",
        "sigmoid",
        "noaux_tc",
    )
    moe = load_model_info(str(gguf_files("v2-qlora-moe"))).config
    assert [moe.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert (moe.n_shared_experts, moe.q_lora_rank, moe.routed_scaling_factor) == (2, 32, 1.5)
    assert moe.kv_layout(16, torch.float32).block_shape == (3, 16, 32 + 8)


def test_model_info_reads_no_weights_and_names_the_file(gguf_files):
    path = gguf_files("v2-qlora-moe")
    info = load_model_info(str(path))
    again = load_model_info(str(path))
    assert info.weights_id == again.weights_id and info.name == str(path)
    other = load_model_info(str(gguf_files("v2-qlora-moe", "legacy")))
    assert other.weights_id != info.weights_id  # other bytes


# ---- the tokenizer ----


@pytest.mark.parametrize("pre", ["deepseek-llm", "deepseek-v3"])
def test_tokenizer_round_trips_text(gguf_files, pre):
    case = next(c for c, (_, _, p) in CASES.items() if p == pre)
    tok = load_model_info(str(gguf_files(case))).tokenizer
    assert tok.vocab_size == VOCAB and tok.bos_token_id == 0 and tok.eos_token_ids == {1}
    text = "The theory of 1234567 cafés:\n  naïve, 東京 — ok!\tend"
    ids = tok.encode(text)
    assert ids[0] == 0  # add_bos_token
    assert tok.decode(ids) == text
    # merges apply within the pre-tokenizer's pieces; special tokens stay whole
    assert tok.encode(" the", add_bos=False) == [tok.token_to_id("\u0120the")]
    assert tok.encode(f"a{EOS}", add_bos=False) == [tok.token_to_id("a"), 1]


def test_deepseek_pre_tokenizers_split_digits_their_own_way(gguf_files):
    """deepseek-llm keeps a run of digits whole (\\p{N}+), deepseek-v3 cuts it in threes."""
    llm = load_model_info(str(gguf_files("v2-qlora-moe"))).tokenizer
    v3 = load_model_info(str(gguf_files("v3-noaux"))).tokenizer

    def pieces(tok, text):
        return [tok.id_to_token(i) for i in tok.encode(text, add_bos=False)]

    assert pieces(llm, "4123") == ["4", "123"]
    assert pieces(v3, "4123") == ["4", "12", "3"]


# ---- malformed files ----


def test_missing_metadata_key_is_named(checkpoints, gguf_files):
    for key in ("deepseek2.attention.kv_lora_rank", "deepseek2.expert_used_count"):
        path = gguf_files("v2-qlora-moe", drop_keys=(key,))
        with pytest.raises(ValueError, match=re.escape(f"{path}: GGUF metadata lacks {key}")):
            load_model(str(path))
    # without either head-size key the per-head dims are unknown
    both = ("deepseek2.attention.key_length_mla", "deepseek2.attention.key_length")
    path = gguf_files("v2-qlora-moe", drop_keys=both)
    with pytest.raises(ValueError, match="lacks deepseek2.attention.key_length"):
        load_model_info(str(path))


def test_missing_tensor_is_named(gguf_files):
    for name in ("blk.2.ffn_down_exps.weight", "blk.0.attn_k_b.weight", "output.weight"):
        path = gguf_files("v2-qlora-moe", drop_tensors=(name,))
        if name == "output.weight":  # no output tensor is a tied head: then it loads
            assert load_model_info(str(path)).config.tie_word_embeddings
            continue
        with pytest.raises(ValueError, match=re.escape(f"{path}: GGUF file lacks tensors: {name}")):
            load_model(str(path))


def test_v3_file_without_score_bias_chooses_uncorrected(gguf_files, caplog):
    """exp_probs_b is optional in llama.cpp: a sigmoid-gated file without it loads with a zero
    score correction (logged); one with it on some MoE layers only is refused."""
    biases = ("blk.1.exp_probs_b.bias", "blk.2.exp_probs_b.bias")
    lm = load_model(str(gguf_files("v3-noaux", drop_tensors=biases)))
    assert lm.config.topk_method == "noaux_tc"
    assert all(not layer.router_bias.any() for layer in lm.model.layers[1:])
    assert "without exp_probs_b" in caplog.text
    path = gguf_files("v3-noaux", drop_tensors=biases[1:])
    with pytest.raises(ValueError, match="lacks tensors: blk.2.exp_probs_b.bias"):
        load_model_info(str(path))


def test_other_architectures_are_still_refused(checkpoints, tmp_path):
    _, hf_dir = checkpoints("v2-qlora-moe")
    path = write_deepseek2_gguf(hf_dir, tmp_path / "ocr.gguf", arch="deepseek2-ocr")
    with pytest.raises(ValueError, match="unsupported architecture 'deepseek2-ocr'"):
        load_model_info(str(path))
