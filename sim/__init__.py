"""A discrete-event simulator of a halfmoon cluster: trace arrivals, the live conductor's policy
objects routing them, chunked prefill with queueing, continuous-batching decode with admission
bounded by KV blocks, KV transfer, per-node DRAM/SSD tiers with the store's eviction rule and a
global index; the same report as `halfmoon replay`."""

from sim.arrivals import SimRequest, TraceScaling, make_arrivals
from sim.config import SimConfig, load_sim_config, sim_config_from_dict
from sim.driver import ClusterSpec, SimResult, simulate
from sim.fit import Fit, fit_profile
from sim.profile import Profile, load_profile, profile_from_dict, profile_to_dict
from sim.sweep import SweepPoint, effective_capacity, format_sweep, plot_sweep, sweep, trace_rate

__all__ = [
    "ClusterSpec",
    "Fit",
    "Profile",
    "SimConfig",
    "SimRequest",
    "SimResult",
    "SweepPoint",
    "TraceScaling",
    "effective_capacity",
    "fit_profile",
    "format_sweep",
    "load_profile",
    "load_sim_config",
    "make_arrivals",
    "plot_sweep",
    "profile_from_dict",
    "profile_to_dict",
    "simulate",
    "sim_config_from_dict",
    "sweep",
    "trace_rate",
]
