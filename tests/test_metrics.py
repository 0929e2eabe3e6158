"""probes.metrics against sklearn / torchmetrics on random data, plus hand-computed cases."""
from __future__ import annotations

import json
import math
from statistics import NormalDist

import numpy as np
import pytest
import torch
from sklearn.calibration import calibration_curve
from sklearn.metrics import average_precision_score, brier_score_loss, roc_auc_score
from torchmetrics.classification import BinaryCalibrationError

from specprobe.probes.metrics import (
    auprc,
    auroc,
    bootstrap_ci,
    brier,
    ece,
    mae,
    mce,
    probe_report,
    reliability_bins,
    spearman,
    wilson_interval,
)


def random_binary(seed: int, n: int = 800):
    rng = np.random.default_rng(seed)
    pred = rng.random(n)
    label = (rng.random(n) < pred ** 1.5).astype(np.float64)  # miscalibrated on purpose
    return pred, label


@pytest.mark.parametrize("seed", range(4))
def test_ranking_and_brier_match_sklearn(seed):
    pred, label = random_binary(seed)
    assert auroc(pred, label) == pytest.approx(roc_auc_score(label, pred), abs=1e-6)
    assert auprc(pred, label) == pytest.approx(average_precision_score(label, pred), abs=1e-6)
    assert brier(pred, label) == pytest.approx(brier_score_loss(label, pred), abs=1e-6)


def test_ranking_with_ties_matches_sklearn():
    pred, label = random_binary(7)
    pred = np.round(pred, 1)  # heavy ties
    assert auroc(pred, label) == pytest.approx(roc_auc_score(label, pred), abs=1e-6)
    assert auprc(pred, label) == pytest.approx(average_precision_score(label, pred), abs=1e-6)


def test_soft_labels_binarised_at_threshold():
    rng = np.random.default_rng(3)
    pred, soft = rng.random(500), rng.random(500)
    assert auroc(pred, soft, threshold=0.3) == pytest.approx(roc_auc_score(soft >= 0.3, pred), abs=1e-6)
    assert auprc(pred, soft) == pytest.approx(average_precision_score(soft >= 0.5, pred), abs=1e-6)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ece_and_mce_match_torchmetrics(seed, dtype):
    pred, label = random_binary(seed)
    pred = torch.tensor(pred, dtype=dtype).numpy().astype(np.float64)  # the same values on both sides
    for norm, ours in (("l1", ece), ("max", mce)):
        metric = BinaryCalibrationError(n_bins=15, norm=norm)
        theirs = metric(torch.tensor(pred, dtype=dtype), torch.tensor(label).long()).item()
        assert ours(pred, label, n_bins=15) == pytest.approx(theirs, abs=1e-6)


def test_bins_are_left_closed_like_torchmetrics():
    # 0.2 and 0.4 sit exactly on edges of 5 uniform bins: they open bins 1 and 2
    pred = np.array([0.1, 0.2, 0.2, 0.4, 0.9])
    label = np.array([0, 1, 1, 0, 1.0])
    bins = reliability_bins(pred, label, n_bins=5)
    assert bins.count.tolist() == [1, 2, 1, 0, 1]
    theirs = BinaryCalibrationError(n_bins=5, norm="l1")(torch.tensor(pred), torch.tensor(label).long()).item()
    assert ece(pred, label, n_bins=5) == pytest.approx(theirs, abs=1e-6)
    # a prediction of exactly 1.0 joins the last bin (torchmetrics gives it an extra bin of its own)
    assert reliability_bins([0.95, 1.0], [1, 1], n_bins=5).count.tolist() == [0, 0, 0, 0, 2]


@pytest.mark.parametrize("strategy", ["uniform", "quantile"])
def test_reliability_bins_match_sklearn_calibration_curve(strategy):
    pred, label = random_binary(11, n=1000)  # continuous predictions: no value sits on an edge
    prob_true, prob_pred = calibration_curve(label, pred, n_bins=10, strategy=strategy)
    bins = reliability_bins(pred, label, n_bins=10, strategy=strategy)
    filled = bins.count > 0
    assert filled.sum() == len(prob_true)
    np.testing.assert_allclose(bins.mean_label[filled], prob_true, atol=1e-9)
    np.testing.assert_allclose(bins.mean_pred[filled], prob_pred, atol=1e-9)
    assert bins.count.sum() == 1000
    if strategy == "quantile":  # equal mass
        assert bins.count.min() >= 99 and bins.count.max() <= 101


def test_ece_soft_label_regression_form_by_hand():
    # two uniform bins (n_bins=2): [0, .5) holds preds .1,.3 labels .2,.6; [.5, 1] holds .8 with label .5
    pred, label = np.array([0.1, 0.3, 0.8]), np.array([0.2, 0.6, 0.5])
    expected = (2 / 3) * abs(0.2 - 0.4) + (1 / 3) * abs(0.8 - 0.5)
    assert ece(pred, label, n_bins=2) == pytest.approx(expected)
    assert mce(pred, label, n_bins=2) == pytest.approx(0.3)


def test_perfect_calibration_gives_zero_ece():
    rng = np.random.default_rng(0)
    pred = rng.random(2000)
    assert ece(pred, pred) == pytest.approx(0.0, abs=1e-12)  # soft labels equal to the prediction
    levels = np.repeat([0.1, 0.5, 0.8], 10)  # binary: 1/10, 5/10, 8/10 positives per level
    label = np.concatenate([np.r_[np.ones(k), np.zeros(10 - k)] for k in (1, 5, 8)])
    assert ece(levels, label) == pytest.approx(0.0, abs=1e-12)
    assert ece(levels, label, strategy="quantile", n_bins=3) == pytest.approx(0.0, abs=1e-12)


def test_constant_predictor_auroc_half_and_degenerate_nan():
    label = np.array([0, 1, 0, 1, 1.0])
    assert auroc(np.full(5, 0.7), label) == pytest.approx(0.5)
    assert auprc(np.full(5, 0.7), label) == pytest.approx(0.6)  # = positive rate
    assert math.isnan(auroc([0.2, 0.9, 0.4], [1, 1, 1]))
    assert math.isnan(auprc([0.2, 0.9, 0.4], [0, 0, 0]))
    assert math.isnan(spearman([0.5, 0.5, 0.5], [0.1, 0.2, 0.3]))


def test_mae_spearman_brier_by_hand():
    pred, label = np.array([0.1, 0.4, 0.7]), np.array([0.2, 0.2, 1.0])
    assert mae(pred, label) == pytest.approx((0.1 + 0.2 + 0.3) / 3)
    assert brier(pred, label) == pytest.approx((0.01 + 0.04 + 0.09) / 3)
    assert spearman([1, 2, 3, 4], [10, 20, 30, 25]) == pytest.approx(0.8)


def test_input_errors():
    with pytest.raises(ValueError, match="same length"):
        mae([0.1, 0.2], [0.1])
    with pytest.raises(ValueError, match="empty"):
        brier([], [])
    with pytest.raises(ValueError, match="finite"):
        auroc([0.1, float("nan")], [0, 1])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        ece([1.5, 0.2], [1, 0])


def test_bootstrap_ci_rows_and_groups():
    pred, label = random_binary(5, n=400)
    ci = bootstrap_ci(auroc, pred, label, n_boot=200, seed=1)
    assert ci.low <= ci.estimate <= ci.high and ci.n_valid == 200
    assert ci.estimate == pytest.approx(roc_auc_score(label, pred))
    assert bootstrap_ci(auroc, pred, label, n_boot=200, seed=1) == ci  # seeded
    # groups of 40 identical rows: resampling rows pretends there are 400 independent points,
    # resampling groups sees only 10, so its interval must be much wider
    g = np.repeat(np.arange(10), 40)
    gp, gl = np.repeat(pred[:10], 40), np.repeat(label[:10], 40)
    by_rows = bootstrap_ci(mae, gp, gl, n_boot=300, seed=0)
    by_groups = bootstrap_ci(mae, gp, gl, n_boot=300, seed=0, groups=g)
    assert (by_groups.high - by_groups.low) > 3 * (by_rows.high - by_rows.low)


def test_a_share_with_one_value_in_every_unit_gets_wilsons_interval_over_the_units():
    """No resample of units that all accept the same share can differ: the percentile interval is a point. With
    share=True it is Wilson's over the units (the groups, else the rows), at the bootstrap's alpha."""
    rate = lambda a: float(np.mean(a))  # noqa: E731
    nothing = np.zeros(40)
    point = bootstrap_ci(rate, nothing, n_boot=50, alpha=0.05)
    assert (point.low, point.high) == (0.0, 0.0)  # a point, as if known exactly
    rows = bootstrap_ci(rate, nothing, n_boot=50, alpha=0.05, share=True)
    assert (rows.low, rows.high, rows.wilson_units) == (*wilson_interval(0, 40), 40)
    half = np.tile([0.0, 1.0], 20)  # each of 10 groups of 4 rows accepts half
    groups = np.repeat(np.arange(10), 4)
    by_groups = bootstrap_ci(rate, half, n_boot=50, alpha=0.10, groups=groups, share=True)
    assert (by_groups.low, by_groups.high) == wilson_interval(5, 10, NormalDist().inv_cdf(0.95))
    assert by_groups.to_dict()["wilson_units"] == 10 and by_groups.low < 0.5 < by_groups.high
    # a precision: groups that accept nothing have none and are not units; every other group's is 1
    accepted, right = np.tile([1.0, 1.0, 0.0, 0.0], 10), np.ones(40)
    accepted[20:] = 0
    precision = lambda a, r: float(r[a > 0].mean()) if (a > 0).any() else math.nan  # noqa: E731
    exact = bootstrap_ci(precision, accepted, right, n_boot=50, alpha=0.05, groups=groups, share=True)
    assert (exact.low, exact.high, exact.wilson_units) == (*wilson_interval(5, 5), 5)
    uneven = bootstrap_ci(rate, np.r_[half[:36], np.ones(4)], n_boot=50, groups=groups, share=True)
    assert uneven.wilson_units is None and "wilson_units" not in uneven.to_dict()  # rates differ: percentile


def test_bootstrap_ci_skips_degenerate_resamples():
    pred, label = np.array([0.1, 0.9, 0.2, 0.3]), np.array([0, 1, 0, 0.0])  # one positive
    ci = bootstrap_ci(auroc, pred, label, n_boot=200, seed=0)
    assert 0 < ci.n_valid < 200  # resamples missing the positive give NaN and are dropped
    assert json.dumps(ci.to_dict())


def test_probe_report_has_everything_and_is_json():
    pred, label = random_binary(2)
    report = probe_report(pred, label)
    for key in ("ece_uniform", "ece_quantile", "mce_uniform", "brier", "mae", "spearman", "auroc", "auprc",
                "reliability_uniform", "n", "positive_rate"):
        assert key in report
    assert report["auroc"] == pytest.approx(roc_auc_score(label, pred))
    json.dumps(report, allow_nan=False)
    one_class = probe_report([0.2, 0.4], [1, 1])
    assert one_class["auroc"] is None and one_class["spearman"] is None


# ---- evaluation rules (issue 13): exact edges, equal mass under ties, label range, new scores ----------
def test_values_on_decimal_edges_open_the_upper_bin():
    # with linspace edges 0.3, 0.6 and 0.7 fell into the bin below (0.30000000000000004 > 0.3)
    bins = reliability_bins([0.3, 0.6, 0.7], [1, 1, 1], n_bins=10)
    assert np.flatnonzero(bins.count).tolist() == [3, 6, 7]
    assert bins.edges[3] == 0.3 and bins.edges[6] == 0.6 and bins.edges[7] == 0.7


def test_equal_mass_bins_keep_tied_predictions_together():
    pred = np.r_[np.full(60, 0.5), np.linspace(0.6, 0.9, 40)]  # 60% of the rows share one value
    label = np.r_[np.zeros(30), np.ones(30), np.ones(40)]  # calibrated at 0.5, but sorted by row
    bins = reliability_bins(pred, label, n_bins=10, strategy="quantile")
    assert bins.count.tolist() == [60, 0, 0, 0, 0, 0, 10, 10, 10, 10]  # the tie is one bin, the rest equal
    assert bins.mean_pred[0] == 0.5 and bins.mean_label[0] == 0.5
    assert (np.diff(bins.edges) >= 0).all()
    uneven = reliability_bins(pred[60:97], label[60:97], n_bins=10, strategy="quantile")  # no ties: equal mass
    assert uneven.count.max() - uneven.count.min() <= 1 and uneven.count.sum() == 37


def test_a_constant_predictors_equal_mass_ece_is_its_bias_in_any_row_order():
    """All ties: the row order (by question) must not read as miscalibration, else the per-set constant
    baseline looks worse than it is beside a probe."""
    rng = np.random.default_rng(3)
    label = np.r_[np.zeros(50), np.ones(50)]  # rows grouped by question, as the data stage writes them
    for order in (np.arange(100), rng.permutation(100)):
        for strategy in ("uniform", "quantile"):
            assert ece(np.full(100, 0.4), label[order], n_bins=10, strategy=strategy) == pytest.approx(0.1)


def test_equal_mass_edges_with_more_bins_than_rows_never_decrease():
    # 3 rows in 5 bins leaves 2 bins empty; their edges repeat the next one (they were NaN)
    bins = reliability_bins([0.8, 0.2, 0.5], [1, 0, 1], n_bins=5, strategy="quantile")
    assert bins.count.sum() == 3 and (bins.count == 0).sum() == 2
    assert np.isfinite(bins.edges).all() and (np.diff(bins.edges) >= 0).all()
    assert bins.edges[0] == 0.0 and bins.edges[-1] == 1.0
    assert None not in bins.to_dict()["edges"]


@pytest.mark.parametrize("bad", [1.5, -0.2])
def test_labels_outside_unit_interval_are_refused(bad):
    with pytest.raises(ValueError, match="label must lie in"):
        reliability_bins([0.2, 0.4], [0.5, bad])
    with pytest.raises(ValueError, match="label must lie in"):
        brier([0.2, 0.4], [0.5, bad])
    with pytest.raises(ValueError, match="label must lie in"):
        probe_report([0.2, 0.4], [0.5, bad])


def test_log_loss_brier_skill_and_noise_floor_by_hand():
    from specprobe.probes.metrics import brier_skill, label_noise_floor, log_loss

    pred, label = np.array([0.8, 0.4]), np.array([1.0, 0.5])
    expected = -(math.log(0.8) + 0.5 * math.log(0.4) + 0.5 * math.log(0.6)) / 2
    assert log_loss(pred, label) == pytest.approx(expected)
    assert log_loss([1.0], [0.0]) == pytest.approx(-math.log(1e-6))  # clipped, finite
    constant = np.full(2, label.mean())
    assert brier_skill(pred, label, constant) == pytest.approx(1 - brier(pred, label) / brier(constant, label))
    assert brier_skill(constant, label, constant) == pytest.approx(0.0)
    assert brier_skill(1 - pred, label, constant) < 0  # worse than the baseline
    # N = 10 draws: a label of 0.5 carries variance 0.25 / 9 on average
    assert label_noise_floor([0.5, 0.0, 1.0], 10) == pytest.approx((0.25 / 9) / 3)


def test_reliability_bins_carry_an_interval_per_bin():
    pred = np.r_[np.full(20, 0.15), np.full(20, 0.85)]
    label = np.r_[np.tile([0.0, 1.0], 10), np.ones(20)]
    d = reliability_bins(pred, label, n_bins=10).to_dict()
    assert d["count"][1] == 20 and d["count"][8] == 20
    assert d["label_low"][1] < 0.5 < d["label_high"][1]
    assert d["label_low"][8] == d["label_high"][8] == 1.0  # no spread, no width
    assert d["label_low"][0] is None  # empty bin


def test_wilson_interval_known_values_and_bad_counts():
    from specprobe.probes.metrics import wilson_interval

    lo, hi = wilson_interval(0, 10)  # closed form at 0 successes: [0, z^2 / (n + z^2)]
    assert lo == 0.0 and hi == pytest.approx(1.959963984540054 ** 2 / (10 + 1.959963984540054 ** 2))
    # the bounds at 0 and n are exact for any n (the closed form's subtraction rounds a few ulps off 0 or 1)
    assert all(wilson_interval(0, n)[0] == 0.0 and wilson_interval(n, n)[1] == 1.0 for n in range(1, 200))
    lo, hi = wilson_interval(5, 10)
    assert lo == pytest.approx(1 - hi) and 0.23 < lo < 0.24  # symmetric at p = 1/2
    assert wilson_interval(0, 0) is None
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(11, 10)


def test_noise_floor_of_labels_that_count_their_own_sample():
    """|C_k|/N for a model's own sample is (1 + Bin(N-1, p)) / N: the floor estimates its variance without
    bias, and a sample alone in its cluster (label 1/N) adds nothing."""
    from specprobe.probes.metrics import label_noise_floor

    n, p = 6, 0.3
    assert label_noise_floor(np.full(5, 1 / n), n, includes_self=True) == 0.0
    assert label_noise_floor(np.full(5, 1 / n), n) > 0.02  # the plain formula would claim a floor here
    y = (1 + np.random.default_rng(0).binomial(n - 1, p, size=200_000)) / n
    true_var = (n - 1) * p * (1 - p) / n ** 2
    assert y.var() == pytest.approx(true_var, rel=0.02)
    assert label_noise_floor(y, n, includes_self=True) == pytest.approx(true_var, rel=0.02)
    with pytest.raises(ValueError, match="at least 1/6"):
        label_noise_floor([0.0, 0.5], n, includes_self=True)


@pytest.mark.parametrize("alpha", [0.05, 0.20])
def test_the_bootstrap_interval_of_a_share_is_the_binomials_central_interval(alpha):
    """Resampling 1000 rows of which 300 are 1 draws Binomial(1000, 0.3) / 1000: the percentile interval at
    level 1 - alpha is that law's alpha/2 and 1 - alpha/2 quantiles (derived, not a snapshot; [alpha, 1 - alpha]
    or a swapped end would be 5 or more steps of 0.001 off)."""
    from scipy.stats import binom

    label = np.r_[np.ones(300), np.zeros(700)]
    ci = bootstrap_ci(np.mean, label, n_boot=20000, alpha=alpha, seed=1)
    low, high = binom.ppf([alpha / 2, 1 - alpha / 2], 1000, 0.3) / 1000
    assert ci.low == pytest.approx(low, abs=0.0021) and ci.high == pytest.approx(high, abs=0.0021)
