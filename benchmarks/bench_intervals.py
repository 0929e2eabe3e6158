"""α's intervals of a probe-bench run drawn again from its traces, resampling whole families (templates).

probe-bench's α intervals drew judged positions (Wilson) before 2026-11-27 and problems before 2026-11-29; problems
drawn from one template rise and fall together, so both were too narrow. A run's traces hold every judged
position's verdict, so its intervals can be drawn again as probe-bench draws them today
(`infer.bench.acceptance_interval`). The families come from the config's source (the data stage's traces: the
same ids), or from results.json where the run recorded them (`families`, since 2026-11-29). The counts read from
the traces are checked against the run's results.json before anything is drawn.

Usage: python benchmarks/bench_intervals.py CONFIG.yaml RESULTS_JSON TRACES_DIR [OUT.json]
"""
import json
import sys
from pathlib import Path

from specprobe.data_gen.pipeline import load_source_traces
from specprobe.infer.bench import ProblemCounts, acceptance_interval, trace_file
from specprobe.train.config import load_config


def problem_counts(path: Path, problems: list[str], families: dict[str, str]) -> list[ProblemCounts]:
    """Each problem's judged positions and decided draft steps (a verdict with no refusal reason), from a trace."""
    counts = {p: [0, 0, 0, 0] for p in problems}
    for n, line in enumerate(path.open(), start=1):
        record = json.loads(line)
        if record["problem"] not in counts:
            raise SystemExit(f"{path}:{n}: problem {record['problem']!r} is not among the run's problems in "
                             "results.json (a run stopped midway keeps only the problems it finished)")
        c = counts[record["problem"]]
        for position in record["positions"]:
            c[0] += int(position["accepted"])
            c[1] += 1
        for draft in record["drafts"]:
            verdict = draft.get("verdict") or {}
            if "reason" not in verdict and isinstance(verdict.get("accepted"), bool):  # refused steps have a reason
                c[2] += int(verdict["accepted"])
                c[3] += 1
    return [ProblemCounts(*counts[p], families.get(p)) for p in problems]


def check_against_run(row: dict, counts: list[ProblemCounts]) -> None:
    judged, decided = sum(c.judged for c in counts), sum(c.decided for c in counts)
    found = {"judged": judged, "decided": decided,
             "acceptance": sum(c.accepted for c in counts) / judged if judged else None,
             "decided_acceptance": sum(c.decided_accepted for c in counts) / decided if decided else None}
    for key, value in found.items():
        run = row.get(key)
        if (run is None) != (value is None) or (run is not None and abs(run - value) > 1e-9):
            raise SystemExit(f"{row['method']}: {key} read from the traces is {value}, the run's results say {run}")


def main(config: str, results: str, traces: str, out: str | None = None) -> dict:
    report = json.loads(Path(results).read_text())
    families = report.get("families")
    if families is None:  # a run made before probe-bench recorded families: the data source's (the same ids)
        families = {t.id: t.family for t in load_source_traces(load_config(config).source) if t.family}
    problems = report["problems"]
    rows = []
    for row in report["rows"]:
        path = Path(traces) / trace_file(Path("."), row["method"]).name
        if not row.get("judged"):
            continue
        counts = problem_counts(path, problems, families)
        check_against_run(row, counts)
        fams = [c.family for c in counts]
        alpha, alpha_over = acceptance_interval([(c.accepted, c.judged) for c in counts], fams)
        decided, decided_over = acceptance_interval([(c.decided_accepted, c.decided) for c in counts], fams)
        rows.append({"method": row["method"], "acceptance": row["acceptance"], "acceptance_ci95": alpha,
                     "acceptance_ci95_resamples": alpha_over, "acceptance_ci95_in_run": row.get("acceptance_ci95"),
                     "decided": row["decided"], "decided_acceptance": row["decided_acceptance"],
                     "decided_acceptance_ci95": decided, "decided_acceptance_ci95_resamples": decided_over,
                     "decided_acceptance_ci95_in_run": row.get("decided_acceptance_ci95")})
    n_families = len({families.get(p, p) for p in problems})
    result = {"config": config, "results": results, "problems": len(problems), "families": n_families, "rows": rows}
    print(f"{len(problems)} problems from {n_families} families (templates)")
    for r in rows:
        print(f"{r['method']:30s} α {r['acceptance']:.2f} {_ci(r['acceptance_ci95'])} over {r['acceptance_ci95_resamples']}"
              f" (run: {_ci(r['acceptance_ci95_in_run'])}); over decided {r['decided_acceptance']:.2f} "
              f"{_ci(r['decided_acceptance_ci95'])} (run: {_ci(r['decided_acceptance_ci95_in_run'])})")
    if out:
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _ci(interval) -> str:
    return "–" if interval is None else f"[{interval[0]:.2f}, {interval[1]:.2f}]"


if __name__ == "__main__":
    if len(sys.argv) not in (4, 5):
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
