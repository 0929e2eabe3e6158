"""probe-eval figures (matplotlib, Agg backend, PNG). Each function draws arrays it is given to a path;
no metric is computed here beyond what a picture needs (bin means for the reliability curve come from
`probes.metrics.reliability_bins`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import BoundaryNorm, ListedColormap  # noqa: E402

from specprobe.probes.metrics import reliability_bins  # noqa: E402

DPI = 110
ROLE_COLORS = {"target": "tab:blue", "draft": "tab:orange"}


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def reliability_diagram(path: str | Path, pred: np.ndarray, label: np.ndarray, n_bins: int = 10,
                        title: str = "", ece: float | None = None,
                        label_name: str = "empirical semantic probability", strategy: str = "uniform") -> Path:
    """Mean label against mean prediction per bin (equal-width or equal-mass), each point with a 90% interval
    of its bin's mean label and the bin's row count written above it; the histogram of predictions below."""
    bins = reliability_bins(pred, label, n_bins, strategy)
    filled = bins.count > 0
    low, high = bins.label_interval()
    kind = "equal-width" if strategy == "uniform" else "equal-mass"
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(5.6, 6.6), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1], "hspace": 0.08})
    top.plot([0, 1], [0, 1], ls="--", color="grey", lw=1, label="perfect calibration")
    if strategy == "uniform":
        centers = (bins.edges[:-1] + bins.edges[1:]) / 2
        top.bar(centers[filled], bins.mean_label[filled], width=np.diff(bins.edges)[filled] * 0.9, color="tab:blue",
                alpha=0.25, edgecolor="tab:blue", label="mean label per bin")
    x, y = bins.mean_pred[filled], bins.mean_label[filled]
    top.errorbar(x, y, yerr=[y - low[filled], high[filled] - y], fmt="o-", color="tab:red", ms=4, capsize=3,
                 lw=1.2, label="(mean prediction, mean label), 90% interval")
    counts = bins.count[filled]
    lo, hi = (int(counts.min()), int(counts.max())) if counts.size else (0, 0)
    uneven = hi - lo > 1 or bool((bins.count == 0).any())  # (equal mass with a tie: its bin holds the whole tie)
    if strategy == "uniform" or uneven:
        for xi, hi_i, n in zip(x, high[filled], bins.count[filled]):
            top.annotate(f"n={n}", (xi, min(hi_i, 0.97)), textcoords="offset points", xytext=(0, 4), ha="center",
                         fontsize=7)
    if strategy != "uniform":  # equal mass: one count for all bins where no tie spans bins, said once
        kind += (" bins (tied predictions share one)" if uneven else f" bins, {lo}–{hi} rows each" if hi > lo
                 else f" bins, {lo} rows each")
    top.set_xlim(0, 1)
    top.set_ylim(0, 1.05)
    top.set_ylabel(f"mean label per bin: {label_name}")
    kind = kind if strategy != "uniform" else kind + " bins"
    top.set_title(title + f"\n{n_bins} {kind}" + (f", ECE = {ece:.3f}" if ece is not None else ""), fontsize=10)
    top.legend(loc="upper left", fontsize=7, framealpha=0.8)
    bottom.hist(pred, bins=np.linspace(0, 1, 21), color="grey", edgecolor="black")
    bottom.set_xlabel("predicted semantic probability")
    bottom.set_ylabel("count")
    return _save(fig, path)


def acceptance_scatter(path: str | Path, predicted: np.ndarray, empirical: np.ndarray, title: str = "") -> Path:
    """Predicted min(1, p/q) against the empirical ratio, one point per draft step (jittered slightly)."""
    rng = np.random.default_rng(0)
    jitter = rng.uniform(-0.01, 0.01, size=len(empirical))
    fig, ax = plt.subplots(figsize=(5.2, 5.0))
    ax.plot([0, 1], [0, 1], ls="--", color="grey", lw=1, label="y = x")
    ax.scatter(np.clip(empirical + jitter, -0.02, 1.02), predicted, s=14, alpha=0.5, color="tab:purple",
               edgecolor="none", label="draft step")
    ax.axhline(np.mean(predicted), color="tab:purple", lw=1, ls=":", label=f"mean predicted {np.mean(predicted):.2f}")
    ax.axvline(np.mean(empirical), color="black", lw=1, ls=":", label=f"mean empirical {np.mean(empirical):.2f}")
    ax.set_xlim(-0.03, 1.03)
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("empirical ratio min(1, P_target(meaning) / P_draft(meaning))")
    ax.set_ylabel("probe ratio min(1, p / q)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    return _save(fig, path)


def layer_sweep_plot(path: str | Path, sweeps: dict[str, dict[str, Any]]) -> Path:
    """Brier score of one small probe per layer against layer index, one colour per model: solid on the
    validation questions that choose the layer, dotted on the held-out test questions; the chosen layer
    is starred."""
    fig, ax = plt.subplots(figsize=(6.8, 4.4))
    for role, sweep in sweeps.items():
        entries = sweep["entries"]
        color = ROLE_COLORS.get(role, None)
        layers = [e["layer"] for e in entries]
        ax.plot(layers, [e["val_brier"] for e in entries], "o-", ms=3, color=color,
                label=f"{role}: validation (chooses; n={sweep['n_val']})")
        if not sweep.get("independent", False):
            continue
        ax.plot(layers, [e.get("test_brier") for e in entries], "s:", ms=3, color=color,
                label=f"{role}: test (reported; n={sweep['n_test']})")
        ax.axhline(sweep["constant_test_brier"], color=color, ls="--", lw=1, label=f"{role}: constant on test")
        best = sweep.get("best")
        if best:
            ax.plot([best["layer"]], [best["test_brier"]], "*", color=color, ms=12, mec="black",
                    label=f"{role}: chosen layer {best['layer']}")
    ax.set_xlabel("layer (hidden-state row; 0 = embeddings)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("Brier score (lower is better)")
    ax.set_title("Per-layer probes: error against depth", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def logistic_sweep_plot(path: str | Path, sweeps: dict[str, dict[str, Any]], confidence: float) -> Path:
    """Per row set: test Brier of the logistic probe minus the set's constant against layer, one line per
    pooling, with the paired interval shaded; below zero the probe beats the constant."""
    fig, axes = plt.subplots(1, len(sweeps), figsize=(4.2 * len(sweeps), 3.8), squeeze=False, sharey=False)
    for ax, (set_name, sweep) in zip(axes[0], sweeps.items()):
        for pooling, style in (("mean", "o-"), ("last", "s--")):
            entries = [e for e in sweep["entries"] if e["pooling"] == pooling]
            if not entries:
                continue
            layers = [e["layer"] for e in entries]
            delta = [e["versus_constant"]["brier_delta"] for e in entries]
            mid = [d.get("estimate") for d in delta]
            line = ax.plot(layers, mid, style, ms=3, label=f"{pooling} pooling")[0]
            lows, highs = [d.get("low") for d in delta], [d.get("high") for d in delta]
            if all(v is not None for v in lows + highs):
                ax.fill_between(layers, lows, highs, color=line.get_color(), alpha=0.15)
        best = sweep["best"]
        ax.plot([best["layer"]], [best["versus_constant"]["brier_delta"].get("estimate")], "*", ms=12, color="gold",
                mec="black", label=f"chosen on validation: {best['pooling']} row {best['layer']}")
        ax.axhline(0.0, color="black", lw=0.8)
        ax.set_title(f"{set_name} (test n={sweep['n_test']}, {sweep['n_test_questions']} questions)", fontsize=9)
        ax.set_xlabel("layer (0 = embeddings)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel(f"test Brier - constant's ({confidence:.0%} interval)")
    fig.suptitle("Logistic probe per layer: below 0 beats the set's own constant", fontsize=10)
    return _save(fig, path)


def umap_plot(path: str | Path, panels: dict[str, dict[str, Any]]) -> Path:
    """One UMAP panel per model, points coloured by 0.1-wide semantic-probability bin."""
    cmap = ListedColormap(plt.get_cmap("viridis")(np.linspace(0, 1, 10)))
    norm = BoundaryNorm(np.arange(-0.5, 10.5, 1.0), cmap.N)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.4 * len(panels), 4.8), squeeze=False)
    scatter = None
    for ax, (role, panel) in zip(axes[0], panels.items()):
        xy = np.asarray(panel["coords"])
        scatter = ax.scatter(xy[:, 0], xy[:, 1], c=panel["bins"], cmap=cmap, norm=norm, s=12, alpha=0.85,
                             edgecolor="none")
        ax.set_title(f"{role}: own steps, layer {panel['layer']} mean-pooled (n={panel['n']})", fontsize=10)
        ax.set_xlabel("UMAP 1")
        ax.set_ylabel("UMAP 2")
    bar = fig.colorbar(scatter, ax=list(axes[0]), ticks=range(10), fraction=0.04)
    bar.ax.set_yticklabels([f"[{k / 10:.1f}, {(k + 1) / 10:.1f})" if k < 9 else "[0.9, 1.0]" for k in range(10)],
                           fontsize=7)
    bar.set_label("semantic probability bin")
    return _save(fig, path)


def verifier_curves(path: str | Path, curves: dict[str, dict[str, Any]]) -> Path:
    """ROC (left) and precision-recall (right) of each pair verifier, its thresholds marked."""
    fig, (roc_ax, pr_ax) = plt.subplots(1, 2, figsize=(10.5, 4.6))
    roc_ax.plot([0, 1], [0, 1], ls="--", color="grey", lw=1, label="chance")
    for k, (name, c) in enumerate(curves.items()):
        if not c.get("roc"):
            continue
        color = plt.get_cmap("tab10")(k)
        roc_ax.plot(c["roc"]["fpr"], c["roc"]["tpr"], color=color, label=name)
        pr_ax.plot(c["pr"]["recall"], c["pr"]["precision"], color=color, drawstyle="steps-post", label=name)
        _mark_thresholds(roc_ax, pr_ax, c, color, name)
    base = next(iter(curves.values()))["positive_rate"]
    pr_ax.axhline(base, ls="--", color="grey", lw=1, label=f"accept all (precision {base:.2f})")
    roc_ax.set(xlabel="false accept rate (non-equivalent pairs accepted)", ylabel="true accept rate (recall)",
               xlim=(-0.02, 1.02), ylim=(-0.02, 1.02), title="ROC")
    pr_ax.set(xlabel="recall (equivalent pairs accepted)", ylabel="precision of accepted pairs",
              xlim=(-0.02, 1.02), ylim=(-0.02, 1.05), title="Precision-recall")
    # legends below the axes: inside they covered the curves' interesting corners
    for ax in (roc_ax, pr_ax):
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1, frameon=False)
    return _save(fig, path)


def _mark_thresholds(roc_ax, pr_ax, c: dict[str, Any], color, name: str) -> None:
    for kind, point in c["points"].items():
        marker, size = ("*", 13) if kind == "chosen" else ("s", 7)
        label = f"{name} {kind} t={point['threshold']:.3g} (accepts {point['acceptance_rate']:.0%})"
        if point.get("false_accept_rate") is not None and point.get("recall") is not None:
            roc_ax.plot([point["false_accept_rate"]], [point["recall"]], marker, color=color, ms=size, mec="black",
                        label=label)
        if point.get("precision") is not None and point.get("recall") is not None:
            pr_ax.plot([point["recall"]], [point["precision"]], marker, color=color, ms=size, mec="black", label=label)


def training_curves(path: str | Path, curves: dict[str, dict[str, Any]]) -> Path:
    """One panel per curve: training loss (and validation loss where recorded) against epoch or step, the kept
    epoch starred. Missing values (a non-finite loss, stored as null) are gaps."""
    cols = min(4, len(curves))
    rows = -(-len(curves) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat[len(curves):]:
        ax.set_visible(False)
    for ax, (name, c) in zip(axes.flat, curves.items()):
        train = np.array([np.nan if v is None else v for v in c["train"]], dtype=float)
        ax.plot(np.arange(len(train)), train, "-", lw=1.2, color="tab:blue", label="training")
        if c.get("val"):
            val = np.array([np.nan if v is None else v for v in c["val"]], dtype=float)
            ax.plot(np.arange(len(val)), val, "-", lw=1.2, color="tab:orange", label="validation")
            if c.get("best") is not None and c["best"] < len(val):
                ax.plot([c["best"]], [val[c["best"]]], "*", ms=11, color="tab:orange", mec="black", label="kept")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(c.get("x", "epoch"))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for row in axes:
        row[0].set_ylabel("loss")
    fig.tight_layout()
    return _save(fig, path)


PLOTS = {"reliability_diagram": reliability_diagram, "acceptance_scatter": acceptance_scatter,
         "layer_sweep_plot": layer_sweep_plot, "logistic_sweep_plot": logistic_sweep_plot,
         "umap_plot": umap_plot, "verifier_curves": verifier_curves, "training_curves": training_curves}


def draw(plot: str, path: str | Path, args: dict[str, Any]) -> Path:
    """Draw figure `plot` (a name in PLOTS) to `path`."""
    if plot not in PLOTS:
        raise ValueError(f"unknown plot {plot!r}; known: {sorted(PLOTS)}")
    return PLOTS[plot](path, **args)
