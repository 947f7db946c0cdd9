"""Timing models fitted from measured timings: prefill time and decode-step time (small least
squares)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

import numpy as np


class LinearTimeModel:
    """ms = coef . features, refitted over the latest `window` measurements.

    The fit is robust and anchored: Huber-weighted least squares (a step slowed by a neighbour's
    burst does not drag the line), with a ridge pull toward the prior worth `prior_weight` of a
    measurement at each column's largest value (so a lone slow point with leverage is seen as an
    outlier rather than fitted). Until `min_samples` measurements arrive the prior stands; then the
    fit is redone at every measurement while there are few, every 8th after. Coefficients are
    clipped at zero.
    """

    def __init__(
        self,
        prior: Sequence[float],
        window: int = 256,
        min_samples: int = 8,
        prior_weight: float = 0.1,
    ):
        self.prior = [float(c) for c in prior]
        self._coef = list(self.prior)
        self._rows: deque[tuple[list[float], float]] = deque(maxlen=window)
        # Calibration measurements taken before serving: the fit stands on them until
        # `min_samples` served measurements arrive, then on those alone (a start-up forward,
        # first touching memory beside a neighbour's start-up, is not what serving costs).
        self._seeds: list[tuple[list[float], float]] = []
        self._min_samples = min_samples
        self._prior_weight = prior_weight
        self._seen = 0
        self._lock = threading.Lock()

    def features(self, *args: float) -> list[float]:
        """The feature row for one measurement (subclasses name their arguments)."""
        raise NotImplementedError

    @property
    def coef(self) -> list[float]:
        with self._lock:
            return list(self._coef)

    @property
    def samples(self) -> int:
        return len(self._rows)

    def seed(self, ms: float, *args: float) -> None:
        """Record one calibration measurement (see `_seeds`) and refit."""
        with self._lock:
            self._seeds.append((self.features(*args), float(ms)))
            rows = self._training_rows()
            if len(rows) >= self._min_samples:
                # Measured here, on this hardware: the calibration replaces the default prior
                # (which can be an order of magnitude off) as what later fits are anchored to.
                self._coef = self._fit(rows, prior_weight=1e-4)
                if len(self._rows) < self._min_samples:
                    self.prior = list(self._coef)

    def observe(self, ms: float, *args: float) -> None:
        """Record one measured time and refit."""
        with self._lock:
            self._rows.append((self.features(*args), float(ms)))
            self._seen += 1
            if self._seeds and len(self._rows) < self._min_samples:
                return  # the calibration stands until enough served measurements replace it
            rows = self._training_rows()
            if len(rows) >= self._min_samples and (self._seen < 64 or self._seen % 8 == 0):
                self._coef = self._fit(rows)

    def _training_rows(self) -> list[tuple[list[float], float]]:
        if len(self._rows) >= self._min_samples:
            return list(self._rows)
        return self._seeds + list(self._rows)

    def _fit(
        self, rows: list[tuple[list[float], float]], prior_weight: float | None = None
    ) -> list[float]:
        x = np.array([r for r, _ in rows], dtype=np.float64)
        y = np.array([t for _, t in rows], dtype=np.float64)
        prior = np.array(self.prior)
        # A column with no spread (batch always 1) cannot be told from the intercept: it keeps its
        # prior.
        free = [j for j in range(x.shape[1]) if j == 0 or np.ptp(x[:, j]) > 0]
        fixed = [j for j in range(x.shape[1]) if j not in free]
        y = y - (x[:, fixed] @ prior[fixed] if fixed else 0.0)
        x = x[:, free]
        # Ridge rows: each coefficient pulled toward its prior with the weight of `prior_weight`
        # rows at the column's largest value, where a lone slow measurement has the most leverage.
        weight = self._prior_weight if prior_weight is None else prior_weight
        scale = np.maximum(np.abs(x).max(axis=0), 1e-9) * np.sqrt(weight)
        xa = np.vstack([x, np.diag(scale)])
        ya = np.concatenate([y, scale * prior[free]])
        w = np.ones(len(ya))
        for _ in range(
            8
        ):  # iteratively reweighted least squares with Huber weights on the measurements
            sw = np.sqrt(w)
            sol, *_ = np.linalg.lstsq(xa * sw[:, None], ya * sw, rcond=None)
            r = np.abs(y - x @ sol)
            mad = 1.4826 * np.median(r) + 1e-3 * (np.median(np.abs(y)) + 1e-9)
            w[: len(y)] = np.minimum(1.0, 1.345 * mad / np.maximum(r, 1e-12))
            # The prior stays worth `prior_weight` of a measurement as weighted now: at full
            # weight against downweighted measurements it would outvote them all.
            w[len(y) :] = float(np.mean(w[: len(y)]))
        coef = prior.copy()
        coef[free] = np.maximum(sol, 0.0)
        return coef.tolist()

    def predict(self, *args: float) -> float:
        return predict(self.coef, self.features(*args))


def predict(coef: Sequence[float], row: Sequence[float]) -> float:
    """coef . row, never below zero."""
    return max(0.0, float(sum(c * r for c, r in zip(coef, row))))


class PrefillTimeModel(LinearTimeModel):
    """prefill ms = c0 + c1*tokens + c2*tokens*context, context = the positions attended (prefix +
    tokens)."""

    def __init__(
        self, prior: Sequence[float] = (5.0, 1.0, 0.0), window: int = 256, min_samples: int = 8
    ):
        super().__init__(prior, window, min_samples)

    def features(self, tokens: float, context: float = 0.0) -> list[float]:  # type: ignore[override]
        return prefill_features(tokens, context)


class DecodeTimeModel(LinearTimeModel):
    """decode step ms = c0 + c1*batch + c2*total_context_tokens."""

    def __init__(
        self, prior: Sequence[float] = (20.0, 2.0, 0.0), window: int = 256, min_samples: int = 8
    ):
        super().__init__(prior, window, min_samples)

    def features(self, batch: float, context_tokens: float = 0.0) -> list[float]:  # type: ignore[override]
        return decode_features(batch, context_tokens)


def prefill_features(tokens: float, context: float = 0.0) -> list[float]:
    """Feature row of the prefill model for `tokens` new tokens ending at position `context`."""
    return [1.0, float(tokens), float(tokens) * float(context)]


def decode_features(batch: float, context_tokens: float = 0.0) -> list[float]:
    """Feature row of the decode-step model for a batch holding `context_tokens` KV tokens in
    all."""
    return [1.0, float(batch), float(context_tokens)]
