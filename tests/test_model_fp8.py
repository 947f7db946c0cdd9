"""Block-scaled FP8 checkpoints (DeepSeek-V3's published format) load by multiplying each weight
out by its block's scale: the weights equal that product exactly, and the model then equals
transformers running the same dequantized weights."""

from __future__ import annotations

import json

import pytest
import torch

from model import Engine, KVPool, SamplingParams, load_model
from model.tokenizer import tiny_byte_tokenizer

pytest.importorskip("transformers.models.deepseek_v3")
if not hasattr(torch, "float8_e4m3fn"):
    pytest.skip("this torch has no float8_e4m3fn", allow_module_level=True)

from test_model_mla import _BASE, CASES, LOGITS_TOL, _randomize  # noqa: E402

BLOCK = (16, 16)  # smaller than DeepSeek-V3's 128 x 128, so that weights span several blocks
FP8_MAX = 448.0  # the largest float8_e4m3fn value


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, fp32 scale per block) with each block's largest value at FP8_MAX, as
    DeepSeek's own conversion makes them."""
    rows, cols = w.shape
    br, bc = -(-rows // BLOCK[0]), -(-cols // BLOCK[1])
    padded = torch.zeros(br * BLOCK[0], bc * BLOCK[1])
    padded[:rows, :cols] = w
    blocks = padded.view(br, BLOCK[0], bc, BLOCK[1])
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-8) / FP8_MAX
    full = scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)[:rows, :cols]
    return (w / full).to(torch.float8_e4m3fn), scale


def quantized_here(name: str, t: torch.Tensor) -> bool:
    """What DeepSeek-V3 stores in FP8: the linear layers' weights, not the embeddings, the
    head, the norms or the router."""
    return t.dim() == 2 and not any(x in name for x in ("embed", "lm_head", "norm", "mlp.gate."))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers' model holding the dequantized weights, the FP8 checkpoint's directory,
    the dequantized weights by name)."""
    import transformers
    from safetensors.torch import load_file, save_file

    cls_name, fields = CASES["v3-noaux"]
    config = getattr(transformers, cls_name)(**_BASE, **fields)
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(config).eval()
    _randomize(hf, seed=3)
    original = tmp_path_factory.mktemp("original")
    hf.save_pretrained(original)  # the checkpoint's own tensor names (one per expert)
    stored, dequantized = {}, {}
    for name, t in load_file(str(original / "model.safetensors")).items():
        if quantized_here(name, t):
            w8, scale = quantize(t.float())
            stored[name], stored[name + "_scale_inv"] = w8, scale
            full = scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
            dequantized[name] = w8.float() * full[: t.shape[0], : t.shape[1]]
        else:
            stored[name] = t.contiguous()
    assert sum(t.dtype == torch.float8_e4m3fn for t in stored.values()) > 20
    path = tmp_path_factory.mktemp("fp8")
    save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((original / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(BLOCK),
    }
    (path / "config.json").write_text(json.dumps(cfg))
    tiny_byte_tokenizer().to_dir(path)
    # transformers' model on exactly the weights the file means: the dequantized ones, in fp32
    plain = {k: v for k, v in stored.items() if not k.endswith("_scale_inv")}
    plain.update(dequantized)
    save_file(plain, str(original / "model.safetensors"), metadata={"format": "pt"})
    ref = transformers.DeepseekV3ForCausalLM.from_pretrained(original, dtype=torch.float32).eval()
    return ref, path, dequantized


def test_fp8_weights_are_multiplied_out_by_their_block_scales(checkpoint):
    hf, path, dequantized = checkpoint
    lm = load_model(str(path))
    ours = lm.model.hf_state_dict()
    for name, w in dequantized.items():
        assert torch.equal(ours[name].float(), w), name
    # the model runs them: logits and greedy tokens equal transformers' on the same weights
    ids = torch.randint(3, 259, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    pool = KVPool(lm.config, 8, 16)
    logits = lm.model.prefill(torch.tensor(ids), pool, pool.allocate(pool.blocks_for(len(ids))))
    assert (logits - ref).abs().max().item() <= LOGITS_TOL
    ours_tokens = Engine(lm).generate(ids, SamplingParams(max_tokens=8, ignore_eos=True))
    with torch.inference_mode():
        theirs = hf.generate(
            torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )[0, len(ids) :].tolist()
    assert ours_tokens == theirs


@pytest.mark.parametrize(
    "change, words",
    [
        ("drop_scale", "without model.layers.0.self_attn.o_proj.weight_scale_inv"),
        ("no_config", "declares no quantization_config"),
        ("awq", "quant_method 'awq' is not supported"),
        ("bad_scale", "expected"),
    ],
)
def test_a_broken_fp8_checkpoint_is_refused_naming_what_is_wrong(
    checkpoint, tmp_path, change, words
):
    from safetensors.torch import load_file, save_file

    _, path, _ = checkpoint
    sd = load_file(str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    if change == "drop_scale":
        del sd["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    elif change == "no_config":
        del cfg["quantization_config"]
    elif change == "awq":
        cfg["quantization_config"]["quant_method"] = "awq"
    else:
        name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
        sd[name] = sd[name][:, :1].contiguous()
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tiny_byte_tokenizer().to_dir(tmp_path)
    with pytest.raises(ValueError, match=words):
        load_model(str(tmp_path))
