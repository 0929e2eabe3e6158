"""benchmarks/gpu_bench.sh runs: every phase's commands, on the CPU with tiny random models (SMOKE=1) and the fast
decode path the GPU uses, finish and write what the results README is built from. A GPU is lent for 30 minutes
now and then; a command that breaks there costs the session's measurements."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _smoke(phase: str, tmp_path: Path) -> tuple[Path, str]:
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps({"id": f"q{i}", "question": f"What is {i + 3} times {i + 7}?",
                                             "answer": str((i + 3) * (i + 7))}) + "\n" for i in range(4)))
    out = tmp_path / "out"
    env = dict(os.environ, SMOKE="1", DECODE="fast", QUESTIONS=str(questions))
    res = subprocess.run(["bash", "benchmarks/gpu_bench.sh", phase, str(out)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out, res.stdout


@pytest.mark.slow
def test_engine_phase(tmp_path):
    out, _ = _smoke("engine", tmp_path)
    text = (out / "engine_llama-tiny.txt").read_text()
    assert "decode fast greedy" in text and "teacher-forced scoring" in text
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2"] and all(float(r[1]) > 0 for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("phase,folder", [("runtime", "runtime_7b"), ("runtime32", "runtime_32b")])
def test_runtime_phases(tmp_path, phase, folder):
    out, _ = _smoke(phase, tmp_path)
    res = json.loads((out / folder / "results.json").read_text())
    assert [r["method"] for r in res["rows"]] == ["target", "lr_sync", "lr_async", "semanticspec", "draft"]
    assert all(r["error"] is None and r["problems"] == 2 for r in res["rows"])
    assert res["config"]["models"]["decode"] == "fast" and res["models"]["target"] == "random:llama-tiny"
    assert json.loads((out / folder / "batch_cost.json").read_text())["1"] == 1.0


@pytest.mark.slow
def test_adaptive_phase(tmp_path):
    out, _ = _smoke("adaptive", tmp_path)
    summary = json.loads((out / "adaptive_gamma" / "summary.json").read_text())
    assert summary and "adaptive / best fixed" in (out / "adaptive.txt").read_text()


@pytest.mark.slow
def test_lookahead_phase(tmp_path):
    out, _ = _smoke("lookahead", tmp_path)
    text = (out / "lookahead_llama-tiny_w3_n3_fast.txt").read_text()
    assert "(fast decode path), W=3, N=3, n=2" in text and "speedup median" in text


def test_an_unknown_phase_is_refused(tmp_path):
    res = subprocess.run(["bash", "benchmarks/gpu_bench.sh", "nonsense", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "unknown phase nonsense" in res.stderr
