"""`auto` for the KV tiers' sizes in a cluster config (`store.dram_bytes`, the workers'
`num_blocks`): resolved once, where the config is loaded, from that machine's memory by
servekit.memory_sizing's rule, as `dtype: auto` is from its CPU. The rule counts every server of
the config on that one machine; a cluster of unlike machines sets numbers."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from servekit import (
    DTYPE_BYTES,
    ConfigError,
    MemoryPlan,
    PoolSpec,
    SizingError,
    kv_block_bytes,
    machine_memory,
    plan_memory,
    sizes_said,
)

AUTO = "auto"
# section -> its field that takes `auto`
AUTO_FIELDS = {"store": "dram_bytes", "prefill": "num_blocks", "decode": "num_blocks"}
_UNITS = {"dram_bytes": "a number of bytes", "num_blocks": "a number of blocks"}


def take_auto(role: str, section: dict[str, Any]) -> bool:
    """Whether the section's auto-sized field says `auto`; if so the field is taken out of it
    (the dataclass's default stands in until resolve_memory sizes it). Any other string there
    is a ConfigError naming the field."""
    key = AUTO_FIELDS.get(role)
    if key is None or not isinstance(section.get(key), str):
        return False  # a number (or any other type: the dataclass's loader names it)
    if section[key] != AUTO:
        raise ConfigError(
            f"{role}.{key}: expected {_UNITS[key]} or 'auto', got {section[key]!r}", (role, key)
        )
    del section[key]
    return True


def resolve_memory(cfg: Any, auto: dict[str, bool]) -> MemoryPlan | None:
    """Size the fields `auto` names (section -> it said auto) from this machine's memory, set
    them in cfg's sections (validated again by their dataclasses) and return the plan; None
    when none said auto."""
    if not any(auto.values()):
        return None
    pools = []
    for role, count in (("prefill", cfg.prefill_workers), ("decode", cfg.decode_workers)):
        w = getattr(cfg, role)
        # the key the model came from: the section's own, or the cluster's that it copied
        mc = _model_config((role, "model") if w.model != cfg.model else ("model",), w.model)
        try:
            block_bytes = kv_block_bytes(mc, w, w.dtype)
        except (ValueError, KeyError) as exc:
            raise ConfigError(f"{role}: {exc}", (role, "kv_cache_dtype")) from None
        weights = mc.num_parameters() * DTYPE_BYTES[w.dtype]
        given = None if auto[role] else w.num_blocks
        pools.append(PoolSpec(role, count, block_bytes, weights, given))
    try:
        plan = plan_memory(
            machine_memory().usable, None if auto["store"] else cfg.store.dram_bytes, pools
        )
    except SizingError as exc:
        raise ConfigError(str(exc), exc.field) from None
    if auto["store"]:
        cfg.store = dataclasses.replace(cfg.store, dram_bytes=plan.dram_bytes)
    for role in ("prefill", "decode"):
        if auto[role]:
            sized = dataclasses.replace(getattr(cfg, role), num_blocks=plan.num_blocks[role])
            setattr(cfg, role, sized)
    return plan


@functools.lru_cache(maxsize=8)
def _read_model_config(model: str):
    from model import read_model_config  # here: a config with no `auto` reads no checkpoint

    return read_model_config(model)


def _model_config(key: tuple[str, ...], model: str):
    """The config of `model` (a ConfigError naming `key`, where it was set, when it cannot be
    read)."""
    try:
        return _read_model_config(model)
    except (ValueError, OSError) as exc:
        where = ".".join(key)
        raise ConfigError(f"{where}: auto sizes need the model's shape: {exc}", key) from None


def memory_said(cfg: Any) -> str:
    """The KV tiers' sizes as the cluster's start says them: "store DRAM 3.9 GiB, pools 2,832 +
    2,832 blocks (1.0 + 1.0 GiB) (auto: store DRAM, prefill pool, decode pool; 22.0 GiB
    usable)"."""
    blocks = {role: getattr(cfg, role).num_blocks for role in ("prefill", "decode")}
    return sizes_said(cfg.memory_plan, cfg.store.dram_bytes, blocks)
