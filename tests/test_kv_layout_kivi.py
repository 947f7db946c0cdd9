"""The KIVI-packed KV layout: packed blocks are what the KIVI kernels read, travel as raw bytes,
and carry their bits, group size and window in the fingerprint."""

from __future__ import annotations

import pytest
import torch

from kernels import (
    KV_LAYOUTS,
    FullKVLayout,
    KiviKVLayout,
    kivi_dequantize,
    kivi_from_bytes,
    kivi_quantize,
    paged_decode_attention,
    paged_decode_attention_kivi,
)
from kvstore.client import decode_block, encode_block

L, H, D, BS = 3, 2, 16, 16


def _blocks(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, L, 2, BS, H, D, generator=g)


@pytest.mark.parametrize("bits", [4, 2])
def test_pack_is_kivi_quantize_per_layer_and_unpack_its_inverse(bits):
    layout = KiviKVLayout(L, H, D, BS, bits)
    blocks = _blocks(5)
    packed = layout.pack(blocks)
    assert packed.shape == (5, *layout.block_shape) and packed.dtype == torch.uint8
    for b in range(5):
        for layer in range(L):
            want = kivi_quantize(blocks[b, layer], bits, 32)
            got = kivi_from_bytes(packed[b, layer].numpy().tobytes(), BS, H, D, bits, 32)
            for w, g in zip(want, got):
                assert torch.equal(w, g)
    want = kivi_dequantize(kivi_quantize(blocks, bits, 32), torch.float32)
    assert torch.equal(layout.unpack(packed), want)
    err = (layout.unpack(packed) - blocks).abs().max().item()
    assert 0 < err < (0.6 if bits == 4 else 2.5)  # lossy, and bounded by the group's step


def test_layer_views_are_what_the_kivi_attention_reads():
    layout = KiviKVLayout(L, H, D, BS, 4)
    pool = layout.empty_blocks(6)
    blocks = _blocks(6, seed=1)
    layout.pack(blocks, out=pool)
    dense = layout.unpack(pool)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 2 * H, D, generator=g)
    tables = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    lens = torch.tensor([40, 23], dtype=torch.int32)
    for layer in range(L):
        got = paged_decode_attention_kivi(q, layout.layer_views(pool, layer), tables, lens)
        want = paged_decode_attention(q, dense[:, layer, 0], dense[:, layer, 1], tables, lens)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # the views write through to the pool
    view = layout.layer_views(pool, 1)
    view.k_codes[3].zero_()
    assert int(pool[3, 1].sum()) < int(layout.pack(blocks[3:4])[0, 1].sum())


def test_packed_blocks_travel_as_raw_bytes_bit_exact():
    layout = KiviKVLayout(L, H, D, BS, 2)
    packed = layout.pack(_blocks(2, seed=3))
    for b in range(2):
        data = encode_block(packed[b], "fp", layout.store_codec)
        assert torch.equal(decode_block(data, model_fingerprint="fp"), packed[b])
    full = FullKVLayout(L, H, D, BS, torch.float16)
    assert layout.block_bytes < 0.3 * full.block_bytes  # what a packed block saves in transfer


def test_fingerprint_and_checks():
    ids = {
        KiviKVLayout(L, H, D, BS, 4).fingerprint_id,
        KiviKVLayout(L, H, D, BS, 2).fingerprint_id,
        KiviKVLayout(L, H, D, BS, 4, residual=64).fingerprint_id,
        KiviKVLayout(L, H, D, BS, 4, group_size=16).fingerprint_id,
        KiviKVLayout(L, H, D, BS, 4, window_dtype=torch.bfloat16).fingerprint_id,
        FullKVLayout(L, H, D, BS, torch.float16).fingerprint_id,
    }
    assert len(ids) == 6
    assert KV_LAYOUTS["kivi"] is KiviKVLayout
    with pytest.raises(ValueError, match="multiple of the block size"):
        KiviKVLayout(L, H, D, BS, 4, residual=20)
    with pytest.raises(ValueError):
        KiviKVLayout(L, H, D, BS, 3)


def test_bytes_per_token_amortises_the_window():
    layout = KiviKVLayout(L, H, D, BS, 4, residual=32)
    packed, window = layout.block_bytes / BS, layout.window_layout.block_bytes / BS
    assert layout.bytes_per_token(32) == window  # all in the window
    assert layout.bytes_per_token(2048) == pytest.approx((2016 * packed + 32 * window) / 2048)
