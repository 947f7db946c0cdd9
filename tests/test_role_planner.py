"""The runtime planner's pure rule (conductor/planner.py) on scripted cluster states."""

from __future__ import annotations

import pytest

from conductor.planner import PlannerConfig, RolePlanner, best_move, role_pressure
from conductor.policy_types import ClusterState, DecodeCandidate, PrefillCandidate

TTFT, TBT = 2000.0, 100.0
COEF = (1.0, 0.0, 0.0)  # a decode step of 1 ms whatever the batch


def _state(queues, decodes):
    """Prefill workers with these queue waits (ms); decode workers as (running, waiting)."""
    pre = [PrefillCandidate(f"p{i}", (), q, (0.0, 1.0, 0.0)) for i, q in enumerate(queues)]
    dec = [
        DecodeCandidate(
            f"d{i}", run, 100, 100, 0, COEF, seqs=((10, 5 * (i + 1), 1),) * (run - wait),
            waiting=((10, 50, 1),) * wait, max_batch=4,
        )
        for i, (run, wait) in enumerate(decodes)
    ]  # fmt: skip
    return ClusterState(pre, dec, {}, 16, 1024)


def test_pressures_read_queue_waits_and_batches_against_the_objectives():
    p = role_pressure(_state([1000.0, 3000.0], [(2, 0), (6, 2)]), TTFT, TBT)
    assert p.prefill == pytest.approx(1.0)  # a mean wait of 2 s against a 2 s objective
    # 2/4 of its batch bound; 6 sequences of which 2 wait behind 4 admitted: 1 + 2/4
    assert p.decode == pytest.approx((0.5 + 1.5) / 2)
    assert (p.prefill_workers, p.decode_workers) == (2, 2)


def test_a_move_is_made_only_when_it_relieves_the_bottleneck_enough():
    cfg = PlannerConfig()
    # decode past its objective, prefill idle: one of two prefill workers moves
    frm, to, after = best_move(role_pressure(_state([0.0, 0.0], [(8, 4)]), TTFT, TBT), cfg)
    assert (frm, to) == ("prefill", "decode") and after[1] == pytest.approx(1.0)
    # both past their objectives: moving a worker would only move the miss
    assert best_move(role_pressure(_state([4000.0, 4000.0], [(8, 4)]), TTFT, TBT), cfg) is None
    # the last worker of a role never moves; below the objectives nothing moves
    assert best_move(role_pressure(_state([0.0], [(8, 4)]), TTFT, TBT), cfg) is None
    assert best_move(role_pressure(_state([0.0, 0.0], [(2, 0)]), TTFT, TBT), cfg) is None
    # prompts queue while two decode workers idle: a decode worker moves to prefill
    move = best_move(role_pressure(_state([5000.0], [(1, 0), (1, 0)]), TTFT, TBT), cfg)
    assert move is not None and move[:2] == ("decode", "prefill")


def test_the_planner_waits_for_sustained_need_and_limits_its_rate():
    planner = RolePlanner(PlannerConfig(sustain=3, min_interval_s=30.0))
    hot = _state([0.0, 500.0], [(8, 4)])
    assert planner.look(0.0, hot, 0.5, TTFT, TBT) is None
    assert planner.look(2.0, hot, 0.5, TTFT, TBT) is None
    # a look that meets the objectives breaks the streak
    assert planner.look(4.0, hot, 1.0, TTFT, TBT) is None
    assert planner.look(6.0, hot, 0.5, TTFT, TBT) is None
    assert planner.look(8.0, hot, None, TTFT, TBT) is None  # nothing judged: pressures decide
    switch = planner.look(10.0, hot, 0.5, TTFT, TBT)
    assert switch is not None
    assert (switch.worker_id, switch.from_role, switch.to_role) == ("p0", "prefill", "decode")
    # none while that switch is under way, nor within min_interval_s of its end
    for t in (12.0, 14.0, 16.0):
        assert planner.look(t, hot, 0.5, TTFT, TBT) is None
    planner.switch_ended(16.0)
    assert [planner.look(16.0 + t, hot, 0.5, TTFT, TBT) for t in (2, 4, 6)] == [None] * 3
    assert planner.look(44.0, hot, 0.5, TTFT, TBT) is None  # 28 s after: still too soon
    assert planner.look(46.0, hot, 0.5, TTFT, TBT) is not None


def test_the_decode_worker_that_drains_soonest_is_the_one_moved():
    planner = RolePlanner(PlannerConfig(sustain=1, min_interval_s=0.0))
    # prompts queue; d1's sequences have more tokens left than d0's
    switch = planner.look(0.0, _state([6000.0], [(1, 0), (1, 0)]), 0.2, TTFT, TBT)
    assert switch is not None and switch.worker_id == "d0" and switch.to_role == "prefill"


@pytest.mark.parametrize(
    "bad", [{"interval_s": 0}, {"sustain": 0}, {"gain": 1.0}, {"min_interval_s": -1}]
)
def test_bad_planner_settings_are_refused(bad):
    with pytest.raises(ValueError, match="PlannerConfig"):
        PlannerConfig(**bad)
