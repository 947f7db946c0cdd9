"""KV layouts and the pool built on them; KV fingerprints; load_model_info against load_model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conductor import ConductorConfig
from kernels import KV_LAYOUTS, FullKVLayout, KVLayout
from model import KVPool, kv_fingerprint, load_model, load_model_info, save_hf_dir
from model.fetch import smollm2_path
from servekit import (
    DTYPE_NAMES,
    KIVI_WINDOW_DTYPES,
    KV_CACHE_DTYPES,
    is_kivi,
    kv_cache_layout,
    kv_cache_layout_id,
)

TEXT = "Hello, wörld! The capital of France is <|im_end|> 1234"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 5])
def test_layout_shapes_and_bytes_match_the_pool(tiny, dtype, block_size):
    c = tiny.config
    pool = KVPool(c, 6, block_size, dtype)
    layout = pool.layout
    assert isinstance(layout, KVLayout) and layout == c.kv_layout(block_size, dtype)
    assert KV_LAYOUTS[layout.name] is FullKVLayout and layout.store_codec == "raw"
    assert (layout.block_size, layout.num_layers, layout.dtype) == (block_size, c.num_layers, dtype)
    shape = (c.num_layers, 2, block_size, c.num_kv_heads, c.head_dim)
    assert layout.block_shape == pool.block_shape == shape
    assert pool.kv.shape == (6, *shape) and pool.kv.dtype == dtype
    assert pool.device == pool.kv.device == torch.device("cpu")
    itemsize = torch.finfo(dtype).bits // 8
    assert pool.block_bytes == layout.block_bytes == pool.kv[0].numel() * itemsize
    per_token = 2 * c.num_kv_heads * c.head_dim * itemsize
    assert layout.block_bytes == c.num_layers * block_size * per_token
    assert layout.layer_bytes * c.num_layers == layout.block_bytes
    # Layer-major: one layer of a block is the contiguous slice layer_bytes long.
    assert pool.kv[1, 1].data_ptr() - pool.kv[1, 0].data_ptr() == layout.layer_bytes
    assert pool.kv[2].data_ptr() - pool.kv[1].data_ptr() == layout.block_bytes
    assert pool.kv.abs().sum() == 0  # empty blocks are zeros: unwritten KV is inert


def test_layer_views_write_through_to_the_pool(tiny):
    c = tiny.config
    pool = KVPool(c, 5, 4)
    for layer in range(c.num_layers):
        k, v = pool.layout.layer_views(pool.kv, layer)
        assert k.shape == v.shape == (5, 4, c.num_kv_heads, c.head_dim)
        assert k.data_ptr() == pool.layer_kv(layer)[0].data_ptr()
        k[2, 1] = 7.0
        v[3, 0] = -1.0
    for layer in range(c.num_layers):
        assert pool.kv[2, layer, 0, 1].eq(7.0).all() and pool.kv[3, layer, 1, 0].eq(-1.0).all()
    assert pool.kv.ne(0).sum() == c.num_layers * 2 * c.num_kv_heads * c.head_dim


def test_explicit_layout_must_agree_with_the_pool(tiny):
    c = tiny.config
    layout = FullKVLayout(c.num_layers, c.num_kv_heads, c.head_dim, 8, torch.bfloat16)
    pool = KVPool(c, 3, 8, torch.bfloat16, layout=layout)
    assert pool.layout is layout and pool.kv.shape == (3, *layout.block_shape)
    with pytest.raises(ValueError, match="disagrees"):
        KVPool(c, 3, 16, torch.bfloat16, layout=layout)
    with pytest.raises(ValueError, match="disagrees"):
        KVPool(c, 3, 8, torch.float32, layout=layout)
    other_depth = FullKVLayout(c.num_layers + 1, c.num_kv_heads, c.head_dim, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="disagrees"):
        KVPool(c, 3, 8, torch.bfloat16, layout=other_depth)
    for bad in [dict(block_size=0), dict(head_dim=-2), dict(dtype=torch.int8)]:
        args = dict(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
        with pytest.raises(ValueError, match="FullKVLayout"):
            FullKVLayout(**{**args, **bad})


def test_fingerprints_follow_the_layout():
    def layout(block_size=16, dtype=torch.bfloat16, kv_heads=3):
        return FullKVLayout(30, kv_heads, 64, block_size, dtype)

    assert layout().fingerprint_id == "full/bfloat16/L30/H3/D64/B16"
    assert layout(dtype=torch.float32).fingerprint_id == "full/float32/L30/H3/D64/B16"
    w = "ab" * 16
    fp = kv_fingerprint(w, layout())
    assert len(fp) == 32 and int(fp, 16) >= 0
    assert kv_fingerprint(w, layout()) == fp  # equal layouts built apart: equal fingerprints
    assert kv_fingerprint(w, layout(dtype=torch.float32)) != fp
    assert kv_fingerprint(w, layout(block_size=8)) != fp
    assert kv_fingerprint(w, layout(kv_heads=1)) != fp
    assert kv_fingerprint("cd" * 16, layout()) != fp


@pytest.mark.parametrize("model", ["tiny-random", "tiny-random-mla"])
@pytest.mark.parametrize("kv_cache_dtype", sorted(KV_CACHE_DTYPES))
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_layout_ids_from_names_are_the_layouts_ids(model, kv_cache_dtype, dtype):
    # The conductor computes block keys from kv_cache_layout_id (no torch), the workers from
    # their layout objects: one id apart, and no prefix would ever hit.
    config = load_model_info(model).config
    for window in KIVI_WINDOW_DTYPES:
        cfg = ConductorConfig(
            kv_cache_dtype=kv_cache_dtype, kivi_window_dtype=window, kivi_residual=48, dtype=dtype
        )
        if config.is_mla and is_kivi(kv_cache_dtype):
            for make in (kv_cache_layout, kv_cache_layout_id):
                with pytest.raises(ValueError, match="MLA"):
                    make(config, cfg, getattr(torch, dtype) if make is kv_cache_layout else dtype)
            continue
        layout = kv_cache_layout(config, cfg, getattr(torch, dtype))
        assert kv_cache_layout_id(config, cfg, dtype) == layout.fingerprint_id
        assert kv_fingerprint("ab" * 16, layout.fingerprint_id) == kv_fingerprint("ab" * 16, layout)


def test_loaded_fingerprint_is_the_default_layout_in_the_loaded_dtype(tiny):
    bf = load_model("tiny-random", dtype=torch.bfloat16)
    assert bf.weights_id == tiny.weights_id and bf.fingerprint != tiny.fingerprint
    for lm, dtype in [(tiny, torch.float32), (bf, torch.bfloat16)]:
        assert lm.fingerprint == kv_fingerprint(lm.weights_id, lm.config.kv_layout(16, dtype))


def _assert_same_model(info, lm) -> None:
    assert info.weights_id == lm.weights_id and info.name == lm.name
    assert info.config == lm.config
    assert info.tokenizer.encode(TEXT) == lm.tokenizer.encode(TEXT)
    assert info.tokenizer.apply_chat_template(CHAT) == lm.tokenizer.apply_chat_template(CHAT)


def test_model_info_agrees_with_load_model_tiny_and_hf_dir(tiny, tmp_path):
    _assert_same_model(load_model_info("tiny-random"), tiny)
    path = save_hf_dir(tiny, tmp_path / "tiny")
    _assert_same_model(load_model_info(str(path)), load_model(str(path)))
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        load_model_info("nope")
    with pytest.raises(FileNotFoundError):
        load_model_info(str(tmp_path / "absent.gguf"))


# ---- the real default model ----

needs_smollm2 = pytest.mark.skipif(
    not smollm2_path().exists(), reason="SmolLM2 GGUF not fetched (make setup)"
)

# Runs in a fresh interpreter so that only load_model_info's own allocations move the peak.
_INFO_PROBE = """
import json, resource, sys
import model  # torch, tokenizers, kernels: the baseline every caller pays anyway
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
info = model.load_model_info("smollm2-135m")
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
text, chat = json.loads(sys.argv[1])
print(json.dumps({
    "peak_growth_bytes": (after - before) * 1024,  # ru_maxrss is in KiB on Linux
    "weights_id": info.weights_id,
    "config": info.config.to_dict(),
    "encoded": info.tokenizer.encode(text),
    "chat": info.tokenizer.apply_chat_template(chat),
}))
"""


@pytest.fixture(scope="module")
def smollm2():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as tests/test_model_smollm2.py: a shared 2-core machine
    yield load_model("smollm2-135m")
    torch.set_num_threads(threads)


@needs_smollm2
@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss units differ off Linux")
def test_model_info_smollm2_agrees_and_loads_no_weights(smollm2):
    proc = subprocess.run(
        [sys.executable, "-c", _INFO_PROBE, json.dumps([TEXT, CHAT])],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1],
    )
    assert proc.returncode == 0, proc.stderr
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    assert probe["weights_id"] == smollm2.weights_id
    assert probe["config"] == smollm2.config.to_dict()
    assert probe["encoded"] == smollm2.tokenizer.encode(TEXT)
    assert probe["chat"] == smollm2.tokenizer.apply_chat_template(CHAT)
    # The weights load_model builds: fp32, ~540 MB. The metadata and tokenizer cost ~40 MB;
    # gguf.GGUFReader alone (a numpy view per token string) grew it by ~200 MB.
    weights_bytes = sum(p.numel() * p.element_size() for p in smollm2.model.parameters())
    growth = probe["peak_growth_bytes"]
    assert growth < weights_bytes / 4, f"peak RSS grew {growth >> 20} MiB"


@needs_smollm2
def test_gguf_metadata_reader_matches_gguf_library():
    import gguf

    from model.checkpoint import read_gguf_meta

    reader = gguf.GGUFReader(str(smollm2_path()))
    meta = read_gguf_meta(smollm2_path())
    theirs = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert meta.fields == theirs
    assert {k: type(v) for k, v in meta.fields.items()} == {k: type(v) for k, v in theirs.items()}
    assert [(t.name, t.offset, t.nbytes, t.qtype) for t in meta.tensors] == [
        (t.name, t.data_offset, int(t.n_bytes), int(t.tensor_type)) for t in reader.tensors
    ]
    assert [t.shape for t in meta.tensors] == [tuple(int(d) for d in reversed(t.shape))
                                               for t in reader.tensors]


@needs_smollm2
def test_model_info_refuses_truncated_gguf(tmp_path):
    data = smollm2_path().read_bytes()
    header_cut = tmp_path / "header_cut.gguf"
    header_cut.write_bytes(data[:200_000])
    with pytest.raises(ValueError, match="corrupt GGUF"):
        load_model_info(str(header_cut))
    tensors_cut = tmp_path / "tensors_cut.gguf"
    tensors_cut.write_bytes(data[:-4096])  # metadata whole, the last tensor short
    with pytest.raises(ValueError, match="runs past the end"):
        load_model_info(str(tensors_cut))
