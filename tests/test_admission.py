"""Admission by the objectives on a running cluster: a request no pair is predicted to serve in
time is refused at once with when to retry (a `retry-after` trailer), or, where the conductor's
`admission` is best_effort, served all the same and never counted as good."""

from __future__ import annotations

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


def test_a_request_that_cannot_be_served_in_time_is_refused_with_when_to_retry(lm):
    with Cluster(lm) as c:
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
        assert s.requests_slo_met + s.requests_slo_missed == 1


def test_best_effort_admission_serves_it_and_never_counts_it_as_good(lm):
    with Cluster(lm, conductor={"admission": "best_effort"}) as c:
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


def test_the_admission_mode_is_checked():
    with pytest.raises(ValueError, match="ConductorConfig.admission"):
        ConductorConfig(admission="maybe")
