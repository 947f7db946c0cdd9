"""The fused CPU decode-attention kernels (kernels/native.py, kernels/csrc/decode_attention.c)
against the torch twin and float64 dense attention: full-precision pools in fp32/bf16/fp16 read
in place from a layer-major pool, KIVI pools of 2/4/8 bits with key groups shorter than a block,
odd head dims and block sizes (the vector loops' tails), empty sequences, bad block tables."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import kernels
from kernels import FullKVLayout, KiviKVLayout, native
from kernels.native import (
    paged_attention_full,
    paged_attention_kivi,
    paged_attention_kivi_window,
)
from kernels.paged_attention_torch import _full_parts, _kivi_parts

pytestmark = pytest.mark.skipif(
    not kernels.native_status().available, reason=kernels.native_status().detail
)


def test_the_kernels_build_here():
    # CI machines have a C compiler: the fused path must be there, not silently the twin.
    status = kernels.native_status()
    assert status.available and status.detail.endswith(".so"), status


def test_another_kind_of_cpu_gets_its_own_library_in_the_cache():
    # a cache shared between machines must never hand one CPU a library built for another's
    # instructions: what -march=native means here is part of the library's name
    cc = native._compiler()
    here = native._native_target(cc)
    assert "__SSE2__" in here  # the compiler's view of this CPU, not an empty string
    assert native._library_path(cc, here) == native._library_path(cc, here)
    amx = here + "#define __AMX_TILE__ 1\n"
    assert native._library_path(cc, here) != native._library_path(cc, amx)


@pytest.fixture
def torch_threads():
    """A setter of torch's thread count (the kernels' too) for one test, restored after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def case(seed, lens, kv_heads=3, group=3, head_dim=64, block_size=16, extra_blocks=5):
    g = torch.Generator().manual_seed(seed)
    batch = len(lens)
    cols = max(1, -(-max(lens) // block_size))
    num_blocks = batch * cols + extra_blocks
    q = torch.randn(batch, kv_heads * group, head_dim, generator=g)
    kv = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, generator=g)
    table = torch.randperm(num_blocks, generator=g)[: batch * cols].view(batch, cols)
    return q, kv, table.to(torch.int32), torch.tensor(lens, dtype=torch.int32)


def dense(q, k, v, table, lens, scale):
    """float64 attention of each sequence over its first lens[b] tokens (0 when empty)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    bs, kh = k.shape[1], k.shape[2]
    for b, n in enumerate(lens.tolist()):
        if not n:
            continue
        kb = k[table[b].long()].reshape(-1, kh, k.shape[3])[:n].double()
        vb = v[table[b].long()].reshape(-1, kh, v.shape[3])[:n].double()
        rep = q.shape[1] // kh
        kr, vr = kb.repeat_interleave(rep, 1), vb.repeat_interleave(rep, 1)
        s = torch.einsum("hd,thd->ht", q[b].double(), kr) * scale
        lse[b] = torch.logsumexp(s, -1)
        out[b] = torch.einsum("ht,thd->hd", torch.softmax(s, -1), vr)
    assert bs  # blocks exist
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "lens,head_dim,block_size,group",
    [
        ([0, 1, 16, 45], 64, 16, 3),
        ([7, 33], 40, 8, 1),
        # head dims over 64 in multiples of it, groups of 4: the AVX-512 tiled path (tokens in
        # fours with a short tail, rows in fours)
        ([5, 70, 2], 128, 6, 4),
        ([1, 19, 64], 192, 16, 8),
        ([300], 64, 16, 3),
        # head_dim 64, blocks of <= 16: the AVX-512 block path, a group of 4 then the rest
        ([3, 20, 31], 64, 16, 5),
        ([17, 9], 64, 8, 2),
        ([33], 64, 16, 1),
    ],
)
def test_full_precision_pool_read_in_place(dtype, lens, head_dim, block_size, group):
    q, kv, table, seq_lens = case(1, lens, 2, group, head_dim, block_size)
    layout = FullKVLayout(2, 2, head_dim, block_size, dtype)
    pool = layout.empty_blocks(kv.shape[0])
    pool[:, 1] = kv.to(dtype)  # layer 1 of a layer-major pool: strided views
    k, v = layout.layer_views(pool, 1)
    assert not k.is_contiguous()
    out, lse = paged_attention_full(q, k, v, table, seq_lens)
    want, want_lse = dense(q, k.float(), v.float(), table, seq_lens, head_dim**-0.5)
    assert (out.double() - want).abs().max() < 2e-5
    finite = want_lse.isfinite()
    assert torch.equal(lse.isfinite(), finite)
    assert (lse.double()[finite] - want_lse[finite]).abs().max() < 2e-5
    assert torch.all(out[seq_lens == 0] == 0)
    twin, twin_lse = _full_parts(q, k, v, table, seq_lens, None, None)
    assert (out - twin).abs().max() < 2e-5


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lens,group", [([0, 1, 16, 45], 3), ([3, 20, 31], 5), ([300], 1)])
def test_bf16_queries_over_a_bf16_pool(lens, group, threads, torch_threads):
    """Query rows that are bf16 values (a bf16 model's) over a bf16 pool, head_dim 64: the block
    path takes the key rows as they lie (vdpbf16ps on the pairs) and widens values in registers;
    the result is attention over the widened rows. With at least two sequences a thread, one
    work item takes a sequence's heads together, block by block; with fewer, a head each."""
    torch_threads(threads)
    q, kv, table, seq_lens = case(4, lens, 2, group, 64, 16)
    q = q.to(torch.bfloat16).float()  # each value a bf16 exactly, as is its 1/8 scaling
    layout = FullKVLayout(2, 2, 64, 16, torch.bfloat16)
    pool = layout.empty_blocks(kv.shape[0])
    pool[:, 1] = kv.to(torch.bfloat16)
    k, v = layout.layer_views(pool, 1)
    out, lse = paged_attention_full(q, k, v, table, seq_lens)
    want, want_lse = dense(q, k.float(), v.float(), table, seq_lens, 64**-0.5)
    assert (out.double() - want).abs().max() < 2e-5
    finite = want_lse.isfinite()
    assert (lse.double()[finite] - want_lse[finite]).abs().max() < 2e-5
    assert torch.all(out[seq_lens == 0] == 0)
    # the same queries a hair off bf16 take the widening path: the same attention
    nudged, _ = paged_attention_full(q * (1 + 2**-20), k, v, table, seq_lens)
    assert (nudged.double() - want).abs().max() < 1e-4


@pytest.mark.parametrize("head_dim,group", [(128, 4), (192, 8), (128, 3)])
def test_bf16_queries_over_a_bf16_pool_of_wide_heads(head_dim, group):
    """Query rows that are bf16 values over a bf16 pool of heads wider than 64: where AVX-512
    BF16 tiles them (rows in fours), the keys are scored as they lie on vdpbf16ps against the
    unscaled query (the scale is not a power of two: applied to the sums), values widened; a
    group of 3 goes row by row. Either way: attention over the widened rows."""
    q, kv, table, seq_lens = case(6, [5, 70, 33], 2, group, head_dim, 16)
    q = q.to(torch.bfloat16).float()
    layout = FullKVLayout(2, 2, head_dim, 16, torch.bfloat16)
    pool = layout.empty_blocks(kv.shape[0])
    pool[:, 0] = kv.to(torch.bfloat16)
    k, v = layout.layer_views(pool, 0)
    out, lse = paged_attention_full(q, k, v, table, seq_lens)
    want, want_lse = dense(q, k.float(), v.float(), table, seq_lens, head_dim**-0.5)
    assert (out.double() - want).abs().max() < 2e-5
    assert (lse.double() - want_lse).abs().max() < 2e-5


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_kivi_sequences_with_all_their_heads_give_a_head_at_a_time_bits(
    bits, window, threads, torch_threads
):
    """With at least two sequences a thread, a work item takes a sequence's heads together,
    block by block (and then its bf16 window): each query row meets the same blocks in the same
    order as in an item per head (a sequence alone), so its output and lse are the same bits."""
    torch_threads(threads)
    lens = [0, 1, 16, 45, 90, 33, 7, 64]
    q, kv, table, seq_lens = case(6, lens, 3, 3, 64, 16)
    q = q.to(torch.bfloat16).float()  # a bf16 model's rows: the window's bf16 block path
    layout = KiviKVLayout(2, 3, 64, 16, bits, 32, 0, torch.float32)
    packed = layout.pack(torch.stack([kv, kv.flip(0)], dim=1))
    views = layout.layer_views(packed, 1)
    wkv = kv.flip(0).to(torch.bfloat16)  # the window: bf16 blocks of its own
    wlens = torch.tensor([3, 0, 16, 5, 20, 9, 1, 32], dtype=torch.int32)

    def attend(rows):
        if not window:
            return paged_attention_kivi(q[rows], views, table[rows], seq_lens[rows])
        return paged_attention_kivi_window(
            q[rows], views, table[rows], seq_lens[rows], wkv[:, 0], wkv[:, 1],
            table.flip(0)[rows], wlens[rows],
        )  # fmt: skip

    together = attend(slice(None))
    for b in range(len(lens)):
        alone = attend(slice(b, b + 1))  # one sequence: an item per head
        assert torch.equal(together[0][b], alone[0][0]), f"sequence {b}: output"
        assert torch.equal(together[1][b], alone[1][0]), f"sequence {b}: lse"
    if not window:  # and it is attention over the dequantized blocks
        deq = layout.unpack(packed)[:, 1]
        want, _ = dense(q, deq[:, 0], deq[:, 1], table, seq_lens, 64**-0.5)
        assert (together[0].double() - want).abs().max() < 2e-5


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize(
    "lens,head_dim,block_size,group_size",
    [
        ([0, 1, 16, 45], 64, 16, 32),  # one key group a block: the AVX-512 block path
        ([20, 3], 64, 16, 16),  # four value groups a row
        ([9, 16, 40], 64, 16, 64),  # one value group a row
        ([7, 33], 40, 8, 4),
        ([5, 70, 2], 128, 16, 8),
        ([12], 24, 12, 5),
    ],
)
def test_kivi_pool_equals_attention_over_its_dequantized_values(
    bits, lens, head_dim, block_size, group_size
):
    q, kv, table, seq_lens = case(2, lens, 3, 2, head_dim, block_size)
    layout = KiviKVLayout(2, 3, head_dim, block_size, bits, group_size, 0, torch.float32)
    full = torch.stack([kv, kv.flip(0)], dim=1)  # [n, layers, 2, bs, H, D]
    packed = layout.pack(full)
    views = layout.layer_views(packed, 0)
    out, lse = paged_attention_kivi(q, views, table, seq_lens)
    deq = layout.unpack(packed)[:, 0]  # what attention over the packed blocks must see
    want, want_lse = dense(q, deq[:, 0], deq[:, 1], table, seq_lens, head_dim**-0.5)
    assert (out.double() - want).abs().max() < 2e-5
    finite = want_lse.isfinite()
    assert (lse.double()[finite] - want_lse[finite]).abs().max() < 2e-5
    twin, _ = _kivi_parts(q, views, table, seq_lens, None, None)
    assert (out - twin).abs().max() < 2e-5


def test_a_table_naming_a_block_outside_the_pool_is_an_error_not_a_read():
    q, kv, table, seq_lens = case(3, [20, 40])
    table = table.clone()
    table[1, 2] = kv.shape[0] + 10**6
    with pytest.raises(IndexError, match="sequence 1"):
        paged_attention_full(q, kv[:, 0], kv[:, 1], table, seq_lens)
    table[1, 2] = -3
    with pytest.raises(IndexError, match="sequence 1"):
        paged_attention_full(q, kv[:, 0], kv[:, 1], table, seq_lens)
    with pytest.raises(ValueError, match="table columns"):
        paged_attention_full(q, kv[:, 0], kv[:, 1], table[:, :1], seq_lens)
    # the same in bf16, where a work item takes a sequence's heads together (two sequences, one
    # thread: tests run with one)
    pool = kv.to(torch.bfloat16)
    qb = q.to(torch.bfloat16).float()
    with pytest.raises(IndexError, match="sequence 1"):
        paged_attention_full(qb, pool[:, 0], pool[:, 1], table, seq_lens)
    # entries past a sequence's end are never read, whatever they hold
    table = torch.full_like(table, -1)
    table[:, 0] = torch.tensor([0, 1])
    short = torch.tensor([3, 16], dtype=torch.int32)
    out, _ = paged_attention_full(q, kv[:, 0], kv[:, 1], table, short)
    assert out.isfinite().all()


def test_the_fused_window_kernel_checks_both_tables():
    from kernels.native import paged_attention_kivi_window

    q, kv, table, seq_lens = case(5, [20, 40])
    layout = KiviKVLayout(1, 3, 64, 16, 4, 32, 0, torch.float32)
    views = layout.layer_views(layout.pack(kv[:, None]), 0)
    win = torch.randn(4, 16, 3, 64)
    wtable = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    wlens = torch.tensor([5, 17], dtype=torch.int32)
    out, lse = paged_attention_kivi_window(q, views, table, seq_lens, win, win, wtable, wlens)
    assert out.isfinite().all() and lse.isfinite().all()
    bad = wtable.clone()
    bad[1, 1] = 4  # outside the 4-block window pool
    with pytest.raises(IndexError, match="sequence 1"):
        paged_attention_kivi_window(q, views, table, seq_lens, win, win, bad, wlens)


def test_an_empty_batch_and_turning_the_kernels_off():
    q, kv, table, seq_lens = case(4, [5])
    out, lse = paged_attention_full(q[:0], kv[:, 0], kv[:, 1], table[:0], seq_lens[:0])
    assert out.shape == (0, q.shape[1], q.shape[2]) and lse.shape == (0, q.shape[1])
    code = "import kernels; s = kernels.native_status(); print(s.available, s.detail)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"HALFMOON_NATIVE": "0", "PATH": "/usr/bin:/bin"},
        check=True,
    )
    assert done.stdout.startswith("False turned off by HALFMOON_NATIVE=0")
    assert "using the torch path" in done.stderr


def test_released_threads_come_back_for_the_next_parallel_call():
    """A server frees its loading thread's OpenMP workers before its step thread takes over
    (kernels.release_threads); a parallel kernel on that thread later still runs, on every
    thread, to the same result."""
    import threading

    g = torch.Generator().manual_seed(3)
    w = kernels.prepack(torch.randn(64, 48, generator=g), "panels")
    x = torch.randn(300, 48, generator=g)  # enough rows for the element-wise steps' regions
    before = kernels.linear(x, w)
    assert kernels.release_threads()
    assert torch.equal(kernels.linear(x, w), before)
    got = {}

    def step():
        got["out"] = kernels.linear(x, w)
        got["released"] = kernels.release_threads()

    t = threading.Thread(target=step)
    t.start()
    t.join()
    assert torch.equal(got["out"], before) and got["released"]


def test_copy_hashed_copies_blocks_and_hashes_their_layers_as_the_block_format_does():
    """The store's batched copy (csrc/copy_hashed.c): each block copied, each layer's XXH3-64
    equal to kvstore's checksum of it, a short last layer included; offsets out of range are an
    error before anything is written."""
    from kvstore.block_header import checksum

    assert kernels.copy_hashed_available()  # xxhash's extension carries XXH3: it must be found
    g = np.random.default_rng(0)
    src = g.integers(0, 255, 10_000, dtype=np.uint8)
    dst = np.zeros(12_000, dtype=np.uint8)
    nbytes, layer = 3_000, 1_024  # three layers, the last 952 bytes
    sums = kernels.copy_hashed(dst, [0, 5_000, 9_000], src, [7_000, 0, 3_333], nbytes, layer)
    for (d, s), row in zip([(0, 7_000), (5_000, 0), (9_000, 3_333)], sums.tolist()):
        assert np.array_equal(dst[d : d + nbytes], src[s : s + nbytes])
        assert row == [checksum(dst[d + o : d + min(o + layer, nbytes)]) for o in (0, 1024, 2048)]
    before = dst.copy()
    with pytest.raises(ValueError, match="outside"):
        kernels.copy_hashed(dst, [0, 11_000], src, [0, 0], nbytes, layer)
    assert np.array_equal(dst, before)


@pytest.mark.parametrize(
    "layer", [200, 240, 241, 255, 256, 1023, 1024, 1025, 1087, 1088, 2048, 2049, 12_288, 12_289]
)
def test_the_copys_own_xxh3_gives_xxhashs_sums_at_every_boundary(layer):
    """Layers over 240 bytes are hashed as they are copied (csrc/hm_xxh3.h: XXH3's long-input
    branch, blocks of 1,024 bytes in stripes of 64, then the last 64 bytes again); shorter ones
    with xxhash's function. Around each of those boundaries, with source and copy at odd
    addresses, a last layer long and short: the copy is exact, nothing past it is written, and
    every sum is the package's."""
    from kvstore.block_header import checksum

    g = np.random.default_rng(layer)
    for nbytes in (3 * layer, 2 * layer + 241, 2 * layer + 17):
        src = g.integers(0, 256, nbytes + 64, dtype=np.uint8)
        dst = np.zeros(nbytes + 128, dtype=np.uint8)
        sums = kernels.copy_hashed(dst, [3], src, [5], nbytes, layer)
        assert np.array_equal(dst[3 : 3 + nbytes], src[5 : 5 + nbytes])
        assert not dst[:3].any() and not dst[3 + nbytes :].any()
        want = [checksum(src[5 + o : 5 + min(o + layer, nbytes)]) for o in range(0, nbytes, layer)]
        assert sums[0].tolist() == want


def test_a_large_batch_is_copied_and_hashed_alike_on_one_thread_and_on_several():
    """From 256 KiB a batch's blocks are shared among threads (a prefill's layer-wise publish):
    every block lands where its offset says, with its own layers' sums, as on one thread."""
    from kvstore.block_header import checksum

    g = np.random.default_rng(1)
    count, nbytes, layer = 40, 12_288, 4_096  # 480 KiB: past the threshold
    src = g.integers(0, 255, count * nbytes * 2, dtype=np.uint8)
    src_off = [int(o) * nbytes for o in g.permutation(2 * count)[:count]]
    dst_off = [i * (nbytes + 64) for i in range(count)][::-1]
    out = {}
    for threads in (1, 2):
        dst = np.zeros(count * (nbytes + 64), dtype=np.uint8)
        sums = kernels.copy_hashed(dst, dst_off, src, src_off, nbytes, layer, threads=threads)
        for d, s_, row in zip(dst_off, src_off, sums.tolist()):
            assert np.array_equal(dst[d : d + nbytes], src[s_ : s_ + nbytes])
            assert row == [checksum(dst[d + o : d + o + layer]) for o in range(0, nbytes, layer)]
        out[threads] = (dst, sums)
    assert np.array_equal(out[1][0], out[2][0]) and np.array_equal(out[1][1], out[2][1])


def test_copy_checked_copies_a_run_of_encoded_blocks_and_stops_at_the_first_bad_one():
    """The shared-memory get's run copy (csrc/copy_hashed.c hm_copy_checked): blocks encoded by
    the block format are copied while each header matches the run's layout, its own checksum
    and each layer's; it stops at a block of another layout (1: the caller reads that header)
    and at a flipped payload byte or header checksum (2 and 1), never copying past it."""
    from kvstore.block_header import table_offsets
    from kvstore.client.block_format import encode_block, parse_header

    g = torch.Generator().manual_seed(0)
    shape = (3, 2, 4, 2, 8)  # 3 layers of [2, T, H, D]
    blocks = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(4)]
    other = encode_block(blocks[3], "fq")  # same lengths and offsets, another fixed part
    encoded = [encode_block(b, "fp") for b in blocks[:3]] + [other]
    size = len(encoded[0])
    assert len(other) == size
    h = parse_header(encoded[0])
    nbytes = h.payload_len
    table, header_sum = table_offsets(encoded[0], h)

    def run(src_blocks):
        src = np.frombuffer(b"".join(src_blocks), dtype=np.uint8).copy()
        dst = np.zeros(nbytes * len(src_blocks), dtype=np.uint8)
        res = kernels.copy_checked(
            dst, [i * nbytes for i in range(len(src_blocks))], src,
            [i * size for i in range(len(src_blocks))], encoded[0][:table], table, header_sum,
            h.header_len, nbytes, h.layer_bytes,
        )  # fmt: skip
        return res, dst

    res, dst = run(encoded)
    assert (res.passed, res.why) == (3, 1)  # the fourth is another model's: its header differs
    want = torch.stack(blocks[:3]).view(-1).view(torch.uint8).numpy()
    assert np.array_equal(dst[: 3 * nbytes], want)
    assert not dst[3 * nbytes :].any()

    flipped = bytearray(encoded[1])
    flipped[h.layer_offset(2) + 5] ^= 0x10  # a byte of block 1's last layer
    res, dst = run([encoded[0], bytes(flipped), encoded[2]])
    assert (res.passed, res.why) == (1, 2)
    assert not dst[2 * nbytes :].any()

    bad_header = bytearray(encoded[1])
    bad_header[table + 3] ^= 0x01  # a layer's checksum in the table: the header's own fails
    res, _ = run([encoded[0], bytes(bad_header)])
    assert (res.passed, res.why) == (1, 1)
    assert run(encoded[:3])[0] == (3, 0)

    with pytest.raises(ValueError, match="outside"):
        kernels.copy_checked(
            np.zeros(nbytes, np.uint8), [0], np.zeros(size - 1, np.uint8), [0],
            encoded[0][:table], table, header_sum, h.header_len, nbytes, h.layer_bytes,
        )  # fmt: skip


def test_seal_headers_writes_the_block_formats_headers_byte_for_byte():
    """A put's headers sealed in one C call (hm_seal_headers) are pack_header's bytes: fixed
    fields, each block's checksum table, the header's own checksum, zero padding (the buffer
    starts dirty, so the padding must be written too); a header past the array is an error
    before anything is written."""
    from kvstore.block_header import fixed_fields, pack_header
    from kvstore.client.block_format import make_header

    h = make_header("raw", torch.bfloat16, (3, 2, 4, 2, 8), "fp")
    g = np.random.default_rng(1)
    sums = g.integers(0, 2**64 - 1, (2, 3), dtype=np.uint64, endpoint=True)
    dst = np.full(3 * h.header_len, 0xAB, dtype=np.uint8)
    kernels.seal_headers(dst, [0, 2 * h.header_len], fixed_fields(h), sums, h.header_len)
    for row, at in zip(sums.tolist(), (0, 2 * h.header_len)):
        want = pack_header(h._replace(checksums=tuple(row)))
        assert dst[at : at + h.header_len].tobytes() == want
    assert (dst[h.header_len : 2 * h.header_len] == 0xAB).all()
    before = dst.copy()
    with pytest.raises(ValueError, match="outside"):
        kernels.seal_headers(dst, [0, 2 * h.header_len + 1], fixed_fields(h), sums, h.header_len)
    assert np.array_equal(dst, before)


@pytest.mark.parametrize("threads", [1, 2])
def test_argmax_rows_picks_what_torch_argmax_picks(threads, torch_threads):
    torch_threads(threads)
    g = torch.Generator().manual_seed(7)
    # widths around the 16-lane vector loop: a tail only, a tail after whole vectors, a vocab
    for rows, width in ((3, 5), (5, 16), (6, 47), (16, 49152)):
        x = torch.randn(rows, width, generator=g)
        assert torch.equal(kernels.argmax_rows(x), x.argmax(-1)), (rows, width)
    x = torch.zeros(7, 100)
    x[0, 40] = x[0, 90] = 1.0  # a tie across vector lanes: the first index
    x[1, 3] = x[1, 19] = 2.0  # a tie in one lane
    x[2, 97] = 5.0  # the largest in the scalar tail
    x[3, 50] = x[3, 60] = float("nan")  # the first NaN, as torch's argmax
    x[4, 98] = float("nan")  # a NaN in the tail beats a larger value before it
    x[4, 10] = 9.0
    x[5] = float("-inf")  # nothing larger than the first
    x[6, 0] = -0.0
    got = kernels.argmax_rows(x)
    assert got.tolist() == x.argmax(-1).tolist() == [40, 3, 97, 50, 98, 0, 0]
    # a strided view (every other column) is read as its values
    wide = torch.randn(4, 200, generator=g)[:, ::2]
    assert torch.equal(kernels.argmax_rows(wide), wide.argmax(-1))
    assert kernels.argmax_rows(x.double()) is None  # only fp32: the caller takes torch's
    # only rows in host memory (a device's pointer is no address here)
    assert kernels.argmax_rows(torch.empty(2, 8, device="meta")) is None
