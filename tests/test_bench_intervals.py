"""benchmarks/bench_intervals.py: a probe-bench run's α intervals drawn again from its traces over whole families."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from _scripts import benchmark_script

from specprobe.infer import bench
from specprobe.probes.metrics import wilson_interval

REPO = Path(__file__).resolve().parents[1]
EVIDENCE = REPO / "benchmarks" / "results" / "offline-evidence"


bi = benchmark_script("bench_intervals")


def _record(problem, accepted, verdicts, cycle=0):
    return {"problem": problem, "cycle": cycle, "committed": [],
            "positions": [{"position": i, "accepted": a} for i, a in enumerate(accepted)],
            "drafts": [{"text": "s", "verdict": v} for v in verdicts]}


def test_counts_read_from_a_trace(tmp_path):
    """Judged positions and their acceptances; decided draft steps are verdicts the verifier gave (no refusal
    reason), so a refused step (cut by the cap) and one the walk never reached (no verdict) are not."""
    path = tmp_path / "t.jsonl"
    records = [_record("p1", [True, False], [{"accepted": True, "prob": 0.9}, {"accepted": False, "prob": 0.1}]),
               _record("p1", [False], [{"accepted": False, "prob": 0.0, "reason": "length"}], cycle=1),
               _record("p2", [True], [{"accepted": True, "prob": 1.0}, None])]
    path.write_text("\n".join(json.dumps(r) for r in records))
    counts = bi.problem_counts(path, ["p1", "p2", "p3"], {"p1": "t/1", "p2": "t/1"})
    assert counts == [bench.ProblemCounts(1, 3, 1, 2, "t/1"), bench.ProblemCounts(1, 1, 1, 1, "t/1"),
                      bench.ProblemCounts(0, 0, 0, 0, None)]
    with open(path, "a") as f:  # a problem the run's results do not hold
        f.write("\n" + json.dumps(_record("p9", [True], [])))
    with pytest.raises(SystemExit, match=r"t.jsonl, record 4: problem 'p9' is not among the run's problems"):
        bi.problem_counts(path, ["p1", "p2", "p3"], {})
    row = {"method": "lr_sync", "judged": 4, "decided": 3, "acceptance": 0.5, "decided_acceptance": 2 / 3}
    bi.check_against_run(row, counts)
    with pytest.raises(SystemExit, match="lr_sync: judged read from the traces is 4, the run's results say 5"):
        bi.check_against_run({**row, "judged": 5}, counts)


def test_the_committed_evidence_intervals_come_from_its_traces(tmp_path):
    """The offline evidence run's committed bench_intervals.json is what the script draws from its traces."""
    out = tmp_path / "intervals.json"
    result = bi.main(str(REPO / "configs" / "offline-evidence.yaml"), str(EVIDENCE / "bench.json"),
                     str(EVIDENCE / "bench_traces"), str(out))
    committed = json.loads((EVIDENCE / "bench_intervals.json").read_text())
    assert (result["problems"], result["families"]) == (30, 17) and len(result["rows"]) == len(committed["rows"]) == 5
    for got, want in zip(json.loads(out.read_text())["rows"], committed["rows"]):
        for key, value in want.items():
            assert got[key] == (pytest.approx(value) if isinstance(value, (float, list)) else value), key
    assert {r["acceptance_ci95_resamples"] for r in result["rows"]} >= {"families"}
    # no method solved a problem: pass@1's interval is Wilson's over the 17 templates, not over the 30 problems
    assert all(r["pass@1_ci95"] == wilson_interval(0, 17) != wilson_interval(0, 30) for r in result["rows"])
    # a run that recorded its problems' families is drawn by those (here: every problem its own)
    recorded = tmp_path / "bench.json"
    report = json.loads((EVIDENCE / "bench.json").read_text())
    recorded.write_text(json.dumps({**report, "families": {}}))
    own = bi.main(str(REPO / "configs" / "offline-evidence.yaml"), str(recorded), str(EVIDENCE / "bench_traces"))
    assert own["families"] == 30 and {r["acceptance_ci95_resamples"] for r in own["rows"]} >= {"problems"}
