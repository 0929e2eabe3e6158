"""Per-problem speedups from the log of a `bench_runtime.py` run, also one that stopped before its report.

    python benchmarks/runtime_log_summary.py LOG [LOG ...]

bench_runtime.py writes results.json only at the end; a run cut off by a time limit (or, before the fix, a grader
that failed) leaves only its log. Its per-problem lines ("[i/N] method seconds tokens ... accept=x") hold what
the report is built from: this prints, over the problems every method finished, each method's speedup per
problem (target-only latency / method latency, same problem, same run), its median and range, the pooled ratio
(the report's speedup: total latency over total latency), the mean per-problem acceptance, c (the draft's time
per token over the target's, medians of the target-only and draft-only runs) and the paper's prediction at that
α, c and the run's b(γ+1) (`infer.decoding.analytic.predict`; LR: batch-adjusted, SemanticSpec: its formula).
With a Bernoulli(α_v) verifier the run's acceptance is one draw around α_v (the draws are keyed by the seed and the
prefix, so a rerun repeats them): two more columns give the formula at α_v and the projection of the run to it
(the run's measured / predicted times the formula at α_v), so a lucky or unlucky draw shows in the table.
"""
from __future__ import annotations

import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from specprobe.infer.decoding.analytic import predict

LINE = re.compile(r"^\s*\[(\d+)/(\d+)\]\s+(\S+)\s+([\d.]+)s\s+(\d+) tok.*?(?:accept=([\d.]+))?\s*$")


def parse(text: str) -> tuple[dict, dict, int | None]:
    """({problem: {method: (seconds, tokens, acceptance)}}, {k: b(k)}, gamma) of one log."""
    runs: dict[int, dict] = defaultdict(dict)
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            runs[int(m[1])][m[3]] = (float(m[4]), int(m[5]), float(m[6]) if m[6] else None)
    b = {int(k): float(v) for k, v in re.findall(r"b\((\d+)\)=([\d.]+)", text.split("\n  [")[0])}
    gamma = re.search(r"γ=(\d+)", text)
    return dict(runs), b, int(gamma[1]) if gamma else None


def summarize(text: str) -> str:
    runs, b, gamma = parse(text)
    methods = sorted({m for r in runs.values() for m in r}, key=lambda m: (m != "target", m))
    done = sorted(p for p, r in runs.items() if set(r) == set(methods))
    if not done or "target" not in methods:
        return "no problem finished by every method, target included"
    per_token = {m: statistics.median(runs[p][m][0] / runs[p][m][1] for p in done) for m in methods}
    c = per_token["draft"] / per_token["target"] if "draft" in per_token else None
    head = f"{len(done)} problems finished by every method (of {max(runs)} started); γ = {gamma}, "
    head += f"b({(gamma or 0) + 1}) = {b.get((gamma or 0) + 1)}, c = " + ("–" if c is None else f"{c:.3f}")
    nominal = re.search(r"Bernoulli\(([\d.]+)\)", text)
    alpha_v = float(nominal[1]) if nominal else None
    cols = ["method", "speedup per problem", "median [min, max]", "pooled", "α (mean per problem)", "predicted",
            "measured / predicted"]
    if alpha_v is not None:
        head += f"; verifier Bernoulli({alpha_v:g})"
        cols += [f"predicted at α = {alpha_v:g}", f"projected to α = {alpha_v:g}"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for m in methods:
        if m == "target":
            continue
        ratios = [runs[p]["target"][0] / runs[p][m][0] for p in done]
        pooled = sum(runs[p]["target"][0] for p in done) / sum(runs[p][m][0] for p in done)
        accepts = [runs[p][m][2] for p in done if runs[p][m][2] is not None]
        alpha = statistics.mean(accepts) if accepts else None
        kind = next((k for k in ("lr_sync", "lr_async", "semanticspec", "draft") if m.startswith(k)), None)
        value = _formula(kind, alpha, c, gamma, b)
        over = _ratio(pooled, value)  # measured / predicted
        cells = [m, " ".join(f"{r:.2f}" for r in ratios),
                 f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]", f"{pooled:.2f}",
                 _fmt(alpha), _fmt(value), _fmt(over)]
        if alpha_v is not None:
            # the draft alone does not depend on α; the other methods at the verifier's own α
            at_v = _formula(kind, alpha_v, c, gamma, b) if kind != "draft" else None
            cells += [_fmt(at_v), _fmt(None if at_v is None or over is None else at_v * over)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += _adaptive_lines(runs, methods, done)
    return "\n".join(lines)


def _adaptive_lines(runs: dict, methods: list[str], done: list[int]) -> list[str]:
    """Per method family with an adaptive γ and fixed γs (issue 24's runs): adaptive / best fixed γ in hindsight,
    pooled over the problems every method finished, with bench_adaptive_gamma's 95% bootstrap over problems."""
    from bench_adaptive_gamma import ratio_ci95  # (this folder is on the path when run as a script)

    out = []
    for family in sorted({m.split(":gamma=")[0] for m in methods if m.endswith(":gamma=adaptive")}):
        fixed = {int(m.rsplit("=", 1)[1]): m for m in methods
                 if m.startswith(f"{family}:gamma=") and m.rsplit("=", 1)[1].isdigit()}
        if not fixed:
            continue
        total = {g: sum(runs[p][m][0] for p in done) for g, m in fixed.items()}
        best = min(total, key=total.get)
        mine = [runs[p][f"{family}:gamma=adaptive"][0] for p in done]
        low, high = ratio_ci95([runs[p][fixed[best]][0] for p in done], mine)
        out.append(f"\n{family}: adaptive / best fixed γ in hindsight (γ = {best}), a ratio of speedups = that γ's "
                   f"latency / adaptive's = {total[best]:.2f} s / {sum(mine):.2f} s = {total[best] / sum(mine):.3f} "
                   f"[{low:.3f}, {high:.3f}] (95% bootstrap over the {len(done)} problems)")
    return out


def _formula(kind: str | None, alpha: float | None, c: float | None, gamma: int | None, b: dict) -> float | None:
    """The paper's speedup at (α, c, γ, b(γ+1)): batch-adjusted where the method has that form, else ideal."""
    if not kind or not gamma:
        return None
    pred = predict(kind, alpha, c, gamma, b.get(gamma + 1))
    return pred["adjusted"] if pred.get("adjusted") is not None else pred.get("ideal")


def _ratio(measured: float, predicted: float | None) -> float | None:
    return None if predicted is None or predicted <= 0 else measured / predicted


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(f"## {path}\n\n{summarize(Path(path).read_text())}\n")
