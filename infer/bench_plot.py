"""probe-bench's figure: each method's speedup over target-only, problem by problem, beside the pooled speedup and
its 95% interval (`<out>/speedup.png`). Drawn from the report alone, so a results.json redraws it (one written
before the per-problem ratios were recorded has nothing to draw).

matplotlib's object API (`Figure`, no pyplot): no backend is chosen and no global state is touched.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specprobe.probes.io import write_atomically

FIGURE = "speedup.png"


def speedup_points(report: dict) -> list[tuple[str, list[float], float, float, tuple[float, float] | None]]:
    """(method, its speedup on each problem, their median, its pooled speedup, the pooled one's interval) for every
    method with
    per-problem speedups (`infer.bench.per_problem_speedups`; the baseline has none): what the figure draws."""
    out = []
    for r in report["rows"]:
        spread = r.get("speedup_per_problem")
        if r.get("speedup") is not None and spread and spread.get("ratios"):  # (older reports: no ratios)
            ci = r.get("speedup_ci95")
            out.append((r["method"], list(spread["ratios"]), spread["median"], r["speedup"], tuple(ci) if ci else None))
    return out


def speedup_figure(report: dict):
    """The figure (a matplotlib Figure), or None when no method has a speedup to show."""
    from matplotlib.figure import Figure

    points = speedup_points(report)
    if not points:
        return None
    fig = Figure(figsize=(6.4, 1.2 + 0.45 * len(points)), layout="constrained")
    ax = fig.subplots()
    jitter = np.random.default_rng(0)  # spreads a method's problems vertically so equal ratios stay visible
    for y, (_, ratios, median, pooled, ci) in enumerate(points):
        ax.scatter(ratios, y + jitter.uniform(-0.15, 0.15, len(ratios)), s=14, alpha=0.6, color="tab:blue",
                   label="one problem" if y == 0 else None)
        if ci is not None:
            ax.plot(ci, [y, y], color="black", linewidth=2, label="95% interval" if y == 0 else None)
        ax.scatter([pooled], [y], marker="D", s=40, color="black", zorder=3, label="all problems" if y == 0 else None)
        ax.scatter([median], [y], marker="|", s=200, color="tab:orange", zorder=3,
                   label="median problem" if y == 0 else None)
    ax.axvline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(points)), [p[0] for p in points])
    ax.invert_yaxis()  # the table's order, top down
    ax.set_xlabel("speedup over target-only (latency ratio, same run)")
    n = len(points[0][1])
    ax.set_title(f"{n} problem{'s' if n != 1 else ''}"
                 + (" (system-speed mode: random weights)" if report.get("system_speed") else ""), fontsize=9)
    ax.legend(fontsize=7, loc="best")
    return fig


def write_speedup_figure(report: dict, out: str | Path) -> Path | None:
    """`<out>/speedup.png` (written aside, then moved into place), or None when there is nothing to draw."""
    fig = speedup_figure(report)
    if fig is None:
        return None
    return write_atomically(Path(out) / FIGURE, lambda tmp: fig.savefig(tmp, format="png", dpi=120))
