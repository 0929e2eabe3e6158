"""α's (and pass@1's) intervals of a probe-bench run drawn again from its traces, resampling whole families
(templates).

probe-bench's α intervals drew judged positions (Wilson) before 2026-11-27 and problems before 2026-11-29; problems
drawn from one template rise and fall together, so both were too narrow. A run's traces hold every judged
position's verdict, so its intervals can be drawn again as probe-bench draws them today
(`infer.bench.acceptance_interval`); pass@1's (a Wilson interval over problems before 2026-11-29) only where the
run solved none or all of its problems, as results.json holds no per-problem results. The families come from the
config's source (the data stage's traces: the same ids), or from results.json where the run recorded them (`families`, since 2026-11-29). The counts read from
the traces are checked against the run's results.json before anything is drawn.

Usage: python benchmarks/bench_intervals.py CONFIG.yaml RESULTS_JSON TRACES_DIR [OUT.json]
"""
import json
import sys
from pathlib import Path

from specprobe.data_gen.pipeline import load_source_traces
from specprobe.infer.bench import ProblemCounts, acceptance_interval, pass_interval, trace_file
from specprobe.infer.decoding import read_trace, stats_from_trace
from specprobe.train.config import load_config


def problem_counts(path: Path, problems: list[str], families: dict[str, str]) -> list[ProblemCounts]:
    """Each problem's judged positions and decided draft steps, recounted from a trace as the runtime counts them
    (`infer.decoding.stats_from_trace`)."""
    records: dict[str, list[dict]] = {p: [] for p in problems}
    for n, record in enumerate(read_trace(path), start=1):
        if record["problem"] not in records:
            raise SystemExit(f"{path}, record {n}: problem {record['problem']!r} is not among the run's problems in "
                             "results.json (a run stopped midway keeps only the problems it finished)")
        records[record["problem"]].append(record)
    counts = []
    for p in problems:
        st = stats_from_trace(records[p])
        counts.append(ProblemCounts(st.accepted, st.judged, st.decided_accepted, st.decided, families.get(p)))
    return counts


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
        if row.get("judged"):
            counts = problem_counts(Path(traces) / trace_file(Path("."), row["method"]).name, problems, families)
            check_against_run(row, counts)
        else:  # target-only and draft-only judge nothing: pass@1 alone
            counts = [ProblemCounts(0, 0, 0, 0, families.get(p)) for p in problems]
        # pass@1: each problem's result is known from the run's count only where it solved none or all
        solved = {0: 0, len(problems): 1}.get(row["correct"]) if row.get("problems") == len(problems) else None
        pass_ci, pass_over = ((None, "not drawn: the run records no per-problem results") if solved is None else
                              pass_interval([c._replace(correct=solved) for c in counts]))
        fams = [c.family for c in counts]
        alpha, alpha_over = acceptance_interval([(c.accepted, c.judged) for c in counts], fams)
        decided, decided_over = acceptance_interval([(c.decided_accepted, c.decided) for c in counts], fams)
        rows.append({"method": row["method"], "pass@1": row["pass@1"], "pass@1_ci95": pass_ci,
                     "pass@1_ci95_resamples": pass_over, "pass@1_ci95_in_run": row.get("pass@1_ci95"),
                     "acceptance": row["acceptance"], "acceptance_ci95": alpha,
                     "acceptance_ci95_resamples": alpha_over, "acceptance_ci95_in_run": row.get("acceptance_ci95"),
                     "decided": row["decided"], "decided_acceptance": row["decided_acceptance"],
                     "decided_acceptance_ci95": decided, "decided_acceptance_ci95_resamples": decided_over,
                     "decided_acceptance_ci95_in_run": row.get("decided_acceptance_ci95")})
    n_families = len({families.get(p, p) for p in problems})
    result = {"config": config, "results": results, "problems": len(problems), "families": n_families, "rows": rows}
    print(f"{len(problems)} problems from {n_families} families (templates)")
    for r in rows:
        if r["acceptance"] is None:
            print(f"{r['method']:30s} pass@1 {r['pass@1']:.2f} {_ci(r['pass@1_ci95'])} (run: {_ci(r['pass@1_ci95_in_run'])})")
            continue
        print(f"{r['method']:30s} α {r['acceptance']:.2f} {_ci(r['acceptance_ci95'])} over {r['acceptance_ci95_resamples']}"
              f" (run: {_ci(r['acceptance_ci95_in_run'])}); over decided {r['decided_acceptance']:.2f} "
              f"{_ci(r['decided_acceptance_ci95'])} (run: {_ci(r['decided_acceptance_ci95_in_run'])}); pass@1 "
              f"{r['pass@1']:.2f} {_ci(r['pass@1_ci95'])} (run: {_ci(r['pass@1_ci95_in_run'])})")
    if out:
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _ci(interval) -> str:
    return "–" if interval is None else f"[{interval[0]:.2f}, {interval[1]:.2f}]"


if __name__ == "__main__":
    if len(sys.argv) not in (4, 5):
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
