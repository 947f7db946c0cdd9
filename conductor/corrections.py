"""How far a worker's fitted time model is off, learned from its requests' measured times: the
conductor scales the model by it before the policy sees it."""

from __future__ import annotations

import time

from protos import halfmoon_pb2 as pb


class Correction:
    """measured over predicted, summed (EWMAs) over the worker's recent requests: what its fitted
    model misses (the RPCs and hand-offs around a forward, a neighbour's load on shared cores).
    The conductor scales the worker's model by it before the policy sees it."""

    ALPHA = 0.3  # weight of the newest request
    BOUNDS = (0.2, 5.0)  # one odd request cannot swing it further
    MIN_SAMPLES = 4  # applied once this many requests agree (a cold start's first is no evidence)

    # What was learned longer ago than this is no check of the model now: a transient slowdown
    # (a neighbour's burst on shared cores) learned as 4x refused every request after it, and
    # nothing refused is ever measured to correct it. A stale correction is no longer applied
    # (the model alone judges, which served requests did check) and its next measurement starts
    # it afresh. It is not a reason to probe: a probe admitted on a stale 4x took the longest
    # prompts (predicted within 5x of their objective), which then missed by seconds and held
    # the CPUs from the prompts behind them, and the restart's first measurements as many again.
    STALE_S = 30.0
    MODEL_DRIFT = 0.01  # a refit moving the model's prediction less than this is no new model
    EPOCHS_KEPT = 1024  # models an estimate may have been made against (one per refit)

    def __init__(self) -> None:
        # EWMAs of measured and of raw predicted ms: their ratio is the correction (a ratio of
        # sums, not a mean of ratios: a short request's fixed overhead, 2-3x its few predicted
        # ms, would otherwise scale a long prompt's prediction by as much and refuse it). The
        # predictions are kept as the current model would make them.
        self._measured = self._predicted = 0.0
        self.samples = 0
        # Bumped at each refit; an estimate names the epoch it was made in.
        self.epoch = 0
        # The worker's model at a fixed reference point, per epoch: an estimate made against an
        # earlier model is re-expressed in the current one by the ratio of the two.
        self._reference_ms: dict[int, float] = {}
        self.stale = 0  # measurements dropped: their model is older than EPOCHS_KEPT refits
        self.observed_at = -float("inf")  # time.monotonic() of the last measurement
        self.restarts = 0  # times a stale correction started afresh
        self.held = False  # MIN_SAMPLES served requests have checked the model at least once

    def follow_model(self, reference_ms: float) -> None:
        """The worker reported its model's prediction at a fixed reference point. A refit model
        (its start-up prior replaced by the serving steps' fit, or a noisy refit of a few ms
        steps) says other times for the same work: what was learned against the old one is
        carried over, scaled as the two models differ there, not thrown away (a worker whose
        model refits every few reports would otherwise never be corrected)."""
        if reference_ms <= 0:
            return
        old = self._reference_ms.get(self.epoch, 0.0)
        if old <= 0:
            self._reference_ms[self.epoch] = reference_ms
            return
        if abs(reference_ms - old) <= self.MODEL_DRIFT * old:
            return
        self._predicted *= reference_ms / old
        self.epoch += 1
        self._reference_ms[self.epoch] = reference_ms
        self._reference_ms.pop(self.epoch - self.EPOCHS_KEPT, None)

    def checked(self) -> bool:
        """Served requests have checked the model (MIN_SAMPLES of them, at some time): a miss
        it predicts is believed. Until then an idle worker's predicted miss is a probe."""
        return self.held

    def current(self, now: float | None = None) -> bool:
        """Its ratio holds: MIN_SAMPLES measurements, the last within STALE_S."""
        now = time.monotonic() if now is None else now
        return self.samples >= self.MIN_SAMPLES and now - self.observed_at <= self.STALE_S

    def ratio_at(self, now: float | None = None) -> float:
        """What the model is scaled by: 1.0 until MIN_SAMPLES agree and once they are stale."""
        if not self.current(now) or self._predicted <= 0:
            return 1.0
        return min(max(self._measured / self._predicted, self.BOUNDS[0]), self.BOUNDS[1])

    @property
    def ratio(self) -> float:
        return self.ratio_at()

    def observe(
        self,
        measured_ms: float,
        predicted_ms: float,
        applied: float,
        epoch: int,
        now: float | None = None,
    ) -> None:
        """`predicted_ms` was made with `applied` as the ratio against the model of `epoch`; the
        raw model said predicted/applied. A request routed before a refit (a burst judged by the
        start-up calibration, finishing after the model learned the serving steps) measured the
        old model: its prediction is re-expressed in the current one before it counts."""
        if predicted_ms <= 0 or measured_ms <= 0 or applied <= 0:
            return
        now = time.monotonic() if now is None else now
        if self.samples and now - self.observed_at > self.STALE_S:
            self._measured = self._predicted = 0.0  # learned afresh, as at a cold start
            self.samples = 0
            self.restarts += 1
        self.observed_at = now
        then, now = self._reference_ms.get(epoch, 0.0), self._reference_ms.get(self.epoch, 0.0)
        if epoch != self.epoch and (then <= 0 or now <= 0):
            self.stale += 1
            return
        raw = predicted_ms / applied * (now / then if epoch != self.epoch else 1.0)
        measured = min(max(measured_ms, self.BOUNDS[0] * raw), self.BOUNDS[1] * raw)
        a = max(self.ALPHA, 1.0 / (self.samples + 1))  # a plain mean until it has history
        self._measured = (1 - a) * self._measured + a * measured
        self._predicted = (1 - a) * self._predicted + a * raw
        self.samples += 1
        self.held = self.held or self.samples >= self.MIN_SAMPLES


REFERENCE_PROMPT_TOKENS = 512  # prefill's reference point; decode's: this many per sequence
REFERENCE_BATCH = 8  # decode's reference batch (less where the worker's max_batch is)


def model_reference_ms(kind: str, load: pb.WorkerLoad) -> float:
    """A worker's fitted model at one fixed point near where it serves (prefill: 512 new tokens
    on no context; decode: a step of its batch bound, up to 8 sequences, 512 tokens each), to
    notice how a refit changes it. A point far from the serving one (8,192 tokens on a worker
    whose pool holds 1,280) moves with every noisy refit of a coefficient it hardly uses."""
    coef = tuple(load.prefill_coef if kind == "prefill" else load.decode_coef)
    if len(coef) < 3:
        return 0.0
    if kind == "prefill":
        return coef[0] + coef[1] * REFERENCE_PROMPT_TOKENS
    batch = min(REFERENCE_BATCH, load.max_batch) if load.max_batch > 0 else REFERENCE_BATCH
    return coef[0] + coef[1] * batch + coef[2] * batch * REFERENCE_PROMPT_TOKENS
