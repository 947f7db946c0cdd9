"""How far a worker's fitted time model is off, learned from its requests' measured times: the
conductor scales the model by it before the policy sees it."""

from __future__ import annotations

from protos import halfmoon_pb2 as pb


class Correction:
    """measured over predicted, summed (EWMAs) over the worker's recent requests: what its fitted
    model misses (the RPCs and hand-offs around a forward, a neighbour's load on shared cores).
    The conductor scales the worker's model by it before the policy sees it."""

    ALPHA = 0.3  # weight of the newest request
    BOUNDS = (0.2, 5.0)  # one odd request cannot swing it further
    MIN_SAMPLES = 4  # applied once this many requests agree (a cold start's first is no evidence)

    MODEL_CHANGE = 0.25  # a refit moving the model's prediction this much starts it afresh

    def __init__(self) -> None:
        # EWMAs of measured and of raw predicted ms: their ratio is the correction (a ratio of
        # sums, not a mean of ratios: a short request's fixed overhead, 2-3x its few predicted
        # ms, would otherwise scale a long prompt's prediction by as much and refuse it)
        self._measured = self._predicted = 0.0
        self.samples = 0
        self._reference_ms = 0.0  # the worker's model at a reference point, when last observed
        # Bumped when the model moved past MODEL_CHANGE: estimates made before are no evidence.
        self.epoch = 0
        self.stale = 0  # measurements dropped because their estimate was made against an old model

    def follow_model(self, reference_ms: float) -> None:
        """The worker reported its model's prediction at a fixed reference point. Ratios learned
        against an earlier model (its start-up prior, say) say nothing of a refit one: when the
        prediction moved by more than MODEL_CHANGE, forget them."""
        if reference_ms <= 0:
            return
        old = self._reference_ms
        self._reference_ms = reference_ms
        if old > 0 and abs(reference_ms - old) > self.MODEL_CHANGE * old:
            self._measured = self._predicted = 0.0
            self.samples = 0
            self.epoch += 1

    @property
    def ratio(self) -> float:
        if self.samples < self.MIN_SAMPLES or self._predicted <= 0:
            return 1.0
        return min(max(self._measured / self._predicted, self.BOUNDS[0]), self.BOUNDS[1])

    def observe(self, measured_ms: float, predicted_ms: float, applied: float, epoch: int) -> None:
        """`predicted_ms` was made with `applied` as the ratio against the model of `epoch`; the
        raw model said predicted/applied. A request routed before a refit (a burst judged by the
        start-up calibration, finishing after the model learned the serving steps) measures the
        old model, not this one: it is dropped, or the ratio would scale the new model by the old
        one's error."""
        if predicted_ms <= 0 or measured_ms <= 0 or applied <= 0:
            return
        if epoch != self.epoch:
            self.stale += 1
            return
        raw = predicted_ms / applied
        measured = min(max(measured_ms, self.BOUNDS[0] * raw), self.BOUNDS[1] * raw)
        a = max(self.ALPHA, 1.0 / (self.samples + 1))  # a plain mean until it has history
        self._measured = (1 - a) * self._measured + a * measured
        self._predicted = (1 - a) * self._predicted + a * raw
        self.samples += 1


def model_reference_ms(kind: str, load: pb.WorkerLoad) -> float:
    """A worker's fitted model at one fixed point (prefill: 512 new tokens on no context; decode:
    a step of 8 sequences over 8,192 tokens), to notice when a refit changes it."""
    coef = tuple(load.prefill_coef if kind == "prefill" else load.decode_coef)
    if len(coef) < 3:
        return 0.0
    if kind == "prefill":
        return coef[0] + coef[1] * 512
    return coef[0] + coef[1] * 8 + coef[2] * 8192
