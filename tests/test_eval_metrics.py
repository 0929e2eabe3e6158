"""probe-eval arithmetic (train.report.evaluate): the parts not already covered by tests/test_metrics.py —
acceptance-ratio metrics, per-question bootstrap bookkeeping, verifier curves and agreement, layer-sweep
bookkeeping, UMAP helpers, report comparison. Checked against sklearn and hand-computed cases."""
from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest
import torch
from sklearn.metrics import cohen_kappa_score, precision_recall_curve, roc_auc_score, roc_curve

from specprobe.probes.acceptance import semantic_accept_prob
from specprobe.probes.io import clean_json
from specprobe.probes.metrics import brier, ece, mae, wilson_interval
from specprobe.train.report import evaluate as ev
from specprobe.train.report import render


# ----------------------------------------------------------------------------- acceptance ratio
def test_empirical_ratio_by_hand():
    put = np.array([0.0, 0.2, 0.5, 0.9, 0.4, 0.0])
    own = np.array([0.5, 0.4, 0.25, 0.9, 0.0, 0.0])
    # a draft meaning no other draft sample shared (own_prob 0): 1 where the target said it, else 0
    np.testing.assert_allclose(ev.empirical_ratio(put, own), [0.0, 0.5, 1.0, 1.0, 1.0, 0.0])


@pytest.mark.parametrize("own, match", [([0.1, 0.5, 0.2], "differ in length"), ([np.nan, 0.5], "NaN"),
                                        ([1.5, 0.5], "probabilities")])
def test_empirical_ratio_rejects_broken_labels(own, match):
    with pytest.raises(ValueError, match=match):
        ev.empirical_ratio([0.1, 0.2], own)


def test_acceptance_block_exact_probes_have_zero_error():
    rng = np.random.default_rng(0)
    sp = rng.integers(1, 11, size=60) / 10
    put = rng.integers(0, 11, size=60) / 10
    groups = np.repeat(np.arange(12), 5)
    block = ev.acceptance_block(put, sp, put, sp, groups, n_boot=50)  # p, q = the empirical labels themselves
    m = block["metrics"]
    assert m["mae"]["estimate"] == pytest.approx(0.0)
    assert m["rmse"]["estimate"] == pytest.approx(0.0)
    assert m["bias"]["estimate"] == pytest.approx(0.0)
    assert m["spearman"]["estimate"] == pytest.approx(1.0)
    assert m["mean_predicted"]["estimate"] == pytest.approx(m["mean_empirical"]["estimate"])
    assert block["n"] == 60 and block["n_questions"] == 12


def test_acceptance_block_values_by_hand():
    p = np.array([0.2, 0.9, 0.3])
    q = np.array([0.4, 0.3, 0.6])
    put = np.array([0.1, 0.5, 0.6])
    sp = np.array([0.5, 0.5, 0.3])
    predicted = np.array([0.5, 1.0, 0.5])  # min(1, p/q)
    empirical = np.array([0.2, 1.0, 1.0])  # min(1, put/sp)
    np.testing.assert_allclose(semantic_accept_prob(p, q), predicted)
    m = ev.acceptance_block(p, q, put, sp, ["a", "b", "c"], n_boot=20)["metrics"]
    assert m["mae"]["estimate"] == pytest.approx(np.mean(np.abs(predicted - empirical)))
    assert m["rmse"]["estimate"] == pytest.approx(math.sqrt(np.mean((predicted - empirical) ** 2)))
    assert m["bias"]["estimate"] == pytest.approx(predicted.mean() - empirical.mean())
    assert m["mean_predicted"]["estimate"] == pytest.approx(2 / 3)
    assert m["mean_empirical"]["estimate"] == pytest.approx(2.2 / 3)


def test_acceptance_block_reports_saturation():
    block = ev.acceptance_block([0.9, 0.1], [0.3, 0.5], [0.5, 0.5], [0.5, 1.0], ["a", "b"], n_boot=5)
    assert block["saturated_predicted"] == pytest.approx(0.5)  # min(1, 3) and 0.2
    assert block["saturated_empirical"] == pytest.approx(0.5)  # 1.0 and 0.5


# ----------------------------------------------------------------------------- bootstrap by question
def test_bootstrap_resamples_whole_questions():
    """Copying every question's row k times changes nothing when questions are resampled (the draws are the
    same), but narrows a row-level bootstrap: the per-question interval does not overstate the evidence."""
    rng = np.random.default_rng(1)
    n_q, k = 15, 6
    pred, label = rng.random(n_q), rng.random(n_q)
    fns = {"mae": mae, "brier": brier}
    single = ev.metrics_with_ci(fns, pred, label, np.arange(n_q), n_boot=300, seed=3)
    copies = ev.metrics_with_ci(fns, np.repeat(pred, k), np.repeat(label, k), np.repeat(np.arange(n_q), k),
                                n_boot=300, seed=3)
    rows = ev.metrics_with_ci(fns, np.repeat(pred, k), np.repeat(label, k), np.arange(n_q * k), n_boot=300, seed=3)
    for name in fns:
        assert copies[name]["low"] == pytest.approx(single[name]["low"])
        assert copies[name]["high"] == pytest.approx(single[name]["high"])
        assert rows[name]["high"] - rows[name]["low"] < 0.7 * (copies[name]["high"] - copies[name]["low"])


def test_bootstrap_resamples_whole_families_when_given_them():
    """Questions of one family (template) that rise and fall together: resampled by family, k questions per family
    count as one draw (the interval of the families alone); resampled by question, they narrow it."""
    rng = np.random.default_rng(4)
    n_f, k = 12, 5
    pred, label = rng.random(n_f), rng.random(n_f)
    fam_p, fam_y = np.repeat(pred, k), np.repeat(label, k)
    questions = np.asarray([f"q{i}" for i in range(n_f * k)], dtype=object)
    units = {q: f"template-{i // k:02d}" for i, q in enumerate(questions)}  # (sorted as the families)
    fns = {"mae": mae}
    families = ev.metrics_with_ci(fns, pred, label, np.arange(n_f), n_boot=300, seed=3)
    by_family = ev.metrics_with_ci(fns, fam_p, fam_y, questions, n_boot=300, seed=3, units=units)
    by_question = ev.metrics_with_ci(fns, fam_p, fam_y, questions, n_boot=300, seed=3)
    assert by_family["mae"]["low"] == pytest.approx(families["mae"]["low"])
    assert by_family["mae"]["high"] == pytest.approx(families["mae"]["high"])
    width = by_family["mae"]["high"] - by_family["mae"]["low"]
    assert by_question["mae"]["high"] - by_question["mae"]["low"] < 0.7 * width
    # the paired comparison and the blocks take the same units; the block still counts questions
    ref = np.full(fam_p.size, 0.5)
    paired_f = ev.paired_comparison(fam_p, ref, fam_y, questions, n_boot=300, seed=3, units=units)
    paired_q = ev.paired_comparison(fam_p, ref, fam_y, questions, n_boot=300, seed=3)
    delta_f, delta_q = paired_f["brier_delta"], paired_q["brier_delta"]
    assert delta_q["high"] - delta_q["low"] < 0.7 * (delta_f["high"] - delta_f["low"])
    block = ev.calibration_block(fam_p, fam_y, questions, n_boot=50, units=units)
    assert block["n_questions"] == n_f * k and block["too_small"] is None
    # fewer families than MIN_FAMILIES: intervals withheld however many questions they hold
    few = {q: f"template-{i % (ev.MIN_FAMILIES - 1)}" for i, q in enumerate(questions)}
    block = ev.calibration_block(fam_p, fam_y, questions, n_boot=50, units=few)
    assert f"{ev.MIN_FAMILIES - 1} question families" in block["too_small"]
    assert block["metrics"]["brier"]["low"] is None


def test_calibration_block_matches_direct_metrics():
    rng = np.random.default_rng(2)
    pred = rng.random(200)
    label = np.clip(pred + rng.normal(scale=0.2, size=200), 0, 1)
    groups = rng.integers(0, 25, size=200).astype(str)
    block = ev.calibration_block(pred, label, groups, n_bins=8, n_boot=40)
    m = block["metrics"]
    assert set(m) == set(ev.CALIBRATION_METRICS)
    assert m["ece_uniform"]["estimate"] == pytest.approx(ece(pred, label, 8, "uniform"))
    assert m["ece_quantile"]["estimate"] == pytest.approx(ece(pred, label, 8, "quantile"))
    assert m["auroc"]["estimate"] == pytest.approx(roc_auc_score(label >= 0.5, pred))
    for entry in m.values():
        assert entry["low"] <= entry["high"] and entry["n_boot"] == 40 and entry["alpha"] == 0.10
    assert block["too_small"] is None  # 25 questions, ~100 positives
    assert block["n_questions"] == len(set(groups))
    assert sum(block["reliability_uniform"]["count"]) == 200
    assert block["positive_rate"] == pytest.approx(np.mean(label >= 0.5))


def test_size_guard_withholds_intervals_below_20_questions_or_10_positives():
    assert ev.size_guard(20, 10) is None
    assert "19 held-out question(s) < 20" in ev.size_guard(19, 50)
    assert "9 positive(s) < 10" in ev.size_guard(40, 9)
    rng = np.random.default_rng(5)
    pred = rng.random(120)
    few_questions = ev.calibration_block(pred, pred, np.repeat(np.arange(12), 10).astype(str), n_boot=20)
    assert few_questions["too_small"] and all(e["low"] is None and e["high"] is None and e["withheld"]
                                              for e in few_questions["metrics"].values())
    few_positives = ev.calibration_block(pred, np.r_[np.ones(5), np.zeros(115)], np.arange(120).astype(str), n_boot=20)
    assert "5 positive(s) < 10" in few_positives["too_small"]
    enough = ev.calibration_block(pred, pred, np.arange(120).astype(str), n_boot=20, num_samples=10)
    assert enough["too_small"] is None and enough["metrics"]["brier"]["low"] is not None
    assert enough["noise_floor_brier"] == pytest.approx(np.mean(pred * (1 - pred)) / 9)
    labels = np.r_[np.ones(30, bool), np.zeros(30, bool)]
    small_pairs = ev.verifier_block(rng.random(60), labels, np.repeat(np.arange(6), 10), 0.5, n_boot=20)
    assert small_pairs["too_small"] and small_pairs["metrics"]["auroc"]["low"] is None


def test_a_ranking_on_a_class_from_a_few_questions_gets_no_interval():
    """30 questions of 10 rows, one class only in 3 rows of one question: AUROC's resamples either lack that class
    (undefined) or hold that one question, so an interval from them looks precise and is not; it is withheld, with
    the reason, while the soft-label metrics keep theirs. The same holds for a verifier with few pairs of a kind."""
    rng = np.random.default_rng(0)
    groups = np.repeat(np.arange(30), 10).astype(str)
    label = np.full(300, 0.9)
    label[:3] = 0.1
    block = ev.calibration_block(rng.random(300), label, groups, n_boot=300)
    assert block["too_small"] is None and block["questions_by_class"] == {"positive": 30, "negative": 1}
    for name in ("auroc", "auprc"):
        entry = block["metrics"][name]
        assert entry["estimate"] is not None and entry["low"] is None and entry["high"] is None
        assert "negative labels in 1 question(s) < 5" in entry["withheld"]
    assert block["metrics"]["brier"]["low"] is not None
    # apart from the class count, a metric defined on too few resamples has no interval either
    undefined = ev.metrics_with_ci({"auroc": lambda p, y: ev.auroc(p, y, 0.5)}, rng.random(300), label, groups,
                                   n_boot=300)["auroc"]
    assert undefined["n_valid"] < 0.9 * 300 and undefined["low"] is None and "of 300 resamples" in undefined["withheld"]
    # the rare class in 6 questions: enough drawing questions; drawn as families, those 6 are 2 templates' draws
    label[:60:10] = 0.1
    by_question = ev.calibration_block(rng.random(300), label, groups, n_boot=300)
    assert by_question["metrics"]["auroc"]["low"] is not None and "families_by_class" not in by_question
    units = {str(q): f"t{q % 2}" if q < 6 else f"t{q}" for q in range(30)}
    by_family = ev.calibration_block(rng.random(300), label, groups, n_boot=300, units=units)
    assert by_family["families_by_class"] == {"positive": 26, "negative": 2}
    assert "negative labels in 2 famil(ies) < 5" in by_family["metrics"]["auroc"]["withheld"]
    pairs = np.r_[np.ones(200, bool), np.zeros(20, bool)]
    few_others = ev.verifier_block(rng.random(220), pairs, np.arange(220) // 5, 0.5, n_boot=20)
    assert "200 equivalent and 20 other pairs" in few_others["ranking_not_evaluable"]


def test_paired_comparison_says_whether_the_probe_beats_the_baseline():
    rng = np.random.default_rng(8)
    groups = np.repeat(np.arange(40), 5).astype(str)
    label = rng.random(200)
    good = np.clip(label + rng.normal(scale=0.05, size=200), 0, 1)
    constant = np.full(200, label.mean())
    better = ev.paired_comparison(good, constant, label, groups, n_boot=200)
    assert better["verdict"] == "better" and better["brier_delta"]["high"] < 0
    assert better["brier_skill"]["estimate"] == pytest.approx(1 - brier(good, label) / brier(constant, label))
    assert ev.paired_comparison(constant, good, label, groups, n_boot=200)["verdict"] == "worse"
    same = ev.paired_comparison(constant + 1e-4, constant, label, groups, n_boot=200)
    assert same["verdict"] == "no clear difference"
    tiny = ev.paired_comparison(good[:50], constant[:50], label[:50], groups[:50], n_boot=50)
    assert tiny["verdict"] == "too small to tell" and tiny["brier_delta"]["low"] is None


def test_calibration_block_rejects_misaligned_inputs():
    with pytest.raises(ValueError, match="differ in length"):
        ev.calibration_block([0.1, 0.2], [0.1, 0.2], ["q1"], n_boot=5)


# ----------------------------------------------------------------------------- pair verifiers
def random_pairs(seed: int, n: int = 300):
    rng = np.random.default_rng(seed)
    labels = rng.random(n) < 0.4
    scores = np.round(rng.normal(loc=labels * 0.8, scale=0.6), 2)  # ties on purpose
    return scores, labels


@pytest.mark.parametrize("seed", range(3))
def test_roc_points_match_sklearn(seed):
    scores, labels = random_pairs(seed)
    ours = ev.roc_points(scores, labels)
    fpr, tpr, thr = roc_curve(labels, scores, drop_intermediate=False)
    np.testing.assert_allclose(ours["fpr"], fpr)
    np.testing.assert_allclose(ours["tpr"], tpr)
    np.testing.assert_allclose(ours["threshold"][1:], thr[1:])
    assert math.isinf(ours["threshold"][0])


def test_pr_points_match_sklearn():
    scores, labels = random_pairs(5)
    ours = ev.pr_points(scores, labels)
    precision, recall, thr = precision_recall_curve(labels, scores, drop_intermediate=False)
    # sklearn: increasing thresholds plus a final (precision 1, recall 0) point; ours: decreasing, no extra point
    np.testing.assert_allclose(ours["threshold"][::-1], thr)
    np.testing.assert_allclose(ours["precision"][::-1], precision[:-1])
    np.testing.assert_allclose(ours["recall"][::-1], recall[:-1])


def test_roc_needs_both_classes():
    with pytest.raises(ValueError, match="both classes"):
        ev.roc_points([0.1, 0.9], [True, True])


def test_at_threshold_by_hand():
    scores = [0.9, 0.8, 0.7, 0.4, 0.2]
    labels = [1, 0, 1, 1, 0]
    at = ev.at_threshold(scores, labels, 0.7)
    assert at["accepted"] == 3
    assert at["acceptance_rate"] == pytest.approx(0.6)
    assert at["precision"] == pytest.approx(2 / 3)
    assert at["recall"] == pytest.approx(2 / 3)
    assert at["false_accept_rate"] == pytest.approx(0.5)
    nothing = ev.at_threshold(scores, labels, 0.95)
    assert nothing["precision"] is None and nothing["acceptance_rate"] == 0.0


def test_verifier_block_operating_point_and_auc():
    scores, labels = random_pairs(7)
    groups = np.arange(len(scores)) // 10
    block = ev.verifier_block(scores, labels, groups, threshold=0.4, n_boot=30)
    assert block["metrics"]["auroc"]["estimate"] == pytest.approx(roc_auc_score(labels, scores))
    accept = scores >= 0.4
    assert block["metrics"]["acceptance_rate"]["estimate"] == pytest.approx(accept.mean())
    assert block["metrics"]["precision"]["estimate"] == pytest.approx(labels[accept].mean())
    assert block["at_threshold"]["precision"] == pytest.approx(labels[accept].mean())
    assert block["n_positive"] == labels.sum() and block["n_questions"] == 30
    assert block["roc"]["threshold"][0] is None  # +inf cleaned for JSON
    # a verifier that accepts nothing: its acceptance interval is Wilson's over the 30 questions, not [0, 0]
    none = ev.verifier_block(scores, labels, groups, threshold=scores.max() + 1, n_boot=30)["metrics"]["acceptance_rate"]
    assert (none["low"], none["high"], none["wilson_units"]) == (*wilson_interval(0, 30, NormalDist().inv_cdf(0.95)), 30)
    assert "Wilson over 30]" in render.ci(none)


@pytest.mark.parametrize("seed", range(4))
def test_cohen_kappa_matches_sklearn(seed):
    rng = np.random.default_rng(seed)
    a = rng.random(200) < 0.6
    b = np.where(rng.random(200) < 0.7, a, rng.random(200) < 0.5)
    assert ev.cohen_kappa(a, b) == pytest.approx(cohen_kappa_score(a, b))


def test_cohen_kappa_degenerate_and_perfect():
    assert ev.cohen_kappa([1, 0, 1], [1, 0, 1]) == pytest.approx(1.0)
    assert math.isnan(ev.cohen_kappa([1, 1, 1], [1, 1, 1]))  # chance agreement 1: undefined, as sklearn
    assert ev.cohen_kappa([1, 0, 1, 0], [0, 1, 0, 1]) == pytest.approx(-1.0)


def test_decision_agreement_counts():
    out = ev.decision_agreement([1, 1, 0, 0, 1], [1, 0, 0, 1, 1])
    assert (out["both_accept"], out["both_reject"], out["only_first"], out["only_second"]) == (2, 1, 1, 1)
    assert out["agreement"] == pytest.approx(0.6)
    assert out["n"] == 5


def test_agreement_on_common_uses_the_shared_pairs_only():
    label = (np.arange(6), np.array([1, 0, 1, 0, 1, 0], bool))
    emb = (np.arange(6), np.array([1, 0, 1, 1, 1, 0], bool))
    judge = (np.array([4, 0, 5]), np.array([1, 1, 1], bool))  # scored pairs 4, 0, 5 (any order)
    rows = {(r["first"], r["second"]): r for r in ev.agreement_on_common({"label": label, "embedding": emb,
                                                                            "judge": judge})}
    assert rows[("label", "embedding")]["n"] == 6 and rows[("label", "embedding")]["agreement"] == pytest.approx(5 / 6)
    # judge vs label on pairs 0, 4, 5: labels 1, 1, 0 against 1, 1, 1
    assert rows[("label", "judge")]["n"] == 3 and rows[("label", "judge")]["agreement"] == pytest.approx(2 / 3)
    assert rows[("embedding", "judge")]["both_accept"] == 2


# ----------------------------------------------------------------------------- layer sweep bookkeeping
def test_sweep_rows_spread_and_keep_ends():
    assert ev.sweep_rows([3, 1, 2], 10) == [1, 2, 3]
    rows = ev.sweep_rows(range(31), 8)
    assert rows[0] == 0 and rows[-1] == 30 and len(rows) == 8 and rows == sorted(set(rows))
    assert ev.sweep_rows(range(31), 1) == [30]
    with pytest.raises(ValueError, match="no hidden-state rows"):
        ev.sweep_rows([], 4)


def test_sweep_entry_and_best_layer():
    y = np.array([0.1, 0.5, 0.9])
    entry = ev.sweep_entry(6, 24, y + 0.1, y, epochs_run=4)
    assert entry["depth"] == pytest.approx(0.25)
    assert entry["val_brier"] == pytest.approx(0.01) and entry["val_mae"] == pytest.approx(0.1)
    assert entry["layer"] == 6 and entry["epochs_run"] == 4
    with pytest.raises(ValueError, match="outside"):
        ev.sweep_entry(25, 24, y, y, 1)
    entries = [{"layer": 3, "val_brier": 0.2}, {"layer": 1, "val_brier": 0.1}, {"layer": 2, "val_brier": 0.1},
               {"layer": 0, "val_brier": None}]
    assert ev.best_layer(entries)["layer"] == 1
    assert ev.best_layer([{"layer": 0, "val_brier": None}]) is None


# ----------------------------------------------------------------------------- UMAP helpers
def test_probability_bins_edges():
    values = [0.0, 0.0999, 0.1, 0.3, 0.7, 0.95, 1.0]
    assert ev.probability_bins(values).tolist() == [0, 0, 1, 3, 7, 9, 9]
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        ev.probability_bins([1.2])


def test_subsample_and_neighbors():
    assert ev.subsample(5, 10).tolist() == [0, 1, 2, 3, 4]
    idx = ev.subsample(100, 10, seed=1)
    assert len(idx) == 10 and len(set(idx.tolist())) == 10 and idx.tolist() == sorted(idx.tolist())
    assert ev.subsample(100, 10, seed=1).tolist() == idx.tolist()
    assert ev.umap_neighbors(1000, 15) == 15
    assert ev.umap_neighbors(6, 15) == 5
    with pytest.raises(ValueError, match="at least 3"):
        ev.umap_neighbors(2)


def test_precision_over_accept_all_verdicts():
    rng = np.random.default_rng(0)
    labels = rng.random(200) < 0.3
    groups = np.repeat(np.arange(40), 5)
    good = np.where(labels, 0.9, 0.1) + rng.normal(scale=0.05, size=200)  # accepts the equivalent pairs
    v = ev.precision_over_accept_all(good, labels, groups, 0.5, n_boot=200)
    assert v["verdict"] == "better" and v["precision_minus_positive_rate"]["low"] > 0
    assert v["precision_minus_positive_rate"]["estimate"] == pytest.approx(1.0 - labels.mean(), abs=0.02)
    v = ev.precision_over_accept_all(1.0 - good, labels, groups, 0.5, n_boot=200)  # accepts the others
    assert v["verdict"] == "worse" and v["precision_minus_positive_rate"]["high"] < 0
    v = ev.precision_over_accept_all(rng.random(200), labels, groups, 0.5, n_boot=200)  # blind
    assert v["verdict"] == "no clear difference"
    assert ev.precision_over_accept_all(good[:10], labels[:10], groups[:10], 0.5, n_boot=20)["verdict"] == \
        "too small to tell"


# ----------------------------------------------------------------------------- comparison, JSON
def test_compare_metrics_direction():
    a = {"p/ece_uniform": 0.10, "p/auroc": 0.80, "p/mean_pred": 0.4, "only_a": 1.0, "p/brier": None}
    b = {"p/ece_uniform": 0.05, "p/auroc": 0.70, "p/mean_pred": 0.5, "p/brier": 0.2}
    a_ci = {"p/ece_uniform": (0.08, 0.12), "p/auroc": (0.75, 0.85), "p/mean_pred": (0.3, 0.45)}
    b_ci = {"p/ece_uniform": (0.03, 0.07), "p/auroc": (0.65, 0.76), "p/mean_pred": (0.46, 0.6)}
    rows = {r["metric"]: r for r in ev.compare_metrics(a, b, a_ci, b_ci)}
    assert set(rows) == {"p/ece_uniform", "p/auroc", "p/mean_pred", "p/brier"}
    assert rows["p/ece_uniform"]["delta"] == pytest.approx(-0.05) and rows["p/ece_uniform"]["better"] == "b"
    assert rows["p/auroc"]["better"] is None  # 0.80 vs 0.70, but the intervals overlap (0.75..0.76)
    assert rows["p/mean_pred"]["better"] is None  # no direction
    assert rows["p/brier"]["delta"] is None
    b_ci["p/auroc"] = (0.65, 0.74)
    rows = {r["metric"]: r for r in ev.compare_metrics(a, b, a_ci, b_ci)}
    assert rows["p/auroc"]["better"] == "a"
    # no intervals (withheld, or a figure without one): the deltas stay, no side is named
    assert all(r["better"] is None for r in ev.compare_metrics(a, b))
    assert ev.interval({"metrics": {"auroc": {"estimate": 0.8, "low": None, "high": None}}}, "auroc") is None
    assert ev.interval({"metrics": {"auroc": {"estimate": 0.8, "low": 0.7, "high": 0.9}}}, "auroc") == (0.7, 0.9)


def test_clean_makes_json_safe():
    out = clean_json({"a": np.float32(1.5), "b": [np.nan, np.inf, np.int64(3)], "c": np.array([True, False]),
                      4: {"d": np.bool_(True)}, "e": (torch.tensor([0.5, float("nan")]), torch.tensor(2))})
    assert out == {"a": 1.5, "b": [None, None, 3], "c": [True, False], "4": {"d": True}, "e": [[0.5, None], 2]}
    assert type(out["b"][2]) is int and type(out["4"]["d"]) is bool
