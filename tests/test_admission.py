"""Admission by the objectives on a running cluster: a request no pair is predicted to serve in
time is refused at once with when to retry (a `retry-after` trailer), or, where the conductor's
`admission` is best_effort, served all the same and never counted as good. On a fresh cluster,
whose workers' models no served request has checked, such a request on an idle worker is a
probe: served, judged by its outcome."""

from __future__ import annotations

import re

import grpc
import pytest

from conductor import ConductorConfig
from model import load_model
from protos import halfmoon_pb2 as pb
from servekit import RETRY_AFTER_KEY
from tests.serving_cluster import Cluster

PROMPT = list(range(3, 120))
HOPELESS = {"ttft_slo_ms": 1e-3, "tbt_slo_ms": 60_000.0}  # no prefill answers in a microsecond


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-random")


def _status(c: Cluster) -> pb.StatusReply:
    return c.stub.Status(pb.StatusRequest(), timeout=10)


def _check_models(c: Cluster) -> None:
    """Serve enough requests that the conductor has checked both workers' models (a model no
    served request has checked is not believed on an idle worker: its misses are probes)."""
    for _ in range(5):
        ids, _, _ = c.generate(token_ids=PROMPT, max_tokens=4)
        assert len(ids) == 4


def _unpredicted(c: Cluster, how: str) -> float:
    value = c.conductor.registry.get_sample_value(
        "halfmoon_admitted_unpredicted_total", {"how": how}
    )
    return value or 0.0


def test_on_a_fresh_cluster_a_predicted_miss_is_a_probe_not_a_refusal(lm):
    with Cluster(lm) as c:
        # far past its objective (more than a correction could mend): refused even so
        with pytest.raises(grpc.RpcError) as err:
            c.generate(token_ids=PROMPT, max_tokens=4, **HOPELESS)
        predicted = float(re.search(r"predicted TTFT (\d+) ms", err.value.details()).group(1))
        # within what a correction could mend (half the prediction): served as a probe, judged
        # by its outcome, since no served request has checked the idle workers' models yet
        near = {"ttft_slo_ms": max(predicted, 1.0) / 2, "tbt_slo_ms": 60_000.0}
        ids, _, _ = c.generate(token_ids=PROMPT, max_tokens=4, **near)
        assert len(ids) == 4
        assert _unpredicted(c, "probe") == 1.0
        assert _status(c).requests_rejected == 1


def test_a_request_that_cannot_be_served_in_time_is_refused_with_when_to_retry(lm):
    with Cluster(lm) as c:
        _check_models(c)
        with pytest.raises(grpc.RpcError) as err:
            c.generate(token_ids=PROMPT, max_tokens=4, **HOPELESS)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "TTFT" in err.value.details()
        trailers = dict(err.value.trailing_metadata())
        assert int(trailers[RETRY_AFTER_KEY]) >= 1
        ids, _, _ = c.generate(token_ids=PROMPT, max_tokens=4)  # the defaults: served
        assert len(ids) == 4
        s = _status(c)
        assert (s.requests_rejected, s.requests_best_effort) == (1, 0)
        assert s.requests_slo_met + s.requests_slo_missed == 6


def test_best_effort_admission_serves_it_and_never_counts_it_as_good(lm):
    with Cluster(lm, conductor={"admission": "best_effort"}) as c:
        _check_models(c)
        ids, _, last = c.generate(token_ids=PROMPT, max_tokens=4, **HOPELESS)
        assert len(ids) == 4 and last.finish_reason == "length"
        ids, _, _ = c.generate(token_ids=PROMPT, max_tokens=4)
        assert len(ids) == 4
        s = _status(c)
        assert s.requests_rejected == 0 and s.requests_best_effort == 1
        assert s.requests_slo_missed >= 1  # the best-effort one, whatever its times were
        metrics = c.conductor.registry
        assert metrics.get_sample_value(
            "halfmoon_slo_requests_total", {"outcome": "best_effort"}
        ) == 1.0
        assert _unpredicted(c, "best_effort") == 1.0 and _unpredicted(c, "probe") == 0.0


def test_a_request_with_its_own_tpot_objective_is_admitted_and_judged_by_it(lm):
    # judged as vLLM's benchmark counts: TTFT and TPOT (the mean gap), TBT not at all
    with Cluster(lm, conductor={"tbt_slo_ms": 0.0, "tpot_slo_ms": 60_000.0}) as c:
        _check_models(c)
        ids, _, last = c.generate(token_ids=PROMPT, max_tokens=4, tpot_slo_ms=30_000.0)
        assert len(ids) == 4 and last.usage.completion_tokens == 4
        assert last.usage.predicted_tbt_ms > 0  # the decode worker's estimate it was routed by
        s = _status(c)
        assert (s.requests_slo_met, s.requests_slo_missed, s.requests_rejected) == (6, 0, 0)
        met = c.conductor.registry.get_sample_value(
            "halfmoon_slo_requests_total", {"outcome": "met"}
        )
        assert met == 6.0
        # one no decode step can meet: refused at once, the objective named, when to retry said
        with pytest.raises(grpc.RpcError) as err:
            c.generate(token_ids=PROMPT, max_tokens=4, tpot_slo_ms=1e-3)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "time per output token" in err.value.details()
        assert int(dict(err.value.trailing_metadata())[RETRY_AFTER_KEY]) >= 1
        # a negative one is no objective: INVALID_ARGUMENT naming the field
        with pytest.raises(grpc.RpcError) as err:
            c.generate(token_ids=PROMPT, max_tokens=4, tpot_slo_ms=-5.0)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "tpot_slo_ms" in err.value.details()
        assert _status(c).requests_rejected == 1  # the refused one (an invalid one is no request)


def test_the_admission_mode_is_checked():
    with pytest.raises(ValueError, match="ConductorConfig.admission"):
        ConductorConfig(admission="maybe")
