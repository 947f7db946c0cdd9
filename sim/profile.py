"""A GPU (or CPU) profile: the fitted time models and the sizes of one instance and its node."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from servekit import read_yaml

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


@dataclass(frozen=True)
class Profile:
    """What the simulator knows of the hardware. Times in ms, sizes in blocks of `block_size`
    tokens, bandwidths in GB/s (= MB/ms)."""

    name: str
    block_size: int  # tokens per KV block: the unit of caching, transfer and admission
    # prefill ms = c0 + c1*tokens + c2*tokens*context (one forward; context = its last position)
    prefill_coef: tuple[float, float, float]
    # decode step ms = c0 + c1*batch + c2*context_tokens (all the batch's KV tokens)
    decode_coef: tuple[float, float, float]
    block_bytes: int  # one block's KV, all layers
    kv_blocks: int  # KV pool of one decode (or colocated) instance
    max_batch: int  # sequences one decode step carries at most
    chunk_size: int = 0  # prefill forward tokens per request (0 = the whole prompt at once)
    # A prefill round takes waiting requests up to this many prompt tokens and computes them in
    # batched forwards (the live worker's max_batch_tokens); 0 = one request a round.
    max_batch_tokens: int = 0
    # An idle instance's round waits for arrivals that come this close together (10x that at
    # most) before it starts, unless max_batch_tokens are waiting (the live batch_gather_ms).
    batch_gather_ms: float = 0.0
    # ...while the waiting requests hold fewer prompt tokens than this (the live
    # batch_gather_tokens; 0 = however many)
    batch_gather_tokens: int = 0
    device_cache_blocks: int = 0  # a prefill instance's own pool kept as a prefix cache (0 = none)
    dram_blocks: int = 0  # per node: the store's DRAM tier
    ssd_blocks: int = 0  # per node: the store's SSD tier
    # Per request, on the prefill instance's thread after its last forward: writing its blocks
    # out and answering (requests finishing in one forward are answered in turn).
    request_overhead_ms: float = 0.0
    # Per request, after that, on the answer's way to the conductor (the reply, its relay):
    # delays the request's first token but holds nothing of the prefill instance's.
    answer_latency_ms: float = 0.0
    # Per request, on the decode instance before it can join the batch, beyond the KV move that
    # network_gbps accounts for: the decode call and pulling its blocks in (fitted from a real
    # run's first-token holds; 0 in a roofline profile, where the move is the bandwidth's).
    decode_join_ms: float = 0.0
    # The prefill and decode instance of one host share its CPUs (the live local cluster's
    # workers take turns at them, servekit.CpuTurns): while the host's prefill computes, a
    # decode step waits out the slack its streams leave under their TBT objective (the
    # decode's tbt_pace_fraction of it, less the step), the prefill keeping the CPUs that long,
    # and a prefill round is lengthened by the steps run inside it. False: CPUs of their own.
    shared_host: bool = False
    network_gbps: float = 25.0  # between nodes: remote prefix fetches, prefill -> decode KV
    dram_gbps: float = 25.0  # host DRAM -> device (a DRAM hit is loaded at this rate)
    ssd_gbps: float = 3.0  # SSD -> host (an SSD hit is read at this rate, then loaded)
    sources: tuple[str, ...] = ()  # where each figure comes from

    def __post_init__(self) -> None:
        for name in ("block_size", "block_bytes", "kv_blocks", "max_batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"profile {self.name}: {name} must be > 0")
        for name in ("prefill_coef", "decode_coef"):
            coef = getattr(self, name)
            if len(coef) != 3 or any(c < 0 for c in coef):
                raise ValueError(f"profile {self.name}: {name} must be 3 numbers >= 0, got {coef}")
        for name in ("network_gbps", "dram_gbps", "ssd_gbps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"profile {self.name}: {name} must be > 0")


def load_profile(name_or_path: str | Path) -> Profile:
    """A profile by file path, or by name from sim/profiles/<name>.yaml."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PROFILE_DIR.glob("*.yaml")))
        raise ValueError(f"profile {name_or_path!r}: no such file (shipped profiles: {known})")
    raw = read_yaml(path)[0] or {}
    return profile_from_dict(raw, str(path))


def profile_from_dict(raw: dict, where: str = "profile") -> Profile:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a mapping")
    fields = {f.name for f in dataclasses.fields(Profile)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} (known: {sorted(fields)})")
    raw = dict(raw)
    raw.setdefault("name", Path(where).stem)
    for key in ("prefill_coef", "decode_coef", "sources"):
        if key in raw:
            raw[key] = tuple(raw[key])
    try:
        return Profile(**raw)
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from None


def profile_to_dict(p: Profile) -> dict:
    d = dataclasses.asdict(p)
    for key in ("prefill_coef", "decode_coef", "sources"):
        d[key] = list(d[key])
    return d


def profile_yaml_text(p: Profile) -> str:
    """The profile as the YAML `load_profile` reads."""
    return yaml.safe_dump(profile_to_dict(p), sort_keys=False, width=100)
