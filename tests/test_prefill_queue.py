"""The prefill worker's predicted queue (its load report's predicted_queue_ms): queued prompts as
its loop runs them, in rounds of up to max_batch_tokens and batched forwards of up to chunk_size
tokens a prompt, each forward one fixed cost for all its prompts (the time model is fitted per
forward), not one per prompt."""

from __future__ import annotations

import pytest

from prefill_node import PrefillConfig, PrefillScheduler
from servekit import PrefillTimeModel

# 5 ms a forward, 1 ms a token, 0.001 ms a token per position attended
COEF = (5.0, 1.0, 0.001)


def _scheduler(**config) -> PrefillScheduler:
    s = PrefillScheduler(PrefillConfig(**config), None, None)  # type: ignore[arg-type]
    s.timing = PrefillTimeModel(prior=COEF)
    return s


def _forward(spans: list[tuple[int, int]]) -> float:
    tokens = sum(e - s for s, e in spans)
    return COEF[0] + COEF[1] * tokens + COEF[2] * sum((e - s) * e for s, e in spans)


def test_a_burst_of_short_prompts_is_one_forward_not_one_each():
    s = _scheduler(chunk_size=64, max_batch_tokens=256)
    assert s.rounds_ms([10] * 10) == pytest.approx(_forward([(0, 10)] * 10))
    assert s.rounds_ms([10] * 10) < 10 * _forward([(0, 10)]) - 8 * COEF[0]


def test_long_prompts_take_chunks_and_rounds_end_at_max_batch_tokens():
    s = _scheduler(chunk_size=64, max_batch_tokens=256)
    one = _forward([(0, 64)]) + _forward([(64, 128)]) + _forward([(128, 192)])
    one += _forward([(192, 200)])
    assert s.rounds_ms([200]) == pytest.approx(one)
    # 200 tokens < 256: the second prompt joins the first's round, their chunks together
    both = sum(_forward([(a, b)] * 2) for a, b in ((0, 64), (64, 128), (128, 192), (192, 200)))
    assert s.rounds_ms([200, 200]) == pytest.approx(both)
    # a round full at 150 tokens: two rounds, one after the other
    assert _scheduler(chunk_size=64, max_batch_tokens=150).rounds_ms([200, 200]) == (
        pytest.approx(2 * one)
    )
    assert s.rounds_ms([]) == 0.0


def test_a_round_under_way_counts_only_what_is_left_to_compute():
    s = _scheduler(chunk_size=64, max_batch_tokens=256)
    # a prompt 96 tokens in (its cached prefix, or forwards done) of 160
    assert s.forwards_ms([(96, 160)]) == pytest.approx(_forward([(96, 160)]))
    assert s.forwards_ms([(160, 160)]) == 0.0
