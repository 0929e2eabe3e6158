"""Baselines the probes are scored against, fitted on the training split only.

- ``ConstantBaseline``: predicts the mean training label for every step (what an MLP that ignores its
  input converges to under BCE or MSE).
- ``LogprobBaseline``: the step's length-normalised log-probability under the model the probe stands
  for (``mean_logprob`` for a model's own samples; ``target_logprob / target_num_tokens`` for draft
  steps read by the target), mapped to a probability by either
  * ``logistic``: p = sigmoid(a * z + b) with z the standardised log-prob, fitted by Newton's method on
    the BCE against the soft labels (a tiny ridge term keeps it finite on separable data), or
  * ``isotonic``: the monotone (non-decreasing) step function minimising squared error, linear between
    its knots and constant beyond them (scikit-learn's IsotonicRegression, clipped to [0, 1]).
  Both are stored as plain numbers in ``baselines.json``.

(The third baseline, the last-layer probe, is an ordinary SemanticProbe; see train.probes_train. Pure numpy and
scikit-learn, in probes/ so that the checkpoint reader in infer/ can rebuild them.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

LOGPROB_KINDS = ("logistic", "isotonic")


def _vector(values: Any, name: str) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    if v.size == 0:
        raise ValueError(f"{name} is empty")
    if not np.isfinite(v).all():
        raise ValueError(f"{name} has {int((~np.isfinite(v)).sum())} NaN/inf values")
    return v


@dataclass
class ConstantBaseline:
    value: float

    @classmethod
    def fit(cls, labels: Any) -> ConstantBaseline:
        return cls(float(_vector(labels, "labels").mean()))

    def predict(self, n: int) -> np.ndarray:
        return np.full(int(n), self.value, dtype=np.float64)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "constant", "value": self.value}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ConstantBaseline:
        return cls(float(data["value"]))


@dataclass
class LogprobBaseline:
    kind: str
    params: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def fit(cls, logprobs: Any, labels: Any, kind: str = "logistic") -> LogprobBaseline:
        x, y = _vector(logprobs, "log-probabilities"), _vector(labels, "labels")
        if x.size != y.size:
            raise ValueError(f"log-probabilities and labels differ in length ({x.size} vs {y.size})")
        if kind == "logistic":
            return cls(kind, _fit_logistic(x, y))
        if kind == "isotonic":
            return cls(kind, _fit_isotonic(x, y))
        raise ValueError(f"logprob baseline kind must be one of {LOGPROB_KINDS}, got {kind!r}")

    def predict(self, logprobs: Any) -> np.ndarray:
        x = _vector(logprobs, "log-probabilities")
        p = self.params
        if self.kind == "logistic":
            z = (x - p["mean"]) / p["scale"]
            return 1.0 / (1.0 + np.exp(-(p["slope"] * z + p["intercept"])))
        if self.kind == "isotonic":
            return np.clip(np.interp(x, p["x"], p["y"]), 0.0, 1.0)
        raise ValueError(f"unknown logprob baseline kind {self.kind!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": f"logprob_{self.kind}", **self.params}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LogprobBaseline:
        kind = str(data["kind"]).removeprefix("logprob_")
        return cls(kind, {k: v for k, v in data.items() if k != "kind"})


def _fit_logistic(x: np.ndarray, y: np.ndarray, ridge: float = 1e-4, iters: int = 100) -> dict[str, float]:
    mean, scale = float(x.mean()), float(x.std())
    scale = scale if scale > 1e-12 else 1.0
    design = np.stack([(x - mean) / scale, np.ones_like(x)], axis=1)
    w = np.array([0.0, _logit(float(np.clip(y.mean(), 1e-6, 1 - 1e-6)))])
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-(design @ w)))
        grad = design.T @ (p - y) / x.size + ridge * np.array([w[0], 0.0])
        hess = (design * (p * (1 - p))[:, None]).T @ design / x.size + ridge * np.eye(2)
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-10:
            break
    return {"slope": float(w[0]), "intercept": float(w[1]), "mean": mean, "scale": scale}


def _fit_isotonic(x: np.ndarray, y: np.ndarray) -> dict[str, list[float]]:
    from sklearn.isotonic import IsotonicRegression

    iso = IsotonicRegression(y_min=0.0, y_max=1.0, increasing=True, out_of_bounds="clip").fit(x, y)
    return {"x": [float(v) for v in iso.X_thresholds_], "y": [float(v) for v in iso.y_thresholds_]}


def _logit(p: float) -> float:
    return math.log(p / (1 - p))
