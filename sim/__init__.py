"""A discrete-event simulator of a halfmoon cluster: trace arrivals, the live conductor's policy
objects routing them, chunked prefill with queueing, continuous-batching decode with admission
bounded by KV blocks, KV transfer, per-node DRAM/SSD tiers with the store's eviction rule and a
global index; the same report as `halfmoon replay`. Colocated instances schedule as named by
`ClusterSpec.colocated_kind`: "stall" (whole prompts between decode steps) or "vllm" (vLLM's
chunked prefill under a token budget with prefix caching, sim.vllm_baseline). With
`ClusterSpec.planner` the live runtime planner moves instances between prefill and decode as
the load shifts (sim.role_switch)."""

from sim.arrivals import SimRequest, TraceScaling, make_arrivals
from sim.config import SimConfig, load_sim_config, sim_config_from_dict
from sim.driver import COLOCATED_KINDS, ClusterSpec, SimResult, simulate
from sim.fit import Fit, fit_profile
from sim.profile import (
    Profile,
    load_profile,
    profile_from_dict,
    profile_to_dict,
    profile_yaml_text,
)
from sim.role_switch import RoleSwitcher, SwitchRecord
from sim.sweep import SweepPoint, effective_capacity, format_sweep, plot_sweep, sweep, trace_rate
from sim.vllm_baseline import VllmConfig, VllmInstance

__all__ = [
    "COLOCATED_KINDS",
    "ClusterSpec",
    "Fit",
    "Profile",
    "RoleSwitcher",
    "SimConfig",
    "SimRequest",
    "SimResult",
    "SweepPoint",
    "SwitchRecord",
    "TraceScaling",
    "VllmConfig",
    "VllmInstance",
    "effective_capacity",
    "fit_profile",
    "format_sweep",
    "load_profile",
    "load_sim_config",
    "make_arrivals",
    "plot_sweep",
    "profile_from_dict",
    "profile_to_dict",
    "profile_yaml_text",
    "simulate",
    "sim_config_from_dict",
    "sweep",
    "trace_rate",
]
