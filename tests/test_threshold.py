"""fit_threshold: precision-first operating point for pair verifiers, plus the F1 optimum."""
from __future__ import annotations

import json

import numpy as np
import pytest
from sklearn.metrics import f1_score, precision_score, recall_score

from specprobe.probes.threshold import ThresholdFit, fit_threshold, operating_points


def synthetic_scores(n: int = 3000, seed: int = 0):
    rng = np.random.default_rng(seed)
    labels = rng.random(n) < 0.5
    scores = np.where(labels, rng.normal(1.0, 1.0, n), rng.normal(-1.0, 1.0, n))
    return scores, labels


def brute_force(scores, labels, target):
    """Every distinct score as threshold, counted directly."""
    best = None
    for t in np.unique(scores):
        accepted = scores >= t
        prec = (accepted & labels).sum() / accepted.sum()
        rec = (accepted & labels).sum() / labels.sum()
        if prec >= target and (best is None or rec > best[1] or (rec == best[1] and t > best[0])):
            best = (t, rec, prec)
    return best


@pytest.mark.parametrize("target", [0.8, 0.9, 0.95])
def test_meets_target_with_highest_recall(target):
    scores, labels = synthetic_scores(n=400)
    fit = fit_threshold(scores, labels, target_precision=target)
    assert fit.met_target
    accepted = fit.accept(scores)
    assert precision_score(labels, accepted) >= target
    assert fit.chosen.precision == pytest.approx(precision_score(labels, accepted))
    assert fit.chosen.recall == pytest.approx(recall_score(labels, accepted))
    assert fit.chosen.acceptance_rate == pytest.approx(accepted.mean())
    t, rec, _ = brute_force(scores, labels, target)
    assert fit.threshold == t and fit.chosen.recall == pytest.approx(rec)


def test_held_out_precision_close_to_target():
    scores, labels = synthetic_scores(seed=1)
    fit = fit_threshold(scores, labels, 0.9)
    test_scores, test_labels = synthetic_scores(seed=2)
    assert precision_score(test_labels, fit.accept(test_scores)) > 0.87


def test_f1_optimal_matches_brute_force():
    scores, labels = synthetic_scores(n=600, seed=3)
    fit = fit_threshold(scores, labels)
    def f1_at(t):
        accepted = scores >= t
        tp = (accepted & labels).sum()
        return 2 * tp / (accepted.sum() + labels.sum())
    best_f1 = max(f1_at(t) for t in np.unique(scores))
    assert fit.f1_optimal.f1 == pytest.approx(best_f1)
    assert f1_score(labels, scores >= fit.f1_optimal.threshold) == pytest.approx(best_f1)
    assert fit.f1_optimal.recall >= fit.chosen.recall  # precision-first trades recall away


def test_unreachable_target_flags_and_picks_best_precision():
    # the top score is a negative, so precision never reaches 1.0
    scores = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    labels = np.array([0, 1, 1, 0, 1, 0])
    fit = fit_threshold(scores, labels, target_precision=1.0)
    assert not fit.met_target
    assert fit.chosen.precision == pytest.approx(2 / 3) and fit.threshold == 0.7
    fit2 = fit_threshold(scores, labels, target_precision=0.6)
    assert fit2.met_target and fit2.threshold == 0.5 and fit2.chosen.recall == 1.0


def test_ties_are_one_operating_point():
    scores = np.array([0.5, 0.5, 0.5, 0.1])
    labels = np.array([1, 0, 1, 0])
    points = operating_points(scores, labels)
    assert points["threshold"].tolist() == [0.5, 0.1]
    assert points["precision"].tolist() == pytest.approx([2 / 3, 0.5])


def test_json_round_trip():
    scores, labels = synthetic_scores(n=200)
    fit = fit_threshold(scores, labels, 0.9)
    text = json.dumps(fit.to_dict(), allow_nan=False)
    assert ThresholdFit.from_dict(json.loads(text)) == fit


def test_input_errors():
    with pytest.raises(ValueError, match="no positive"):
        fit_threshold([0.1, 0.2], [0, 0])
    with pytest.raises(ValueError, match="binary"):
        fit_threshold([0.1, 0.2], [0.3, 1])
    with pytest.raises(ValueError, match="same length"):
        fit_threshold([0.1, 0.2], [1])
    with pytest.raises(ValueError, match="NaN"):
        fit_threshold([0.1, float("nan")], [1, 0])
    with pytest.raises(ValueError, match="target_precision"):
        fit_threshold([0.1, 0.2], [1, 0], target_precision=1.5)


def test_decisions_at_a_threshold():
    from specprobe.probes.threshold import decisions_at

    scores, labels = [0.9, 0.8, 0.3, 0.1, 0.6], [1, 0, 1, 0, 1]
    d = decisions_at(scores, labels, 0.5)  # accepts 0.9 (eq), 0.8 (not), 0.6 (eq)
    assert (d["accepted"], d["n"], d["n_positive"]) == (3, 5, 3)
    assert d["acceptance_rate"] == pytest.approx(3 / 5) and d["precision"] == pytest.approx(2 / 3)
    assert d["recall"] == pytest.approx(2 / 3) and d["false_accept_rate"] == pytest.approx(1 / 2)
    assert d["f1"] == pytest.approx(2 / 3)
    none = decisions_at(scores, labels, 1.0)  # nothing accepted: precision undefined, recall 0
    assert none["precision"] is None and none["recall"] == 0 and none["f1"] is None and none["acceptance_rate"] == 0
    wrong = decisions_at(scores, labels, 0.7)  # accepts 0.9 (eq) and 0.8 (not)
    assert wrong["precision"] == pytest.approx(1 / 2) and wrong["recall"] == pytest.approx(1 / 3)
    only_bad = decisions_at([0.9, 0.1], [0, 1], 0.5)  # accepts only the non-equivalent pair: F1 0, not undefined
    assert only_bad["f1"] == 0.0 and only_bad["precision"] == 0.0
    negatives = decisions_at([0.9], [0], 0.5)
    assert negatives["recall"] is None and negatives["false_accept_rate"] == 1.0
