"""Per-problem speedups from the log of a `bench_runtime.py` run, also one that stopped before its report.

    python benchmarks/runtime_log_summary.py LOG [LOG ...]

bench_runtime.py writes results.json only at the end; a run cut off by a time limit (or, before the fix, a grader
that failed) leaves only its log. Its per-problem lines ("[i/N] method seconds tokens ... accept=x") hold what
the report is built from: this prints, over the problems every method finished, each method's speedup per
problem (target-only latency / method latency, same problem, same run), its median and range, the pooled ratio
(the report's speedup: total latency over total latency), the mean per-problem acceptance, c (the draft's time
per token over the target's, medians of the target-only and draft-only runs) and the paper's prediction at that
α, c and the run's b(γ+1) (`infer.decoding.analytic.predict`; LR: batch-adjusted, SemanticSpec: its formula).
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
    lines = [head, "", "| method | speedup per problem | median [min, max] | pooled | α (mean per problem) | "
                 "predicted | measured / predicted |", "|---|---|---|---|---|---|---|"]
    for m in methods:
        if m == "target":
            continue
        ratios = [runs[p]["target"][0] / runs[p][m][0] for p in done]
        pooled = sum(runs[p]["target"][0] for p in done) / sum(runs[p][m][0] for p in done)
        accepts = [runs[p][m][2] for p in done if runs[p][m][2] is not None]
        alpha = statistics.mean(accepts) if accepts else None
        kind = next((k for k in ("lr_sync", "lr_async", "semanticspec", "draft") if m.startswith(k)), None)
        pred = predict(kind, alpha, c, gamma or 0, b.get((gamma or 0) + 1)) if kind and gamma else {}
        value = pred.get("adjusted") or pred.get("ideal")
        lines.append(f"| {m} | {' '.join(f'{r:.2f}' for r in ratios)} | {statistics.median(ratios):.2f} "
                     f"[{min(ratios):.2f}, {max(ratios):.2f}] | {pooled:.2f} | "
                     f"{'–' if alpha is None else f'{alpha:.2f}'} | {'–' if value is None else f'{value:.2f}'} | "
                     f"{'–' if value is None else f'{pooled / value:.2f}'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(f"## {path}\n\n{summarize(Path(path).read_text())}\n")
