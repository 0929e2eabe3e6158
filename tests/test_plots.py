"""probe-eval's figures draw the numbers they are given, on the axes they name (not only a non-blank canvas)."""
from __future__ import annotations

import numpy as np
import pytest

from specprobe.probes.metrics import reliability_bins
from specprobe.train.report import plots


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plot functions save, kept open for their artists to be read."""
    figures = []
    real = plots._save

    def keep(fig, path):
        figures.append(fig)
        fig.savefig(path)  # (a real file too; _save would close the figure)
        return path

    monkeypatch.setattr(plots, "_save", keep)
    yield figures
    monkeypatch.setattr(plots, "_save", real)
    for fig in figures:
        plots.plt.close(fig)


@pytest.mark.parametrize("strategy", ["uniform", "quantile"])
def test_the_reliability_curve_is_mean_label_against_mean_prediction(drawn, tmp_path, strategy):
    rng = np.random.default_rng(0)
    pred = rng.random(300)
    label = (rng.random(300) < pred ** 2).astype(float)  # overconfident: the curve sits below the diagonal
    plots.reliability_diagram(tmp_path / "r.png", pred, label, n_bins=6, strategy=strategy)
    bins = reliability_bins(pred, label, 6, strategy)
    top = drawn[0].axes[0]
    curve = next(line for line in top.get_lines() if line.get_marker() == "o")
    np.testing.assert_allclose(curve.get_xdata(), bins.mean_pred[bins.count > 0])
    np.testing.assert_allclose(curve.get_ydata(), bins.mean_label[bins.count > 0])
    assert (np.asarray(curve.get_ydata()) < np.asarray(curve.get_xdata())).mean() > 0.5
    assert "predicted" in drawn[0].axes[1].get_xlabel() and "label" in top.get_ylabel()
    hist = sum(patch.get_height() for patch in drawn[0].axes[1].patches)
    assert hist == 300  # the prediction histogram counts every row


def test_equal_mass_bins_with_a_tie_say_their_counts(drawn, tmp_path):
    pred = np.r_[np.full(60, 0.5), np.linspace(0.6, 0.9, 40)]
    label = np.r_[np.zeros(30), np.ones(70)]
    plots.reliability_diagram(tmp_path / "t.png", pred, label, n_bins=10, strategy="quantile")
    top = drawn[0].axes[0]
    assert "tied predictions share one" in top.get_title()
    assert sorted(t.get_text() for t in top.texts) == sorted(["n=60"] + ["n=10"] * 4)


def test_the_acceptance_scatter_puts_the_empirical_ratio_across_and_the_probes_up(drawn, tmp_path):
    empirical = np.array([0.1, 0.5, 0.9, 0.3])
    predicted = np.array([0.8, 0.6, 0.2, 0.4])
    plots.acceptance_scatter(tmp_path / "a.png", predicted, empirical)
    ax = drawn[0].axes[0]
    xy = ax.collections[0].get_offsets()
    np.testing.assert_allclose(xy[:, 0], empirical, atol=0.011)  # (jittered by at most 0.01)
    np.testing.assert_array_equal(xy[:, 1], predicted)
    assert "empirical" in ax.get_xlabel() and "p / q" in ax.get_ylabel()
