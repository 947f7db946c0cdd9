"""The vLLM connector's parts that need no vLLM, against a real store node: the conversion of
vLLM's per-layer KV caches to the store's block layout, the scheduler side's matching and step
plans, and the worker side's saves and loads, a corrupt block included. The connector inside a
real vLLM engine: `make test-vllm` (tests/vllm/)."""

from __future__ import annotations

import time

import pytest
import torch

from kvstore.client import parse_header
from kvstore.node import StoreConfig, StoreNode
from vllm_connector import (
    LayerIO,
    Planner,
    Stores,
    detect_layout,
    fingerprint,
    gather_blocks,
    layout_id,
    scatter_blocks,
)

H, C, BS, NUM_BLOCKS, LAYERS = 2, 8, 32, 12, 3
FP = fingerprint("weights-a", layout_id("bfloat16", LAYERS, H, BS, C))


def cpu_cache(num_blocks: int = NUM_BLOCKS, kernel: int = BS, seed: int = 0) -> torch.Tensor:
    """One layer's cache as vLLM's CPU backend allocates it: [blocks, heads, block, 2 * head]."""
    g = torch.Generator().manual_seed(seed)
    n = num_blocks * (BS // kernel)
    return torch.randn(n, H, kernel, 2 * C, generator=g).to(torch.bfloat16)


def test_the_cpu_layout_reads_k_then_v_as_the_cpu_backend_splits_each_tile():
    kv = cpu_cache()
    lay = detect_layout(kv, H, C, BS, NUM_BLOCKS)
    assert (lay.kind, lay.ratio) == ("cpu", 1)
    got = gather_blocks(kv, [5, 2], lay)  # [n, 2, H, BS, C]
    # the backend: kv.view(blocks, heads, 2 * block, head).chunk(2, dim=2) -> key, value
    key, value = kv.view(NUM_BLOCKS, H, 2 * BS, C).chunk(2, dim=2)
    assert torch.equal(got[0, 0], key[5]) and torch.equal(got[0, 1], value[5])
    assert torch.equal(got[1, 0], key[2]) and torch.equal(got[1, 1], value[2])


@pytest.mark.parametrize("kernel", [BS, BS // 2])
def test_blocks_scattered_into_another_pool_read_back_token_for_token(kernel):
    src, dst = cpu_cache(kernel=kernel), torch.zeros_like(cpu_cache(kernel=kernel))
    lay = detect_layout(src, H, C, BS, NUM_BLOCKS)
    assert lay.ratio == BS // kernel
    blocks = gather_blocks(src, [7, 1, 4], lay)
    scatter_blocks(dst, [0, 9, 3], blocks, lay)
    assert torch.equal(gather_blocks(dst, [0, 9, 3], lay), blocks)
    untouched = [b for b in range(NUM_BLOCKS) if b not in (0, 9, 3)]
    assert not gather_blocks(dst, untouched, lay).any()
    # a block spanning two kernel blocks holds its tokens in order across them
    if lay.ratio == 2:
        key = src.view(-1, H, 2 * kernel, C)[:, :, :kernel]
        assert torch.equal(blocks[0, 0, :, kernel:], key[7 * 2 + 1])


def test_the_kv_first_layout_and_unknown_shapes():
    kv = torch.randn(2, NUM_BLOCKS, BS, H, C)
    lay = detect_layout(kv, H, C, BS, NUM_BLOCKS)
    assert lay.kind == "kv_first"
    got = gather_blocks(kv, [3], lay)
    assert torch.equal(got[0, 1, 1], kv[1, 3, :, 1])  # V, head 1: [tokens, head]
    with pytest.raises(ValueError, match="unknown vLLM KV cache layout"):
        detect_layout(torch.zeros(NUM_BLOCKS, H + 1, BS, 2 * C), H, C, BS, NUM_BLOCKS)
    with pytest.raises(ValueError, match="do not tile"):
        detect_layout(cpu_cache(), H, C, BS, NUM_BLOCKS + 1)


@pytest.fixture
def store():
    node = StoreNode(StoreConfig(node_id="v0", dram_bytes=16 << 20))
    address = node.start()
    yield node, address
    node.stop()


def make_io(address: str, fp: str = FP) -> tuple[LayerIO, dict[str, torch.Tensor]]:
    io = LayerIO(fp, BS, H, C, NUM_BLOCKS, transport="auto")
    caches = {f"model.layers.{i}.self_attn.attn": cpu_cache(seed=10 + i) for i in range(LAYERS)}
    io.register(caches)
    return io, caches


def forward(io: LayerIO, plan, caches) -> None:
    """What vLLM does around a forward: bind (saves readied), loads, then per layer the load
    hook, the attention (not run here) and the save hook, then the step's end."""
    io.begin_saves(plan)
    io.start(plan)
    for name, kv in caches.items():
        io.layer_loaded(name)
        io.save_layer(name, kv)
    io.submit()
    io.flush()


PROMPT = list(range(100, 100 + 3 * BS + 5))  # three full blocks and a tail


def test_a_second_instance_loads_the_prefix_the_first_saved_in_chunks(store):
    node, address = store
    a_plan, b_plan = Planner(Stores([address]), BS, FP), Planner(Stores([address]), BS, FP)
    a_io, a_caches = make_io(address)
    # instance A: nothing stored; its prefill runs in two chunks (40 then the rest)
    assert a_plan.match("r1", PROMPT, 0) == 0
    a_plan.allocated("r1", [], 0)
    step1 = a_plan.step([("r1", [4, 8, 2, 6], 0)], [], {"r1": 40})
    assert not step1.loads and [s.block_ids for s in step1.saves] == [[4]]
    forward(a_io, step1, a_caches)
    step2 = a_plan.step([], [("r1", [], 40)], {"r1": len(PROMPT) - 40})
    assert [s.block_ids for s in step2.saves] == [[8, 2]]
    assert step2.saves[0].parent == step1.saves[0].keys[0]
    forward(a_io, step2, a_caches)
    assert a_io.counters.take()["saved_blocks"] == 3
    # later decode steps complete no prompt block: nothing more to save
    assert not a_plan.step([], [("r1", [], len(PROMPT))], {"r1": 1}).saves

    # instance B, its own pool: the three blocks are matched, less what its own cache had
    assert b_plan.match("q", PROMPT, 0) == 3 * BS
    assert b_plan.match("q", PROMPT, BS) == 2 * BS  # side-effect free, asked again
    assert b_plan.tiers("q", 2 * BS) == {"dram": 2 * BS}
    b_plan.allocated("q", [0, 5, 9, 11], 2 * BS)
    step = b_plan.step([("q", [0, 5, 9, 11], 3 * BS)], [], {"q": 5})
    (load,) = step.loads
    assert load.block_ids == [5, 9] and not step.saves  # the store holds all it would save
    b_io, b_caches = make_io(address)
    forward(b_io, step, b_caches)
    assert not b_io.take_errors() and b_io.counters.take()["loaded_blocks"] == 2
    lay = a_io.layout
    for name in a_caches:
        assert torch.equal(
            gather_blocks(b_caches[name], [5, 9], lay), gather_blocks(a_caches[name], [8, 2], lay)
        )
    a_io.close(), b_io.close()


def test_the_last_token_is_never_matched_and_another_layout_never_matches(store):
    node, address = store
    io, caches = make_io(address)
    exact = list(range(7, 7 + 2 * BS))  # two full blocks, no tail
    p = Planner(Stores([address]), BS, FP)
    p.match("r", exact, 0)
    forward(io, p.step([("r", [1, 2], 0)], [], {"r": len(exact)}), caches)
    # only the first block was keyed: the second holds the prompt's last token
    assert io.counters.take()["saved_blocks"] == 1
    assert Planner(Stores([address]), BS, FP).match("s", exact + [1], 0) == BS
    other = fingerprint("weights-a", layout_id("float32", LAYERS, H, BS, C))
    assert Planner(Stores([address]), BS, other).match("t", exact + [1], 0) == 0
    io.close()


def test_a_corrupt_block_is_a_load_error_from_it_on_and_counted(store):
    node, address = store
    a_plan = Planner(Stores([address]), BS, FP)
    a_io, a_caches = make_io(address)
    a_plan.match("r", PROMPT, 0)
    plan = a_plan.step([("r", [0, 1, 2, 3], 0)], [], {"r": len(PROMPT)})
    forward(a_io, plan, a_caches)
    keys = plan.saves[0].keys
    lease_id, refs = node.store.acquire(keys[1:2], ttl=5)
    node.store.release(lease_id)
    off, size = refs[0].offset, refs[0].length
    h = parse_header(node.slab.view[off : off + size])
    node.slab.view[off + h.layer_offset(2) + 5] ^= 0xFF  # a flipped byte in block 1, layer 2

    b_plan = Planner(Stores([address]), BS, FP)
    assert b_plan.match("q", PROMPT, 0) == 3 * BS  # the index does not know yet
    b_plan.allocated("q", [6, 7, 8, 9], 3 * BS)
    step = b_plan.step([("q", [6, 7, 8, 9], 3 * BS)], [], {"q": 5})
    b_io, b_caches = make_io(address)
    before = {n: kv.clone() for n, kv in b_caches.items()}
    forward(b_io, step, b_caches)
    assert b_io.take_errors() == {7, 8}  # from the corrupt block on: vLLM recomputes those
    counts = b_io.counters.take()
    assert (counts["loaded_blocks"], counts["failed_blocks"]) == (1, 2)
    lay = a_io.layout
    for name in b_caches:  # the good block landed; the failed ones were left alone
        assert torch.equal(
            gather_blocks(b_caches[name], [6], lay), gather_blocks(a_caches[name], [0], lay)
        )
        assert torch.equal(
            gather_blocks(b_caches[name], [7, 8], lay), gather_blocks(before[name], [7, 8], lay)
        )
    a_io.close(), b_io.close()


def test_an_unreachable_store_is_a_miss_and_a_full_queue_drops_saves(store):
    node, address = store
    stores = Stores(["127.0.0.1:1"])  # nothing listens there
    p = Planner(stores, BS, FP)
    assert p.match("r", PROMPT, 0) == 0 and stores.failed_lookups == 1
    assert p.match("r2", PROMPT, 0) == 0 and stores.failed_lookups == 1  # not asked again yet
    io = LayerIO(FP, BS, H, C, NUM_BLOCKS, queue_bytes=1)  # room for no save
    caches = {"l0": cpu_cache()}
    io.register(caches)
    q = Planner(Stores([address]), BS, FP)
    q.match("r", PROMPT, 0)
    forward(io, q.step([("r", [0, 1, 2, 3], 0)], [], {"r": len(PROMPT)}), caches)
    assert io.counters.take()["dropped_blocks"] == 3
    assert Planner(Stores([address]), BS, FP).match("s", PROMPT, 0) == 0
    io.close()
    with pytest.raises(ValueError, match="store addresses or an index"):
        Stores([])


def test_the_index_finds_the_node_holding_the_longest_prefix():
    from kvstore import EmbeddedRedis

    redis = EmbeddedRedis()
    nodes = [
        StoreNode(
            StoreConfig(node_id=f"v{i}", dram_bytes=16 << 20, redis_url=redis.url, heartbeat_s=0.2)
        )
        for i in range(2)
    ]
    addresses = [n.start() for n in nodes]
    try:
        # the second node holds the prompt's first two blocks, the first none
        io, caches = make_io(addresses[1])
        p = Planner(Stores([addresses[1]]), BS, FP)
        p.match("r", PROMPT[: 2 * BS + 1], 0)
        forward(io, p.step([("r", [0, 1], 0)], [], {"r": 2 * BS + 1}), caches)
        io.close()
        stores = Stores([], index_url=redis.url)
        q = Planner(stores, BS, FP)
        deadline = time.monotonic() + 10
        while q.match("s", PROMPT, 0) < 2 * BS and time.monotonic() < deadline:
            time.sleep(0.1)  # the node publishes what it holds to the index shortly after
        assert q.match("s", PROMPT, 0) == 2 * BS
        q.allocated("s", [3, 4, 5, 6], 2 * BS)
        (load,) = q.step([("s", [3, 4, 5, 6], 2 * BS)], [], {"s": 5}).loads
        assert load.address == addresses[1]
        stores.close()
    finally:
        for n in nodes:
            n.stop()
        redis.stop()
