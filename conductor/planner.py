"""The runtime planner's rule: from the same ClusterState the routing policy judges, how far each
role is past its objective, and when moving one worker from one role to the other is worth a
switch. Pure (time and attainment are passed in, nothing is called), so that the simulator can run
the same rule on its instances as the conductor on its workers (conductor/role_switch.py drives it
on the fleet)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from conductor.policy_types import ClusterState, DecodeCandidate
from servekit import decode_features, predict


@dataclass
class PlannerConfig:
    """The planner's settings: how often it looks, when a role counts as the bottleneck, and
    how often it may move a worker."""

    interval_s: float = 2.0  # between two looks at the roles' pressures
    # a look only counts toward a switch when the requests judged since the previous look met
    # their objectives less often than this (none judged: the pressures alone decide)
    target_attainment: float = 0.95
    high: float = 1.0  # a role is the bottleneck at this pressure (1 = at its objective)
    # a move is made only when it brings the worse role's pressure to at most this fraction
    gain: float = 0.8
    sustain: int = 3  # consecutive looks that must want the same move
    min_interval_s: float = 30.0  # from the end of one switch to the start of the next
    drain_timeout_s: float = 120.0  # a worker not drained by then keeps its role (abandoned)
    # a switched worker not answering as its new role by then counts as failed (it stays out of
    # routing until it answers)
    rejoin_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        times = (self.interval_s, self.drain_timeout_s, self.rejoin_timeout_s)
        if min(times) <= 0 or self.min_interval_s < 0:
            raise ValueError(
                "PlannerConfig: interval_s, drain_timeout_s and rejoin_timeout_s must be "
                f"positive and min_interval_s >= 0, got {times} and {self.min_interval_s}"
            )
        if self.sustain < 1 or self.high <= 0 or not 0 < self.gain < 1:
            raise ValueError(
                "PlannerConfig: sustain >= 1, high > 0 and 0 < gain < 1, got "
                f"{self.sustain}, {self.high}, {self.gain}"
            )


class RolePressure(NamedTuple):
    """Each role's load against its objective (1.0 = at it, more = past it)."""

    prefill: float  # a new prompt's predicted queue wait over the TTFT objective (mean)
    decode: float  # the decode workers' step time over TBT, or batch over its bound (mean)
    prefill_workers: int  # healthy prefill workers counted
    decode_workers: int  # healthy decode workers counted


class RoleSwitch(NamedTuple):
    """One move the planner asks for."""

    worker_id: str  # the worker that changes role: the least loaded of its role
    from_role: str  # "prefill" | "decode"
    to_role: str
    before: RolePressure  # the pressures that asked for it
    predicted: tuple[float, float]  # (prefill, decode) pressure once the worker has moved


def decode_pressure(d: DecodeCandidate, tbt_slo_ms: float) -> float:
    """A decode worker's load against its objective: its step's predicted time over the TBT
    objective, its sequences over its batch bound, or more when sequences wait for pool room."""
    step_ms = predict(d.coef, decode_features(d.running, d.context_tokens))
    p = step_ms / tbt_slo_ms if tbt_slo_ms > 0 else 0.0
    if d.max_batch > 0:
        p = max(p, d.running / d.max_batch)
    # Sequences that wait for pool room: past its capacity. `waiting` also holds what is routed
    # there and still prefilling (a prefill backlog, not decode's), and `running` counts every
    # waiting sequence, so a wait for a batch slot is the term above.
    if d.waiting and sum(w[2] for w in d.waiting) > d.free_blocks:
        p = max(p, 1.0 + len(d.waiting) / max(1, d.running - len(d.waiting)))
    return p


def role_pressure(state: ClusterState, ttft_slo_ms: float, tbt_slo_ms: float) -> RolePressure:
    """The pressures of the healthy workers in `state`."""
    pre = [w for w in state.prefill if w.healthy]
    dec = [d for d in state.decode if d.healthy]
    pp = sum(w.queue_ms for w in pre) / len(pre) / ttft_slo_ms if pre and ttft_slo_ms > 0 else 0.0
    pd = sum(decode_pressure(d, tbt_slo_ms) for d in dec) / len(dec) if dec else 0.0
    return RolePressure(pp, pd, len(pre), len(dec))


def best_move(pressure: RolePressure, config: PlannerConfig) -> tuple[str, str, tuple] | None:
    """(from role, to role, predicted (prefill, decode) pressure) of the move that relieves the
    bottleneck role enough, or None. Work spreads evenly over a role's workers, so a role of n
    workers at pressure p is at p * n / (n - 1) with one fewer."""
    pp, pd, n_p, n_d = pressure
    worst = max(pp, pd)
    if worst < config.high:
        return None
    if pd >= pp and n_p >= 2:
        after = (pp * n_p / (n_p - 1), pd * n_d / (n_d + 1))
        move = ("prefill", "decode")
    elif pp > pd and n_d >= 2:
        after = (pp * n_p / (n_p + 1), pd * n_d / (n_d - 1))
        move = ("decode", "prefill")
    else:
        return None
    return (*move, after) if max(after) <= config.gain * worst else None


class RolePlanner:
    """The planner's memory between looks: how many looks in a row wanted the same move, and
    when the last switch ended. `look` is called every interval; `switch_ended` after the move
    it returned is done or abandoned (no look asks for another until then)."""

    def __init__(self, config: PlannerConfig):
        self.config = config
        self._wanted: tuple[str, str] | None = None
        self._streak = 0
        self._busy = False  # a switch it asked for is under way
        self._ended_at = -float("inf")

    def look(
        self,
        now_s: float,
        state: ClusterState,
        attainment: float | None,
        ttft_slo_ms: float,
        tbt_slo_ms: float,
    ) -> RoleSwitch | None:
        """The switch to make now, if any. `attainment`: the share of the requests judged since
        the previous look that met their objectives (rejected ones count as missed; None = no
        request was judged)."""
        cfg = self.config
        pressure = role_pressure(state, ttft_slo_ms, tbt_slo_ms)
        move = best_move(pressure, cfg)
        if attainment is not None and attainment >= cfg.target_attainment:
            move = None  # the objectives are met: no switch is worth its drain
        if move is None or self._busy:
            self._wanted, self._streak = None, 0
            return None
        if move[:2] == self._wanted:
            self._streak += 1
        else:
            self._wanted, self._streak = move[:2], 1
        if self._streak < cfg.sustain or now_s - self._ended_at < cfg.min_interval_s:
            return None
        worker = _least_loaded(state, move[0])
        if worker is None:
            return None
        self._busy, self._wanted, self._streak = True, None, 0
        return RoleSwitch(worker, move[0], move[1], pressure, move[2])

    def switch_ended(self, now_s: float) -> None:
        """The switch `look` returned is over (done or abandoned): the rate limit runs from now."""
        self._busy, self._ended_at = False, now_s


def _least_loaded(state: ClusterState, role: str) -> str | None:
    """The worker of `role` that drains soonest: the shortest prefill queue, the lightest
    decode batch (fewest tokens still to generate)."""
    if role == "prefill":
        pre = [w for w in state.prefill if w.healthy]
        return min(pre, key=lambda w: (w.queue_ms, w.worker_id)).worker_id if pre else None
    dec = [d for d in state.decode if d.healthy]
    if not dec:
        return None

    def left(d: DecodeCandidate) -> tuple[int, int, str]:
        return (sum(s[1] for s in d.seqs) + sum(w[1] for w in d.waiting), d.running, d.worker_id)

    return min(dec, key=left).worker_id
