"""The KV tiers' `auto` sizes: the rule on scripted machine figures (servekit.memory_sizing), the
machine's figures as read (servekit.machine), the bytes it sizes by (a pool block, the weights)
against the real layouts and models, and the cluster config's `auto` with its errors."""

import pytest

import deploy.sizing
from deploy import cluster_config_from_dict, load_cluster_config
from deploy.sizing import memory_said
from servekit import (
    MachineMemory,
    PoolSpec,
    SizingError,
    kv_block_bytes,
    kv_cache_layout,
    plan_memory,
    split_kv_bytes,
)
from servekit.machine import parse_meminfo
from servekit.memory_sizing import MAX_KV_FRACTION

MiB, GiB = 1 << 20, 1 << 30
# SmolLM2-135M in bf16: one pool block (30 layers x K|V x 16 tokens x 3 heads x 64 x 2 bytes)
# and one worker's weights (134,515,008 parameters x 2 bytes)
BLOCK, WEIGHTS = 368_640, 269_030_016


def _pools(prefill=None, decode=None, block=BLOCK, weights=WEIGHTS):
    return [
        PoolSpec("prefill", 1, block, weights, prefill),
        PoolSpec("decode", 1, block, weights, decode),
    ]


def _kv_bytes(plan, pools) -> int:
    return plan.dram_bytes + sum(p.workers * plan.num_blocks[p.role] * p.block_bytes for p in pools)


def test_the_rule_on_a_24_gib_machine():
    # 22 GiB usable; left after weights (2 x 269 MB) and runtimes (2 x 512 MiB + 1 GiB):
    # 20,936,776,448 bytes; the tiers get 0.3 of that: 2/3 to the slab (4,187 MB, down to
    # 3,968 MiB in 64 MiB steps), 1/6 to each pool (1,047 MB / 368,640 = 2,839, down to 2,832)
    plan = plan_memory(22 * GiB, None, _pools())
    assert plan.dram_bytes == 3968 * MiB
    assert plan.num_blocks == {"prefill": 2832, "decode": 2832}
    assert plan.dram_auto and plan.blocks_auto == {"prefill": True, "decode": True}
    # vLLM-CPU's KV space beside it in bench/e2e.py is 4 GiB
    assert 3.5 * GiB < plan.dram_bytes <= 4 * GiB


def test_floors_where_the_machine_has_room_and_below_them_where_not():
    # 6 GiB: the shares (0.7 GiB, 497 blocks) are raised to today's fixed sizes
    plan = plan_memory(6 * GiB, None, _pools())
    assert (plan.dram_bytes, plan.num_blocks["decode"]) == (1 * GiB, 1024)
    # 3 GiB: 0.5 GiB left, the floors (1.7 GiB) do not fit: all shrink alike to fit in it
    pools = _pools()
    plan = plan_memory(3 * GiB, None, pools)
    assert plan.dram_bytes == 256 * MiB and plan.num_blocks == {"prefill": 288, "decode": 288}
    assert _kv_bytes(plan, pools) <= 3 * GiB - 2 * WEIGHTS - 2 * GiB


def test_never_more_than_a_fraction_of_memory():
    for usable in (4 * GiB, 64 * GiB, 1 << 40):
        pools = _pools()
        assert _kv_bytes(plan_memory(usable, None, pools), pools) <= MAX_KV_FRACTION * usable
    # a huge explicit slab leaves the auto pools only what the fraction allows
    usable, dram = 1 << 40, int(0.45 * (1 << 40))
    plan = plan_memory(usable, dram, _pools())
    assert plan.dram_bytes == dram and not plan.dram_auto
    assert _kv_bytes(plan, _pools()) <= MAX_KV_FRACTION * usable


def test_explicit_sizes_are_kept_and_counted_as_used():
    all_auto = plan_memory(22 * GiB, None, _pools())
    plan = plan_memory(22 * GiB, 8 * GiB, _pools(prefill=512))
    assert plan.dram_bytes == 8 * GiB and plan.num_blocks["prefill"] == 512
    assert plan.blocks_auto == {"prefill": False, "decode": True}
    # the decode pool's share comes out of what the given sizes left
    assert 1024 <= plan.num_blocks["decode"] < all_auto.num_blocks["decode"]


def test_too_little_memory_is_an_error_naming_the_field():
    with pytest.raises(SizingError, match=r"store\.dram_bytes: auto finds too little memory"):
        plan_memory(2 * GiB, None, _pools())
    with pytest.raises(SizingError, match=r"decode\.num_blocks") as exc:
        plan_memory(2 * GiB, 64 * MiB, _pools(prefill=64))
    assert exc.value.field == ("decode", "num_blocks")


def test_split_of_a_peers_kv_space():
    # bench/e2e.py: vLLM's 4 GiB of KV space, split as the rule splits: 2/3 to the slab
    dram, blocks = split_kv_bytes(4 * GiB, _pools())
    assert dram == 2688 * MiB and blocks == {"prefill": 2000, "decode": 2000}


def test_usable_memory_is_the_smaller_of_available_and_the_cgroups_room():
    assert MachineMemory(24 * GiB, 20 * GiB).usable == 20 * GiB
    # a cgroup of 8 GiB holding 3 GiB has 5 GiB of room, though the host has 20 available
    assert MachineMemory(24 * GiB, 20 * GiB, 8 * GiB, 3 * GiB).usable == 5 * GiB
    assert MachineMemory(24 * GiB, 2 * GiB, 8 * GiB, 3 * GiB).usable == 2 * GiB
    assert MachineMemory(24 * GiB, 20 * GiB, 8 * GiB, 9 * GiB).usable == 0
    text = "MemTotal:       24683784 kB\nMemFree:  1000 kB\nMemAvailable:   18445028 kB\n"
    assert parse_meminfo(text) == (24683784 * 1024, 18445028 * 1024)
    assert parse_meminfo("MemTotal: 8 kB\nMemFree: 4 kB\n") == (8192, 4096)  # before 3.14


@pytest.mark.parametrize("model", ["tiny-random", "tiny-random-mla"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp16", "int8", "kivi4"])
def test_block_and_weight_bytes_match_the_real_layout_and_model(model, kv_cache_dtype):
    import torch

    from model import load_model
    from servekit.worker import WorkerConfig

    lm = load_model(model, dtype="float32")
    if kv_cache_dtype == "kivi4" and lm.config.is_mla:
        pytest.skip("KIVI does not apply to an MLA latent cache")
    cfg = WorkerConfig(model=model, kv_cache_dtype=kv_cache_dtype)
    for dtype in ("float32", "bfloat16"):
        layout = kv_cache_layout(lm.config, cfg, getattr(torch, dtype))
        assert kv_block_bytes(lm.config, cfg, dtype) == layout.block_bytes
    assert lm.config.num_parameters() == sum(p.numel() for p in lm.model.parameters())


def _scripted_machine(monkeypatch, usable: int) -> None:
    monkeypatch.setattr(deploy.sizing, "machine_memory", lambda: MachineMemory(usable, usable))


def _cluster(**store_and_workers):
    sections = {"store": {}, "prefill": {}, "decode": {}}
    for key, value in store_and_workers.items():
        section, field = key.split("__")
        sections[section][field] = value
    return cluster_config_from_dict({"model": "tiny-random", "dtype": "float32", **sections})


def test_auto_in_a_cluster_config(monkeypatch):
    _scripted_machine(monkeypatch, 22 * GiB)
    cfg = _cluster(store__dram_bytes="auto", prefill__num_blocks="auto", decode__num_blocks=300)
    # tiny-random's blocks are small (2 layers x 2 x 16 x 2 x 16 x 4 bytes = 8 KiB): the
    # pools' shares in blocks are large, the slab's in bytes as for any model
    block = 2 * 2 * 16 * 2 * 16 * 4
    plan = cfg.memory_plan
    assert plan.block_bytes == {"prefill": block, "decode": block}
    # 0.3 x 2/3 of 22 GiB less the weights (2 x 477,952 bytes), the runtimes (2 GiB) and the
    # given decode pool (300 x 8 KiB): 4,294 MB, down to 4,032 MiB; a pool's share is 1/6
    assert cfg.store.dram_bytes == plan.dram_bytes == 4032 * MiB
    assert cfg.prefill.num_blocks == plan.num_blocks["prefill"] == 131_040
    assert cfg.decode.num_blocks == 300  # a number stays a number
    said = memory_said(cfg)
    assert said.startswith(f"store DRAM {plan.dram_bytes / GiB:.1f} GiB, pools ")
    assert said.endswith("(auto: store DRAM, prefill pool; 22.0 GiB usable)")
    # no auto: the machine is not asked, and the sizes are the config's
    monkeypatch.setattr(deploy.sizing, "machine_memory", None)
    cfg = _cluster(store__dram_bytes=1 << 30, prefill__num_blocks=64, decode__num_blocks=64)
    assert cfg.memory_plan is None
    assert memory_said(cfg) == "store DRAM 1.0 GiB, pools 64 + 64 blocks"


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("store__dram_bytes", "lots", "store.dram_bytes: expected a number of bytes or 'auto'"),
        ("prefill__num_blocks", "many", "prefill.num_blocks: expected a number of blocks or"),
        ("decode__num_blocks", "AUTO", "decode.num_blocks: expected a number of blocks or 'auto'"),
        ("store__dram_bytes", [1], "store.dram_bytes: expected an integer, got [1]"),
    ],
)
def test_a_bad_size_is_a_value_error_naming_the_field(monkeypatch, key, value, message):
    _scripted_machine(monkeypatch, 22 * GiB)
    with pytest.raises(ValueError) as exc:
        _cluster(**{key: value})
    assert message in str(exc.value)


def test_too_small_a_machine_names_the_field(monkeypatch):
    _scripted_machine(monkeypatch, 1 * GiB)
    with pytest.raises(ValueError, match=r"store\.dram_bytes: auto finds too little memory"):
        _cluster(store__dram_bytes="auto")
    with pytest.raises(ValueError, match=r"decode\.num_blocks: auto finds too little memory"):
        _cluster(store__dram_bytes=1 << 20, prefill__num_blocks=64, decode__num_blocks="auto")


def test_the_shipped_config_sizes_from_the_machine_and_names_bad_values(monkeypatch, tmp_path):
    _scripted_machine(monkeypatch, 22 * GiB)
    cfg = load_cluster_config(None, ["model=tiny-random"])  # local.yaml says auto for all three
    assert cfg.memory_plan.dram_auto and all(cfg.memory_plan.blocks_auto.values())
    assert cfg.store.dram_bytes >= 1 * GiB and cfg.decode.num_blocks >= 1024
    with pytest.raises(ValueError, match=r"^--set: store\.dram_bytes: expected a number of bytes"):
        load_cluster_config(None, ["model=tiny-random", "store.dram_bytes=lots"])
    path = tmp_path / "c.yaml"
    path.write_text("model: tiny-random\nstore:\n  dram_bytes: lots\n")
    with pytest.raises(ValueError, match=rf"^{path}:3: store\.dram_bytes: expected a number"):
        load_cluster_config(path)
    path.write_text("model: nosuch-model\nstore:\n  dram_bytes: auto\n")
    with pytest.raises(ValueError, match=rf"^{path}:1: model: auto sizes need the model's shape"):
        load_cluster_config(path)
