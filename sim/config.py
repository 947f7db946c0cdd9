"""A simulation config (YAML): the profile, the clusters to compare, SLOs, trace fitting and the
rates a sweep plays the trace at."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from servekit import read_yaml
from sim.arrivals import TraceScaling
from sim.driver import ClusterSpec
from sim.sweep import DEFAULT_TARGET

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


@dataclass
class SimConfig:
    profile: str = "smollm2-cpu"  # a name in sim/profiles/ or a YAML path
    clusters: list[ClusterSpec] = field(default_factory=lambda: [ClusterSpec()])
    trace: str = ""  # "" = the shipped Mooncake synthetic trace
    scaling: TraceScaling = TraceScaling()
    sweep: tuple[float, ...] = ()  # rate scales for `--sweep` (empty: none unless given)
    target: float = DEFAULT_TARGET  # attainment an effective rate keeps


def load_sim_config(name_or_path: str | Path | None) -> SimConfig:
    """A config by path, or by name from sim/configs/<name>.yaml; None = the defaults."""
    if name_or_path is None:
        return SimConfig()
    path = Path(name_or_path)
    if not path.suffix:
        path = CONFIG_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
        raise ValueError(f"sim config {name_or_path!r}: no such file (shipped: {known})")
    raw = read_yaml(path)[0] or {}
    return sim_config_from_dict(raw, str(path))


def sim_config_from_dict(raw: dict, where: str = "config") -> SimConfig:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a mapping")
    known = {"profile", "clusters", "trace", "scaling", "sweep", "target", "ttft_slo_ms",
             "tbt_slo_ms", "tpot_slo_ms"}  # fmt: skip
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} (known: {sorted(known)})")
    slo = {k: float(raw[k]) for k in ("ttft_slo_ms", "tbt_slo_ms", "tpot_slo_ms") if k in raw}
    spec_fields = {f.name for f in dataclasses.fields(ClusterSpec)}
    clusters = []
    for i, c in enumerate(raw.get("clusters") or [{}]):
        if not isinstance(c, dict) or set(c) - spec_fields:
            raise ValueError(
                f"{where}: clusters[{i}] must be a mapping of {sorted(spec_fields)}, got {c!r}"
            )
        clusters.append(ClusterSpec(**{**slo, **c}))
    sc_fields = set(TraceScaling._fields)
    sc = raw.get("scaling") or {}
    if not isinstance(sc, dict) or set(sc) - sc_fields:
        raise ValueError(f"{where}: scaling must be a mapping of {sorted(sc_fields)}")
    return SimConfig(
        profile=str(raw.get("profile", SimConfig.profile)),
        clusters=clusters,
        trace=str(raw.get("trace", "") or ""),
        scaling=TraceScaling(**sc),
        sweep=tuple(float(x) for x in raw.get("sweep") or ()),
        target=float(raw.get("target", DEFAULT_TARGET)),
    )
