"""Decision thresholds for pair verifiers (a score per (draft step, target step) pair; accept iff score >= t).

Accepting a wrong step costs answer quality, rejecting a right one only costs speed, so the default
operating point is precision-first: the threshold with the highest recall (acceptance) among those whose
precision reaches a target. The F1-optimal threshold is reported next to it for comparison.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from specprobe.probes.metrics import precision_recall_points


@dataclass
class OperatingPoint:
    threshold: float
    precision: float
    recall: float
    acceptance_rate: float  # share of all pairs accepted at this threshold
    f1: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass
class ThresholdFit:
    """Result of `fit_threshold`; JSON round-trips through to_dict/from_dict."""

    target_precision: float
    met_target: bool  # False: no threshold reaches the target; `chosen` is the best-precision one
    chosen: OperatingPoint
    f1_optimal: OperatingPoint
    n: int
    n_positive: int

    @property
    def threshold(self) -> float:
        return self.chosen.threshold

    def accept(self, scores: Any) -> np.ndarray:
        """Boolean decisions at the chosen threshold."""
        return np.asarray(scores, dtype=np.float64) >= self.chosen.threshold

    def to_dict(self) -> dict[str, Any]:
        return {"target_precision": self.target_precision, "met_target": self.met_target,
                "chosen": self.chosen.to_dict(), "f1_optimal": self.f1_optimal.to_dict(),
                "n": self.n, "n_positive": self.n_positive}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ThresholdFit:
        return cls(target_precision=float(data["target_precision"]), met_target=bool(data["met_target"]),
                   chosen=OperatingPoint(**data["chosen"]), f1_optimal=OperatingPoint(**data["f1_optimal"]),
                   n=int(data["n"]), n_positive=int(data["n_positive"]))


def _validate(scores: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    y_raw = np.asarray(labels).reshape(-1)
    if s.shape != y_raw.shape:
        raise ValueError(f"scores and labels must have the same length, got {s.size} and {y_raw.size}")
    if s.size == 0:
        raise ValueError("fit_threshold: no scores given")
    if not np.isfinite(s).all():
        raise ValueError(f"fit_threshold: {int((~np.isfinite(s)).sum())} scores are NaN/inf")
    y = y_raw.astype(np.float64)
    if not np.isin(y, (0.0, 1.0)).all():
        raise ValueError("fit_threshold: labels must be binary (0/1 or bool): 1 = the pair is equivalent")
    if y.sum() == 0:
        raise ValueError("fit_threshold: no positive (equivalent) pairs, so precision/recall are undefined")
    return s, y.astype(bool)


def decisions_at(scores: Any, labels: Any, threshold: float) -> dict[str, Any]:
    """What accepting `score >= threshold` does on labelled pairs (1 = the two steps mean the same): the acceptance
    rate, precision, recall, false-accept rate and F1, None where undefined (nothing accepted, no pair of a class),
    and the counts."""
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    y = np.asarray(labels).reshape(-1).astype(bool)
    accept = s >= threshold
    accepted, positive, negative = int(accept.sum()), int(y.sum()), int((~y).sum())
    tp, fp = int((accept & y).sum()), int((accept & ~y).sum())
    precision = tp / accepted if accepted else None
    recall = tp / positive if positive else None
    f1 = 2 * precision * recall / (precision + recall) if precision and recall else (
        0.0 if tp == 0 and accepted and positive else None)
    return {"threshold": float(threshold), "acceptance_rate": accepted / s.size if s.size else None,
            "precision": precision, "recall": recall, "false_accept_rate": fp / negative if negative else None,
            "f1": f1, "accepted": accepted, "n": int(s.size), "n_positive": positive}


def operating_points(scores: Any, labels: Any) -> dict[str, np.ndarray]:
    """Precision/recall/acceptance/F1 at every distinct score used as threshold (descending)."""
    return _points(*_validate(scores, labels))


def _points(s: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    threshold, precision, recall, accepted = precision_recall_points(s, y)
    with np.errstate(invalid="ignore", divide="ignore"):
        f1 = np.where(precision > 0, 2 * precision * recall / (precision + recall), 0.0)
    return {"threshold": threshold, "precision": precision, "recall": recall,
            "acceptance_rate": accepted / s.size, "f1": f1}


def _point(points: dict[str, np.ndarray], i: int) -> OperatingPoint:
    return OperatingPoint(**{k: float(v[i]) for k, v in points.items()})


def fit_threshold(scores: Any, labels: Any, target_precision: float = 0.95) -> ThresholdFit:
    """Highest-recall threshold with precision >= target (ties: the higher threshold), and the F1 optimum.

    When no threshold reaches the target, the threshold with the best precision is chosen (ties: the
    higher recall) and `met_target` is False, so callers can refuse to deploy it.
    """
    if not 0 < target_precision <= 1 or math.isnan(target_precision):
        raise ValueError(f"target_precision must be in (0, 1], got {target_precision}")
    s, y = _validate(scores, labels)
    points = _points(s, y)
    precision, recall = points["precision"], points["recall"]
    ok = np.nonzero(precision >= target_precision - 1e-12)[0]
    if ok.size:
        # thresholds are descending, recall non-decreasing: the last qualifying index has the most recall;
        # among equal recall prefer the earliest (higher threshold, fewer accepted negatives)
        best_recall = recall[ok].max()
        chosen = int(ok[np.nonzero(recall[ok] == best_recall)[0][0]])
        met = True
    else:
        best_precision = precision.max()
        candidates = np.nonzero(precision == best_precision)[0]
        chosen = int(candidates[np.argmax(recall[candidates])])
        met = False
    f1_best = int(np.argmax(points["f1"]))
    return ThresholdFit(target_precision=float(target_precision), met_target=met,
                        chosen=_point(points, chosen), f1_optimal=_point(points, f1_best),
                        n=int(y.size), n_positive=int(y.sum()))
