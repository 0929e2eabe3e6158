"""probe-eval arithmetic: numbers in, JSON-friendly dicts out. No plotting, no file access.

Every metric itself comes from `probes.metrics` (ECE, MCE, Brier, MAE, Spearman, AUROC, AUPRC,
reliability bins, bootstrap CIs). This module adds the bookkeeping around them:

- calibration blocks with a bootstrap 90% CI per metric, resampling whole questions (rows of one
  question share a context and are correlated) or, given `units` (question -> family), whole families (a
  template's questions are correlated too);
- the SemanticSpec acceptance ratio min(1, p/q) implied by two probes against the ratio computed from
  the empirical labels;
- ROC / precision-recall points and the operating point of a pair verifier, agreement between
  verifiers' decisions (agreement rate, Cohen's kappa);
- which layers a per-layer sweep visits and the table it produces;
- 0.1-wide probability bins and subsampling for the UMAP view.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from specprobe.probes.acceptance import semantic_accept_prob
from specprobe.probes.io import clean_json
from specprobe.probes.metrics import (
    auprc,
    auroc,
    bootstrap_ci,
    brier,
    brier_skill,
    ece,
    label_noise_floor,
    log_loss,
    mae,
    mce,
    reliability_bins,
    spearman,
)
from specprobe.probes.threshold import decisions_at, operating_points

MetricFn = Callable[[np.ndarray, np.ndarray], float]
Units = Mapping[str, str] | None  # question -> family (template), for resampling whole families

# Names of the calibration metrics in the order the report shows them.
CALIBRATION_METRICS = ("ece_uniform", "ece_quantile", "mce", "brier", "log_loss", "mae", "spearman", "auroc", "auprc")
# Direction of the metrics a comparison can call better or worse (others get no verdict).
LOWER_IS_BETTER = {"ece_uniform", "ece_quantile", "mce", "brier", "log_loss", "mae", "rmse", "val_brier", "val_mae",
                   "test_brier"}
# The minimum-size guard: below these, bootstrap intervals describe the resampling of a handful of
# questions, not the uncertainty of the estimate, so they are withheld and the report says why.
MIN_QUESTIONS = 20
MIN_POSITIVES = 10
MIN_RANKING_POSITIVES = 50  # below this many equivalent (or other) pairs a verifier's AUROC / AUPRC is not reported
MIN_CLASS_QUESTIONS = 5  # a ranking interval needs each class (label >= / < the threshold) in this many questions
#                         (families, when those are resampled)
MIN_FAMILIES = 5  # resampling whole families (templates), an interval needs this many of them
MIN_VALID_SHARE = 0.9  # an interval needs the metric defined on this share of the resamples
HIGHER_IS_BETTER = {"spearman", "auroc", "auprc", "precision", "cohen_kappa", "agreement"}


# ----------------------------------------------------------------------------- calibration
def calibration_metric_fns(n_bins: int, threshold: float = 0.5) -> dict[str, MetricFn]:
    """The report's calibration metrics as f(pred, label) -> float, bound to the report's settings."""
    return {
        "ece_uniform": lambda p, y: ece(p, y, n_bins, "uniform"),
        "ece_quantile": lambda p, y: ece(p, y, n_bins, "quantile"),
        "mce": lambda p, y: mce(p, y, n_bins, "uniform"),
        "brier": brier,
        "log_loss": log_loss,
        "mae": mae,
        "spearman": spearman,
        "auroc": lambda p, y: auroc(p, y, threshold),
        "auprc": lambda p, y: auprc(p, y, threshold),
    }


def metrics_with_ci(fns: dict[str, MetricFn], pred: Any, label: Any, groups: Any, *, n_boot: int,
                    alpha: float = 0.10, seed: int = 0, units: Units = None,
                    shares: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """{name: {estimate, low, high, alpha, n_boot, n_valid}}, resampling whole groups (questions), or whole
    families of them (`units`: question -> family). `shares`: the metrics that are shares of rows (an acceptance
    rate); where every unit has the same share, their interval is Wilson's over the units (`bootstrap_ci`).

    Every metric sees the same resamples (one seed), so their intervals are comparable. A metric undefined on more
    than a tenth of the resamples (AUROC where a resample lacks a class) gets no interval: the defined ones are the
    resamples that happened to keep the rare class, so their spread understates it.
    """
    p, y, g = _aligned(pred, label, groups)
    out, drawn = {}, resampled(g, units)
    for name, fn in fns.items():
        entry = bootstrap_ci(fn, p, y, n_boot=n_boot, alpha=alpha, seed=seed, groups=drawn,
                             share=name in shares).to_dict()
        if entry.get("low") is not None and entry["n_valid"] < MIN_VALID_SHARE * n_boot:
            entry = {**entry, "low": None, "high": None,
                     "withheld": f"defined on {entry['n_valid']} of {n_boot} resamples"}
        out[name] = entry
    return out


def _aligned(pred: Any, label: Any, groups: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    p = np.asarray(pred, dtype=np.float64).reshape(-1)
    y = np.asarray(label, dtype=np.float64).reshape(-1)
    g = np.asarray(groups).reshape(-1)
    if not p.size == y.size == g.size:
        raise ValueError(f"predictions, labels and question ids differ in length ({p.size}, {y.size}, {g.size})")
    if p.size == 0:
        raise ValueError("no rows to evaluate")
    return p, y, g


def resampled(groups: np.ndarray, units: Units) -> np.ndarray:
    """What the bootstrap resamples: the rows' questions, or the families (templates) those belong to (a question
    `units` does not name is its own)."""
    if units is None:
        return groups
    return np.asarray([units.get(q, q) for q in groups.tolist()], dtype=object)


def size_guard(n_questions: int, n_positive: int | None = None, n_families: int | None = None) -> str | None:
    """Why intervals on this set would mislead (fewer than MIN_QUESTIONS questions, MIN_POSITIVES positives or,
    resampling families, MIN_FAMILIES families), or None when the set is large enough."""
    reasons = []
    if n_questions < MIN_QUESTIONS:
        reasons.append(f"{n_questions} held-out question(s) < {MIN_QUESTIONS}")
    if n_families is not None and n_families < MIN_FAMILIES:
        reasons.append(f"{n_families} question families (templates) < {MIN_FAMILIES}")
    if n_positive is not None and n_positive < MIN_POSITIVES:
        reasons.append(f"{n_positive} positive(s) < {MIN_POSITIVES}")
    return "; ".join(reasons) or None


def guard_of(groups: np.ndarray, units: Units, n_positive: int | None = None) -> str | None:
    """`size_guard` of rows whose questions are `groups` (and, resampling families, their families)."""
    families = None if units is None else np.unique(resampled(groups, units)).size
    return size_guard(np.unique(groups).size, n_positive, families)


def withhold_intervals(metrics: dict[str, dict[str, Any]], reason: str | None) -> dict[str, dict[str, Any]]:
    """Drop the low/high of every interval (keeping the estimate) and say why, when `reason` is set."""
    if reason is None:
        return metrics
    return {name: {**entry, "low": None, "high": None, "withheld": reason} for name, entry in metrics.items()}


def calibration_block(pred: Any, label: Any, groups: Any, *, n_bins: int = 10, n_boot: int = 1000,
                      alpha: float = 0.10, seed: int = 0, threshold: float = 0.5,
                      num_samples: int | None = None, label_includes_self: bool = False,
                      units: Units = None) -> dict[str, Any]:
    """Calibration of one predictor against (soft) empirical labels, with per-question (or, with `units`,
    per-family) bootstrap CIs.

    `threshold` binarises the labels for AUROC / AUPRC ("majority meaning": label >= 0.5). With
    `num_samples` (N draws behind each label) the block also holds the label noise floor of the Brier
    score (`label_includes_self`: the labelled sample is one of the N, see `label_noise_floor`). Too few questions or positives: intervals withheld (`size_guard`).
    """
    p, y, g = _aligned(pred, label, groups)
    n_questions, n_positive = np.unique(g).size, int((y >= threshold).sum())
    guard = guard_of(g, units, n_positive)
    metrics = metrics_with_ci(calibration_metric_fns(n_bins, threshold), p, y, g, n_boot=n_boot, alpha=alpha, seed=seed,
                              units=units)
    classes = {"positive": y >= threshold, "negative": y < threshold}
    by_class = {k: np.unique(g[mask]).size for k, mask in classes.items()}
    # resampling families, the ranking rests on the families that hold each class
    drawn, unit = (g, "question(s)") if units is None else (resampled(g, units), "famil(ies)")
    units_by_class = {k: np.unique(drawn[mask]).size for k, mask in classes.items()}
    rare = [f"{k} labels in {v} {unit}" for k, v in units_by_class.items() if v < MIN_CLASS_QUESTIONS]
    if rare:  # the ranking rests on a few questions' rows, however many rows there are
        ranking = withhold_intervals({k: metrics[k] for k in ("auroc", "auprc")},
                                     "; ".join(rare) + f" < {MIN_CLASS_QUESTIONS}: too few to rank on")
        metrics = {**metrics, **ranking}
    return clean_json({
        "n": p.size,
        "n_questions": n_questions,
        "n_positive": n_positive,
        "questions_by_class": by_class,
        **({"families_by_class": units_by_class} if units is not None else {}),
        "mean_pred": p.mean(),
        "mean_label": y.mean(),
        "positive_rate": (y >= threshold).mean(),
        "threshold": threshold,
        "n_bins": n_bins,
        "too_small": guard,
        "noise_floor_brier": label_noise_floor(y, num_samples, label_includes_self)
        if num_samples and num_samples > (2 if label_includes_self else 1) else None,
        "metrics": withhold_intervals(metrics, guard),
        "reliability_uniform": reliability_bins(p, y, n_bins, "uniform").to_dict(),
        "reliability_quantile": reliability_bins(p, y, n_bins, "quantile").to_dict(),
    })


def paired_comparison(pred: Any, reference: Any, label: Any, groups: Any, *, n_boot: int = 1000, alpha: float = 0.10,
                      seed: int = 0, units: Units = None) -> dict[str, Any]:
    """Does `pred` beat `reference` on the same rows? Brier difference (pred - reference) and Brier skill
    1 - Brier(pred)/Brier(reference), each with a paired bootstrap interval (per question or family), and a verdict:
    "better" / "worse" when the difference interval excludes 0, else "no clear difference" (or, when
    the set is too small for intervals, "too small to tell")."""
    p, y, g = _aligned(pred, label, groups)
    r = np.asarray(reference, dtype=np.float64).reshape(-1)
    if r.size != p.size:
        raise ValueError(f"reference has {r.size} rows, predictions {p.size}")
    units_g = resampled(g, units)
    delta = bootstrap_ci(lambda a, b, t: brier(a, t) - brier(b, t), p, r, y, n_boot=n_boot, alpha=alpha, seed=seed,
                         groups=units_g).to_dict()
    skill = bootstrap_ci(brier_skill, p, y, r, n_boot=n_boot, alpha=alpha, seed=seed, groups=units_g).to_dict()
    guard = guard_of(g, units)
    out = withhold_intervals({"brier_delta": delta, "brier_skill": skill}, guard)
    return clean_json({**out, "verdict": interval_verdict(delta, guard, higher_is_better=False)})


def interval_verdict(diff: dict[str, Any], guard: str | None, *, higher_is_better: bool) -> str:
    """A paired difference's verdict from its interval (a `BootstrapCI.to_dict()`): "better" / "worse" when the
    interval excludes 0 on the side that is good / bad, else "no clear difference"; "too small to tell" when the
    size guard withholds intervals."""
    if guard is not None:
        return "too small to tell"
    above = diff["low"] is not None and diff["low"] > 0
    below = diff["high"] is not None and diff["high"] < 0
    if above or below:
        return "better" if above == higher_is_better else "worse"
    return "no clear difference"


def estimate(block: dict[str, Any], name: str) -> float | None:
    """The point estimate of metric `name` in a calibration/acceptance block (None when absent)."""
    entry = block.get("metrics", {}).get(name)
    return None if entry is None else entry.get("estimate")


# ----------------------------------------------------------------------------- acceptance ratio
# the draft-side label the empirical ratio divides by (recorded in each acceptance block: reports made before
# 2026-11-28 divided by semantic_prob, |C|/N, and their acceptance figures are not comparable with today's)
EMPIRICAL_Q = "own_prob"


def empirical_ratio(prob_under_target: Any, own_prob: Any) -> np.ndarray:
    """min(1, P_target(meaning of the draft step) / P_draft(its meaning)) from the empirical labels, on the scale
    the probes learn: the target's share of samples with the step's meaning over the draft's leave-one-out share
    (`own_prob`, (|C_k| - 1)/(N - 1); both average the meaning's probability). A step no other draft sample
    shared has own_prob 0: its ratio is 1 where the target said that meaning, else 0 (min(1, p/q)'s eps rule).
    """
    put = np.asarray(prob_under_target, dtype=np.float64).reshape(-1)
    q = np.asarray(own_prob, dtype=np.float64).reshape(-1)
    if put.shape != q.shape:
        raise ValueError(f"prob_under_target and own_prob differ in length ({put.size}, {q.size})")
    if not (np.isfinite(put).all() and np.isfinite(q).all()):
        raise ValueError("prob_under_target / own_prob contain NaN (was the target sampled?)")
    return semantic_accept_prob(put, q)


def acceptance_metric_fns(n_bins: int) -> dict[str, MetricFn]:
    """Metrics of a predicted acceptance ratio against the empirical one (both in [0, 1])."""
    return {
        "mae": mae,
        "rmse": lambda p, y: math.sqrt(brier(p, y)),
        "bias": lambda p, y: float(np.mean(p) - np.mean(y)),
        "spearman": spearman,
        "ece_uniform": lambda p, y: ece(p, y, n_bins, "uniform"),
        "mean_predicted": lambda p, y: float(np.mean(p)),
        "mean_empirical": lambda p, y: float(np.mean(y)),
    }


def acceptance_block(p_pred: Any, q_pred: Any, prob_under_target: Any, own_prob: Any, groups: Any, *,
                     n_bins: int = 10, n_boot: int = 1000, alpha: float = 0.10, seed: int = 0,
                     units: Units = None) -> dict[str, Any]:
    """The acceptance probability min(1, p/q) the probes give each draft step, against the empirical one.

    p_pred: target probe on the draft step (target view); q_pred: draft probe on it. `mean_predicted`
    vs `mean_empirical` is the expected step acceptance rate the probes imply vs the data's.
    """
    predicted = np.asarray(semantic_accept_prob(np.asarray(p_pred, np.float64), np.asarray(q_pred, np.float64)))
    predicted = predicted.reshape(-1)
    empirical = empirical_ratio(prob_under_target, own_prob)
    _, _, g = _aligned(predicted, empirical, groups)
    guard = guard_of(g, units)
    return clean_json({
        "n": predicted.size,
        "n_questions": np.unique(g).size,
        "too_small": guard,
        "empirical_q": EMPIRICAL_Q,
        "saturated_predicted": (predicted >= 1.0).mean(),
        "saturated_empirical": (empirical >= 1.0).mean(),
        "metrics": withhold_intervals(metrics_with_ci(acceptance_metric_fns(n_bins), predicted, empirical, g,
                                                      n_boot=n_boot, alpha=alpha, seed=seed, units=units), guard),
    })


# ----------------------------------------------------------------------------- pair verifiers
def _binary_labels(labels: Any) -> np.ndarray:
    y = np.asarray(labels).reshape(-1)
    if y.dtype != bool:
        yf = y.astype(np.float64)
        if not np.isin(yf, (0.0, 1.0)).all():
            raise ValueError("pair labels must be 0/1 or bool (1 = the two steps mean the same)")
        y = yf.astype(bool)
    return y


def roc_points(scores: Any, labels: Any) -> dict[str, np.ndarray]:
    """ROC curve (fpr, tpr) at every distinct score as threshold (accept iff score >= t), from (0, 0).

    thresholds[0] is +inf (nothing accepted). Needs both classes.
    """
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    y = _binary_labels(labels)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"a ROC curve needs both classes; got {n_pos} equivalent and {n_neg} non-equivalent pairs")
    pts = operating_points(s, y)
    tp = np.rint(pts["recall"] * n_pos)  # counts back from rates: exact integers, no round-off below 0
    fp = np.rint(pts["acceptance_rate"] * s.size) - tp
    return {"threshold": np.r_[np.inf, pts["threshold"]], "fpr": np.r_[0.0, fp / n_neg],
            "tpr": np.r_[0.0, pts["recall"]]}


def pr_points(scores: Any, labels: Any) -> dict[str, np.ndarray]:
    """Precision-recall points at every distinct score as threshold (descending thresholds)."""
    pts = operating_points(np.asarray(scores, dtype=np.float64), _binary_labels(labels))
    return {k: pts[k] for k in ("threshold", "precision", "recall")}


AT_THRESHOLD_KEYS = ("threshold", "acceptance_rate", "precision", "recall", "false_accept_rate", "accepted")


def at_threshold(scores: Any, labels: Any, threshold: float) -> dict[str, Any]:
    """Decisions score >= threshold (`probes.threshold.decisions_at`): acceptance rate, precision, recall,
    false-accept rate."""
    decided = decisions_at(scores, _binary_labels(labels), threshold)
    return {k: decided[k] for k in AT_THRESHOLD_KEYS}


def verifier_block(scores: Any, labels: Any, groups: Any, threshold: float, *, n_boot: int = 1000,
                   alpha: float = 0.10, seed: int = 0, units: Units = None) -> dict[str, Any]:
    """A pair verifier on held-out pairs: AUROC/AUPRC with per-question (or family) CIs, its operating point, curves."""
    s, yf, g = _aligned(scores, _binary_labels(labels).astype(np.float64), groups)
    y = yf.astype(bool)
    fns = {"auroc": auroc, "auprc": auprc,
           "acceptance_rate": lambda p, t: float(np.mean(p >= threshold)),
           "precision": lambda p, t: _precision_at(p, t, threshold)}
    guard = guard_of(g, units, int(y.sum()))
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    out: dict[str, Any] = {
        "n": s.size, "n_positive": n_pos, "n_questions": np.unique(g).size, "too_small": guard,
        "ranking_not_evaluable": (f"{n_pos} equivalent and {n_neg} other pairs, fewer than {MIN_RANKING_POSITIVES} "
                                  "of one kind: too few to rank on" if min(n_pos, n_neg) < MIN_RANKING_POSITIVES
                                  else None),
        "metrics": withhold_intervals(metrics_with_ci(fns, s, yf, g, n_boot=n_boot, alpha=alpha, seed=seed,
                                                      units=units, shares=("acceptance_rate", "precision")), guard),
        "at_threshold": at_threshold(s, y, threshold),
    }
    if y.any() and (~y).any():
        out["roc"] = roc_points(s, y)  # threshold[0] = inf (nothing accepted) becomes null in JSON
        out["pr"] = pr_points(s, y)
    return clean_json(out)


def precision_over_accept_all(scores: Any, labels: Any, groups: Any, threshold: float, *, n_boot: int = 1000,
                              alpha: float = 0.10, seed: int = 0, units: Units = None) -> dict[str, Any]:
    """Is the verifier at `threshold` more precise than accepting every pair (whose precision is the share of
    equivalent pairs)? The difference precision − positive rate with a paired bootstrap interval (question or family),
    and a verdict as `paired_comparison`'s: "better" / "worse" when the interval excludes 0, else "no clear
    difference" ("too small to tell" below the size guard)."""
    s, yf, g = _aligned(scores, _binary_labels(labels).astype(np.float64), groups)
    diff = bootstrap_ci(lambda p, t: _precision_at(p, t, threshold) - float(t.mean()), s, yf, n_boot=n_boot,
                        alpha=alpha, seed=seed, groups=resampled(g, units)).to_dict()
    guard = guard_of(g, units, int(yf.sum()))
    return clean_json({**withhold_intervals({"precision_minus_positive_rate": diff}, guard),
                       "verdict": interval_verdict(diff, guard, higher_is_better=True)})


def _precision_at(scores: np.ndarray, labels: np.ndarray, threshold: float) -> float:
    accept = scores >= threshold
    return float(labels[accept].mean()) if accept.any() else math.nan


def cohen_kappa(a: Any, b: Any) -> float:
    """Cohen's kappa of two binary decision vectors; NaN when chance agreement is 1 (as sklearn)."""
    x, y = _binary_labels(a), _binary_labels(b)
    if x.shape != y.shape or x.size == 0:
        raise ValueError(f"decision vectors must be non-empty and equally long, got {x.size} and {y.size}")
    observed = float((x == y).mean())
    chance = float(x.mean() * y.mean() + (1 - x.mean()) * (1 - y.mean()))
    if chance >= 1.0:
        return math.nan
    return (observed - chance) / (1.0 - chance)


def decision_agreement(a: Any, b: Any) -> dict[str, Any]:
    """How two verifiers' accept/reject decisions on the same pairs relate."""
    x, y = _binary_labels(a), _binary_labels(b)
    kappa = cohen_kappa(x, y)
    return clean_json({"n": x.size, "agreement": (x == y).mean(), "cohen_kappa": kappa,
                  "both_accept": int((x & y).sum()), "both_reject": int((~x & ~y).sum()),
                  "only_first": int((x & ~y).sum()), "only_second": int((~x & y).sum())})


def agreement_on_common(decisions: dict[str, tuple[Any, Any]]) -> list[dict[str, Any]]:
    """Pairwise agreement of named verifiers (e.g. label, embedding, judge) that may have scored different
    subsets of the pairs: decisions[name] = (pair indices, accept decisions); each two are compared on
    the pairs both scored (none in common: no row)."""
    names = list(decisions)
    rows = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            (ia, da), (ib, db) = decisions[a], decisions[b]
            common, pa, pb = np.intersect1d(np.asarray(ia), np.asarray(ib), return_indices=True)
            if common.size == 0:
                continue
            rows.append({"first": a, "second": b,
                         **decision_agreement(np.asarray(da)[pa], np.asarray(db)[pb])})
    return rows


# ----------------------------------------------------------------------------- layer sweep
def sweep_rows(available: Sequence[int], max_layers: int) -> list[int]:
    """At most `max_layers` hidden-state rows, evenly spread over `available`, always keeping both ends."""
    rows = sorted(set(int(r) for r in available))
    if not rows:
        raise ValueError("no hidden-state rows available for a layer sweep")
    if max_layers < 1:
        raise ValueError(f"max_layers must be >= 1, got {max_layers}")
    if len(rows) <= max_layers:
        return rows
    if max_layers == 1:
        return [rows[-1]]
    picks = np.linspace(0, len(rows) - 1, max_layers).round().astype(int)
    return [rows[i] for i in sorted(set(picks.tolist()))]


def sweep_entry(row: int, num_layers: int, pred: Any, label: Any, epochs_run: int) -> dict[str, Any]:
    """One point of the sweep: the row, its relative depth (0 = embeddings, 1 = last layer), val errors."""
    if not 0 <= row <= num_layers:
        raise ValueError(f"row {row} is outside 0..{num_layers}")
    return clean_json({"layer": int(row), "depth": row / num_layers, "val_brier": brier(pred, label),
                  "val_mae": mae(pred, label), "val_spearman": spearman(pred, label), "epochs_run": epochs_run})


def best_layer(entries: Sequence[dict[str, Any]], key: str = "val_brier") -> dict[str, Any] | None:
    """The sweep entry with the lowest `key` (ties: the shallower layer)."""
    finite = [e for e in entries if e.get(key) is not None]
    return min(finite, key=lambda e: (e[key], e["layer"])) if finite else None


# ----------------------------------------------------------------------------- UMAP helpers
def probability_bins(values: Any, width: float = 0.1) -> np.ndarray:
    """Bin index of each probability in width-wide bins [0, w), [w, 2w), ..., the last one closed at 1."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    if ((v < 0) | (v > 1) | ~np.isfinite(v)).any():
        raise ValueError("probabilities must lie in [0, 1]")
    n_bins = int(round(1.0 / width))
    return np.minimum((v / width + 1e-9).astype(int), n_bins - 1)


def subsample(n: int, max_points: int, seed: int = 0) -> np.ndarray:
    """Sorted indices of at most `max_points` of n rows, drawn without replacement (all when n fits)."""
    if n <= max_points:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=max_points, replace=False))


def umap_neighbors(n: int, requested: int = 15) -> int:
    """n_neighbors for UMAP on n points: the request, capped at n - 1 and at least 2."""
    if n < 3:
        raise ValueError(f"a UMAP view needs at least 3 points, got {n}")
    return max(2, min(requested, n - 1))


# ----------------------------------------------------------------------------- comparison
def interval(block: dict[str, Any], name: str) -> tuple[float, float] | None:
    """(low, high) of metric `name`'s interval in a calibration/acceptance block (None when absent or withheld)."""
    entry = block.get("metrics", {}).get(name)
    if entry is None or entry.get("low") is None or entry.get("high") is None:
        return None
    return entry["low"], entry["high"]


def compare_metrics(a: dict[str, float | None], b: dict[str, float | None],
                    a_ci: dict[str, tuple[float, float] | None] | None = None,
                    b_ci: dict[str, tuple[float, float] | None] | None = None) -> list[dict[str, Any]]:
    """Rows {metric, a, b, delta (b - a), better} over the keys both have.

    `better` is "a" or "b" for a metric with a known direction (the last path component decides) only where the
    two reports' intervals (a_ci, b_ci) do not overlap, else None: a gap inside the bootstrap noise names no
    winner (a conservative test; no interval, no verdict).
    """
    rows = []
    a_ci, b_ci = a_ci or {}, b_ci or {}
    for key in [k for k in a if k in b]:
        va, vb = a[key], b[key]
        delta = None if va is None or vb is None else vb - va
        better = None
        name = key.rsplit("/", 1)[-1]
        ia, ib = a_ci.get(key), b_ci.get(key)
        apart = ia is not None and ib is not None and (ia[1] < ib[0] or ib[1] < ia[0])
        if delta is not None and delta != 0 and apart and name in LOWER_IS_BETTER | HIGHER_IS_BETTER:
            better = "a" if (delta > 0) == (name in LOWER_IS_BETTER) else "b"
        rows.append({"metric": key, "a": va, "b": vb, "delta": delta, "better": better})
    return rows
