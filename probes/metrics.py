"""Probe-quality metrics in plain numpy: calibration, ranking and error against (soft) labels.

Labels may be soft (a semantic probability |C_k|/N) or hard 0/1. Calibration metrics compare mean
prediction with mean label per bin, which is the usual ECE when labels are 0/1 and a regression-style
calibration error when they are soft. Ranking metrics (AUROC, AUPRC) need a binary target, taken as
``label >= threshold``.

Binning conventions:

- equal width ("uniform"): edges are exactly ``k / n_bins`` (so 0.3, 0.6 and 0.7 ARE edges with 10 bins;
  ``np.linspace`` would give 0.30000000000000004 and drop 0.3 into the bin below); bins are left-closed
  ``[e_i, e_{i+1})`` and the last bin is closed ``[e_{n-1}, 1]``. torchmetrics' ``BinaryCalibrationError``
  uses linspace edges, so the two differ only for predictions exactly on an interior edge (and for 1.0,
  which torchmetrics puts in an extra bin of its own).
- equal mass ("quantile"): rows are ranked by prediction and cut into ``n_bins`` runs of equal size (sizes
  differ by at most one), except that tied predictions all go to the bin of the first of them (as sklearn's
  quantile edges keep them): that bin grows and later ones may be left empty. Split by row order, a tie would bin
  its labels by question, and a constant predictor (all ties) would score the spread between questions as
  miscalibration. The reported edges are each bin's smallest prediction (0 and 1 at the ends; an empty bin
  repeats the next edge).

Labels must lie in [0, 1] (semantic probabilities or 0/1); predictions too, for calibration.

Degenerate inputs (one class for AUROC, constant input for Spearman) give NaN, not an exception.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, Literal

import numpy as np

BinStrategy = Literal["uniform", "quantile"]


def _as_pair(pred: Any, label: Any) -> tuple[np.ndarray, np.ndarray]:
    p = np.asarray(pred, dtype=np.float64).reshape(-1)
    y = np.asarray(label, dtype=np.float64).reshape(-1)
    if p.shape != y.shape:
        raise ValueError(f"pred and label must have the same length, got {p.shape[0]} and {y.shape[0]}")
    if p.size == 0:
        raise ValueError("pred and label are empty")
    if not (np.isfinite(p).all() and np.isfinite(y).all()):
        raise ValueError("pred and label must be finite (found NaN/inf)")
    return p, y


def _check_probabilities(p: np.ndarray, name: str) -> None:
    if p.min() < 0 or p.max() > 1:
        raise ValueError(f"{name} must lie in [0, 1], range seen [{p.min():.4g}, {p.max():.4g}]")


# ---- calibration --------------------------------------------------------------------------------
def _check_bins(n_bins: Any) -> None:
    if not isinstance(n_bins, (int, np.integer)) or n_bins < 1:
        raise ValueError(f"n_bins must be a positive int, got {n_bins!r}")


def bin_edges(pred: Any, n_bins: int = 15, strategy: BinStrategy = "uniform") -> np.ndarray:
    """n_bins+1 edges over [0, 1]: exact ``k / n_bins``, or (equal mass) each rank bin's smallest prediction."""
    _check_bins(n_bins)
    if strategy == "uniform":
        return np.arange(n_bins + 1, dtype=np.float64) / n_bins  # k/n is correctly rounded: 3/10 == 0.3
    if strategy == "quantile":
        p = np.asarray(pred, dtype=np.float64).reshape(-1)
        ids = _rank_bin_ids(p, n_bins)
        edges = np.ones(n_bins + 1)
        # An empty bin (more bins than rows, or after a tie) takes the next bin's edge: edges never decrease or go NaN.
        for k in range(n_bins - 1, -1, -1):
            edges[k] = p[ids == k].min() if np.any(ids == k) else edges[k + 1]
        edges[0] = min(edges[0], 0.0)
        return edges
    raise ValueError(f"strategy must be 'uniform' or 'quantile', got {strategy!r}")


def _rank_bin_ids(p: np.ndarray, n_bins: int) -> np.ndarray:
    """Equal-mass bin of each row: rank * n_bins // n, tied predictions all in the bin of the first of them. Split
    by row order, a tie would bin the labels by question: a constant predictor, all ties, would score the spread
    between questions as miscalibration (its ECE is |mean p - mean y|, as in sklearn's quantile bins)."""
    ranks = np.searchsorted(np.sort(p), p, side="left")  # a tie's first rank
    return ranks * n_bins // max(p.size, 1)


def _bin_ids(p: np.ndarray, n_bins: int, strategy: BinStrategy) -> np.ndarray:
    if strategy == "quantile":
        return _rank_bin_ids(p, n_bins)
    # side="right" on interior edges -> left-closed bins; values equal to the top edge land in the last bin
    return np.searchsorted(bin_edges(p, n_bins, "uniform")[1:-1], p, side="right")


@dataclass
class ReliabilityBins:
    """Per-bin statistics for a reliability diagram (empty bins have count 0 and NaN means)."""

    edges: np.ndarray
    mean_pred: np.ndarray
    mean_label: np.ndarray
    count: np.ndarray
    std_label: np.ndarray | None = None  # spread of the labels in each bin (for an interval on mean_label)

    @property
    def weight(self) -> np.ndarray:
        return self.count / self.count.sum()

    def label_interval(self, z: float = 1.645) -> tuple[np.ndarray, np.ndarray]:
        """Normal-approximation interval of each bin's mean label (z = 1.645: 90%), clipped to [0, 1]; NaN
        for empty bins. Rows of one question are correlated, so this is a lower bound on the uncertainty."""
        std = self.std_label if self.std_label is not None else np.full(self.count.shape, np.nan)
        with np.errstate(invalid="ignore", divide="ignore"):
            half = z * std / np.sqrt(np.maximum(self.count - 1, 1))
        return np.clip(self.mean_label - half, 0, 1), np.clip(self.mean_label + half, 0, 1)

    def to_dict(self) -> dict[str, list]:
        def clean(a: np.ndarray) -> list:
            return [None if not math.isfinite(float(v)) else float(v) for v in a]
        low, high = self.label_interval()
        return {"edges": clean(self.edges), "mean_pred": clean(self.mean_pred),
                "mean_label": clean(self.mean_label), "count": [int(c) for c in self.count],
                "label_low": clean(low), "label_high": clean(high)}


def reliability_bins(pred: Any, label: Any, n_bins: int = 15, strategy: BinStrategy = "uniform") -> ReliabilityBins:
    p, y = _as_pair(pred, label)
    _check_probabilities(p, "pred")
    _check_probabilities(y, "label")
    edges = bin_edges(p, n_bins, strategy)
    ids = _bin_ids(p, n_bins, strategy)
    count = np.bincount(ids, minlength=n_bins).astype(np.int64)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_pred = np.bincount(ids, weights=p, minlength=n_bins) / count
        mean_label = np.bincount(ids, weights=y, minlength=n_bins) / count
        mean_sq = np.bincount(ids, weights=y * y, minlength=n_bins) / count
    std_label = np.sqrt(np.maximum(mean_sq - mean_label ** 2, 0.0))
    return ReliabilityBins(edges=edges, mean_pred=mean_pred, mean_label=mean_label, count=count,
                           std_label=std_label)


def _calibration_gaps(pred: Any, label: Any, n_bins: int, strategy: BinStrategy) -> tuple[np.ndarray, np.ndarray]:
    bins = reliability_bins(pred, label, n_bins, strategy)
    filled = bins.count > 0
    gaps = np.abs(bins.mean_pred[filled] - bins.mean_label[filled])
    return gaps, bins.count[filled] / bins.count.sum()


def ece(pred: Any, label: Any, n_bins: int = 15, strategy: BinStrategy = "uniform") -> float:
    """Expected calibration error: sum over bins of mass * |mean(pred) - mean(label)|."""
    gaps, mass = _calibration_gaps(pred, label, n_bins, strategy)
    return float(np.sum(gaps * mass))


def mce(pred: Any, label: Any, n_bins: int = 15, strategy: BinStrategy = "uniform") -> float:
    """Maximum calibration error over non-empty bins."""
    gaps, _ = _calibration_gaps(pred, label, n_bins, strategy)
    return float(gaps.max())


# ---- errors and ranking -------------------------------------------------------------------------
def brier(pred: Any, label: Any) -> float:
    """Mean squared error of the probability (sklearn's brier_score_loss for 0/1 labels)."""
    p, y = _as_pair(pred, label)
    _check_probabilities(y, "label")
    return float(np.mean((p - y) ** 2))


def log_loss(pred: Any, label: Any, eps: float = 1e-6) -> float:
    """Cross-entropy -[y log p + (1-y) log(1-p)] averaged over rows (soft labels allowed); p clipped to
    [eps, 1-eps] so a confident miss costs log(1/eps), not infinity."""
    p, y = _as_pair(pred, label)
    _check_probabilities(p, "pred")
    _check_probabilities(y, "label")
    p = np.clip(p, eps, 1 - eps)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def brier_skill(pred: Any, label: Any, reference: Any) -> float:
    """1 - Brier(pred) / Brier(reference): > 0 when `pred` beats the reference predictions (e.g. the
    constant mean-training-label baseline), 0 when equal, NaN when the reference is perfect."""
    ref = brier(reference, label)
    return math.nan if ref == 0 else 1.0 - brier(pred, label) / ref


def label_noise_floor(label: Any, num_samples: int, includes_self: bool = False) -> float:
    """The Brier score a perfect predictor of the true probability still gets against labels that are
    frequencies of `num_samples` draws. No predictor can be expected to score below it; a probe near it is
    as good as N-sample labels can show.

    Each label's variance is estimated without bias from its own count: y = m/N with m ~ Bin(N, p) gives
    y(1-y)/(N-1). With `includes_self` the labelled sample is one of the N (SemanticSpec's |C_k|/N for a
    model's own sample), so y = (1 + m)/N with m ~ Bin(N-1, p): Var(y) = (N-1)p(1-p)/N^2, estimated by
    m(N-1-m)/(N^2 (N-2)); a sample alone in its cluster (y = 1/N) then adds nothing.
    """
    y = np.asarray(label, dtype=np.float64).reshape(-1)
    if y.size == 0:
        raise ValueError("label is empty")
    _check_probabilities(y, "label")
    n = num_samples - 1 if includes_self else num_samples
    if n < 2:
        raise ValueError(f"num_samples must be >= {3 if includes_self else 2} for a noise floor, got {num_samples}")
    m = y * num_samples - (1 if includes_self else 0)  # the binomial count behind each label
    if includes_self and np.any(m < -1e-6):
        raise ValueError(f"a label that counts its own sample is at least 1/{num_samples}; got {y.min():.4f}")
    m = np.clip(m, 0, n)
    return float(np.mean(m * (n - m)) / (num_samples ** 2 * (n - 1)))


def mae(pred: Any, label: Any) -> float:
    p, y = _as_pair(pred, label)
    return float(np.mean(np.abs(p - y)))


def spearman(pred: Any, label: Any) -> float:
    """Spearman rank correlation; NaN when either side is constant or there are < 2 rows."""
    p, y = _as_pair(pred, label)
    if p.size < 2 or np.ptp(p) == 0 or np.ptp(y) == 0:
        return math.nan
    from scipy import stats  # lazy: scipy.stats costs ~1 s to import and the runtime never needs it

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(stats.spearmanr(p, y).statistic)


def _binary(label: np.ndarray, threshold: float) -> np.ndarray:
    return label >= threshold


def auroc(pred: Any, label: Any, threshold: float = 0.5) -> float:
    """Area under the ROC curve for the target ``label >= threshold``; NaN when only one class is present.

    Computed as the Mann-Whitney statistic with mid-ranks for ties (what sklearn's trapezoidal ROC gives).
    """
    p, y = _as_pair(pred, label)
    pos = _binary(y, threshold)
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return math.nan
    from scipy import stats  # lazy, see spearman

    ranks = stats.rankdata(p)  # average ranks for ties
    u = ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def auprc(pred: Any, label: Any, threshold: float = 0.5) -> float:
    """Average precision (sklearn's step-wise sum of precision * recall increments); NaN without positives."""
    p, y = _as_pair(pred, label)
    pos = _binary(y, threshold)
    n_pos = int(pos.sum())
    if n_pos == 0:
        return math.nan
    _, precision, recall, _ = precision_recall_points(p, pos)
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def precision_recall_points(scores: np.ndarray, positives: np.ndarray) -> tuple[np.ndarray, ...]:
    """(threshold, precision, recall, accepted count) with every distinct score as the threshold, descending: one
    point per run of tied scores (its last row), as a threshold cannot split ties. Needs a positive."""
    order = np.argsort(-scores, kind="mergesort")
    s_sorted, pos_sorted = scores[order], positives[order]
    ends = np.r_[np.nonzero(np.diff(s_sorted))[0], s_sorted.size - 1]
    tp = np.cumsum(pos_sorted)[ends]
    accepted = ends + 1
    return s_sorted[ends], tp / accepted, tp / positives.sum(), accepted


# ---- uncertainty --------------------------------------------------------------------------------
@dataclass
class BootstrapCI:
    estimate: float
    low: float
    high: float
    alpha: float
    n_boot: int
    n_valid: int  # replicates with a finite value (e.g. AUROC is NaN on a single-class resample)
    # a share with one value in every unit: no resample can differ, so the interval is Wilson's over the units
    wilson_units: int | None = None

    def to_dict(self) -> dict[str, Any]:
        def clean(v: float) -> float | None:
            return v if math.isfinite(v) else None
        out = {"estimate": clean(self.estimate), "low": clean(self.low), "high": clean(self.high),
               "alpha": self.alpha, "n_boot": self.n_boot, "n_valid": self.n_valid}
        if self.wilson_units is not None:
            out["wilson_units"] = self.wilson_units
        return out


Z95 = NormalDist().inv_cdf(0.975)  # two-sided 95% normal quantile (as `bootstrap_ci` computes it for alpha 0.05)


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float] | None:
    """Wilson score interval of a binomial proportion (pass@1 over problems, acceptance over judged steps);
    None without trials. Unlike the normal interval it stays inside [0, 1] and is not empty at 0 or n."""
    if n <= 0:
        return None
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, {n}], got {successes}")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # at 0 or n successes a bound is exactly 0 or 1 (centre - half rounds to a few ulps off it)
    return (0.0 if successes == 0 else max(0.0, centre - half)), (1.0 if successes == n else min(1.0, centre + half))


def bootstrap_ci(metric_fn: Callable[..., float], *arrays: Any, n_boot: int = 1000, alpha: float = 0.10,
                 seed: int = 0, groups: Sequence[Any] | None = None, share: bool = False) -> BootstrapCI:
    """Percentile bootstrap interval (1 - alpha) of ``metric_fn(*arrays)``.

    Rows are resampled with replacement; with `groups`, whole groups are resampled (rows of one
    question are correlated, so row resampling would understate the uncertainty).

    share: the metric is a share in [0, 1] (an acceptance rate, a precision). Where every unit (group, else row)
    with a defined share has the same one (none, all, or one rate) no resample can differ and the percentile
    interval is a point, as if the share were known exactly; the Wilson interval over those units, each one trial at
    that share, is given instead (`wilson_units` says over how many; a unit whose share is undefined, a precision
    where it accepted nothing, is not one of them). One unit off that share brings back the percentile interval.
    """
    if not arrays:
        raise ValueError("bootstrap_ci needs at least one array")
    arrs = [np.asarray(a) for a in arrays]
    n = arrs[0].shape[0]
    if any(a.shape[0] != n for a in arrs):
        raise ValueError(f"all arrays must have the same length, got {[a.shape[0] for a in arrs]}")
    if n == 0:
        raise ValueError("bootstrap_ci: arrays are empty")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    rng = np.random.default_rng(seed)
    if groups is None:
        draw = lambda: rng.integers(0, n, size=n)  # noqa: E731
    else:
        g = np.asarray(groups)
        if g.shape[0] != n:
            raise ValueError(f"groups has length {g.shape[0]}, arrays have {n}")
        _, inverse = np.unique(g, return_inverse=True)
        members = [np.nonzero(inverse == k)[0] for k in range(inverse.max() + 1)]
        draw = lambda: np.concatenate([members[k] for k in rng.integers(0, len(members), size=len(members))])  # noqa: E731
    estimate = float(metric_fn(*arrs))
    if share:
        units = [np.arange(n)[i:i + 1] for i in range(n)] if groups is None else members
        rates = [float(metric_fn(*(a[rows] for a in arrs))) for rows in units]
        defined = {r for r in rates if math.isfinite(r)}
        if len(defined) == 1:
            rate, n_units = defined.pop(), sum(math.isfinite(r) for r in rates)
            low, high = wilson_interval(rate * n_units, n_units, NormalDist().inv_cdf(1 - alpha / 2))
            # (n_valid: every resample would have given that share)
            return BootstrapCI(estimate, low, high, alpha, n_boot, n_boot, n_units)
    values = np.empty(n_boot)
    for b in range(n_boot):
        idx = draw()
        values[b] = metric_fn(*(a[idx] for a in arrs))
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return BootstrapCI(estimate, math.nan, math.nan, alpha, n_boot, 0)
    low, high = np.quantile(finite, [alpha / 2, 1 - alpha / 2])
    return BootstrapCI(estimate, float(low), float(high), alpha, n_boot, int(finite.size))


# ---- report -------------------------------------------------------------------------------------
def probe_report(pred: Any, label: Any, threshold: float = 0.5, n_bins: int = 15) -> dict[str, Any]:
    """Every metric above in one JSON-friendly dict (NaN -> None).

    `threshold` binarises the labels for AUROC/AUPRC and the positive rate.
    """
    p, y = _as_pair(pred, label)
    _check_probabilities(p, "pred")
    _check_probabilities(y, "label")
    report: dict[str, Any] = {
        "n": int(p.size),
        "mean_pred": float(p.mean()),
        "mean_label": float(y.mean()),
        "positive_rate": float(_binary(y, threshold).mean()),
        "threshold": float(threshold),
        "n_bins": int(n_bins),
        "ece_uniform": ece(p, y, n_bins, "uniform"),
        "ece_quantile": ece(p, y, n_bins, "quantile"),
        "mce_uniform": mce(p, y, n_bins, "uniform"),
        "brier": brier(p, y),
        "log_loss": log_loss(p, y),
        "mae": mae(p, y),
        "spearman": spearman(p, y),
        "auroc": auroc(p, y, threshold),
        "auprc": auprc(p, y, threshold),
        "reliability_uniform": reliability_bins(p, y, n_bins, "uniform").to_dict(),
        "reliability_quantile": reliability_bins(p, y, n_bins, "quantile").to_dict(),
    }
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in report.items()}
