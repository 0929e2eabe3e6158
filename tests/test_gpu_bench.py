"""benchmarks/gpu_bench.sh runs: every phase's commands, on the CPU with tiny random models (SMOKE=1) and the fast
decode path the GPU uses, finish and write what the results README is built from. A GPU is lent for 30 minutes
now and then; a command that breaks there costs the session's measurements."""
from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from _scripts import benchmark_script

REPO = Path(__file__).resolve().parents[1]
KNOBS = ("MODELS", "PROBLEMS", "STEPS", "GAMMA", "RUNTIME_S", "METHODS", "DECODE", "GRAPH", "DRAFT_GRAPH", "LIMITS",
         "TARGET", "SCENARIOS", "ADAPTIVE_METHODS", "GAMMAS", "SKIP", "QUESTIONS", "SMOKE", "SEED",
         "TARGET_PRIORITY", "FUSED_NORM", "MERGED_LINEAR", "CAPTURE_JOINS", "CHECK_MODEL")  # what gpu_bench.sh reads


def _env(**settings: str) -> dict:
    """The shell's environment without its own gpu_bench settings (they must not leak in), plus `settings`."""
    return {k: v for k, v in os.environ.items() if k not in KNOBS} | settings


def _smoke(phase: str, tmp_path: Path, rc: int = 0, **extra: str) -> tuple[Path, str]:
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps({"id": f"q{i}", "question": f"What is {i + 3} times {i + 7}?",
                                             "answer": str((i + 3) * (i + 7))}) + "\n" for i in range(4)))
    out = tmp_path / "out"
    res = subprocess.run(["bash", "benchmarks/gpu_bench.sh", phase, str(out)], cwd=REPO,
                         env=_env(SMOKE="1", DECODE="fast", QUESTIONS=str(questions), **extra),
                         capture_output=True, text=True, timeout=600)
    assert (res.returncode == 0) == (rc == 0), res.stdout[-3000:] + res.stderr[-3000:]
    return out, res.stdout


@pytest.mark.slow
def test_engine_phase(tmp_path):
    out, _ = _smoke("engine", tmp_path, FUSED_NORM="off,on", MERGED_LINEAR="on")
    text = (out / "engine_llama-tiny.txt").read_text()
    assert "## decode fast" in text and "teacher-forced scoring" in text and "b(2)=" in text
    headers = [line for line in text.splitlines() if line.startswith("## decode fast")]
    assert len(headers) == 2 and "norm layers fused" not in headers[0] and ", 5 norm layers fused" in headers[1]
    assert all(", 4 linear groups merged: warm-up" in h for h in headers)  # MERGED_LINEAR=on, in both
    forward = next(line for line in text.splitlines() if line.startswith("batch cost of the decode forward alone"))
    assert "b(1)=1.000, b(2)=" in forward  # issue 20's b(k): the decode forward without the join
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2"] * 2 and all(float(r[1]) > 0 for r in rows)  # off, then on
    assert all(len(r) == 7 and float(r[5]) > 0 for r in rows)  # the time to the first token, then the decode rate


@pytest.mark.slow
def test_engine_bench_measures_each_graph_mode_on_the_same_weights():
    res = subprocess.run(["python3", "benchmarks/bench_engine.py", "--model", "random:llama-tiny", "--tokens", "4",
                          "--repeats", "1", "--batches", "1", "--greedy", "--decode", "fast,eager",
                          "--graph", "none,compile", "--no-unshared"],
                         cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    headers = [line for line in res.stdout.splitlines() if line.startswith("## decode")]
    # one table per graph mode of the fast path (on the CPU the compiled step is called, not captured), one eager
    assert [h.split(":")[0] for h in headers] == ["## decode fast (none", "## decode fast (compile",
                                                  "## decode eager"]


class _ScriptedEngine:
    """An engine double on a scripted clock: a request costs `prefill` seconds for the prefix and its first token,
    then `per_token` seconds for each further token of all its rows at once."""

    def __init__(self, clock: list[float], prefill: float, per_token: float):
        self.clock, self.prefill, self.per_token = clock, prefill, per_token
        self.runner = SimpleNamespace(rows_hint=None, device=SimpleNamespace(type="cpu"))
        self.cleared = 0

    def clear_prefix_cache(self):
        self.cleared += 1

    def generate(self, requests, params):
        n = params.max_step_tokens
        self.clock[0] += self.prefill + self.per_token * (n - 1)
        return SimpleNamespace(steps=[[SimpleNamespace(num_tokens=n)] * requests[0].n])


def test_engine_bench_leaves_the_prefill_out_of_the_decode_rate(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # bench_engine imports bench_runtime as a sibling
    be = benchmark_script("bench_engine")
    clock = [0.0]
    monkeypatch.setattr(be, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    engine = _ScriptedEngine(clock, prefill=0.5, per_token=0.01)
    prefix = be.Prefix("What is 2 + 2?", ())
    rate, seconds, first, decode = be.time_sampling(engine, prefix, batch=2, tokens=11, repeats=3, greedy=True)
    assert seconds == pytest.approx(0.6) and rate == pytest.approx(22 / 0.6)  # the whole request, prefill in
    assert first == pytest.approx(0.5)
    assert decode == pytest.approx(2 / 0.01)  # 2 rows a token-step: the rows' 10 tokens after their first
    assert engine.cleared == 6 and engine.runner.rows_hint == 2  # every request encodes the prefix anew


@pytest.mark.slow
@pytest.mark.parametrize("phase,folder,draft_graph,seed,priority,fused",
                         [("runtime", "runtime_7b", None, None, None, None),
                          ("runtime32", "runtime_32b", "none", "3", "high", "on")])
def test_runtime_phases(tmp_path, phase, folder, draft_graph, seed, priority, fused):
    extra = ({"DRAFT_GRAPH": draft_graph} if draft_graph else {}) | ({"SEED": seed} if seed else {})
    extra |= {"FUSED_NORM": fused, "MERGED_LINEAR": fused, "CAPTURE_JOINS": "off"} if fused else {}
    out, _ = _smoke(phase, tmp_path, **extra, **({"TARGET_PRIORITY": priority} if priority else {}))
    res = json.loads((out / folder / "results.json").read_text())
    assert [r["method"] for r in res["rows"]] == ["target", "lr_sync", "lr_async", "semanticspec", "draft"]
    assert all(r["error"] is None and r["problems"] == 2 for r in res["rows"])
    assert res["config"]["models"]["decode"] == "fast" and res["models"]["target"] == "random:llama-tiny"
    assert res["config"]["models"]["draft_decode_graph"] == draft_graph  # DRAFT_GRAPH: the draft's alone
    assert res["config"]["runtime"]["seed"] == int(seed or 0)  # SEED: another draw of the acceptances
    assert res["config"]["models"]["target_stream_priority"] == (priority or "normal")  # TARGET_PRIORITY
    # FUSED_NORM: unset leaves the engine's default (auto: fused on CUDA only, so not in this CPU smoke)
    assert res["config"]["models"]["fused_norm"] == {"on": True, "off": False}.get(fused, "auto")
    log = (out / f"{folder}.txt").read_text()  # each model's decode mode, before and after the run
    assert (", 5 norm layers fused" in log) is (fused == "on")
    assert res["config"]["models"]["merged_linear"] == {"on": True}.get(fused, "auto")  # MERGED_LINEAR, likewise
    assert (", 4 linear groups merged" in log) is (fused == "on")
    assert res["config"]["models"]["capture_joins"] is (fused != "on")  # CAPTURE_JOINS=off beside them
    assert log.count("; draft decode fast (none: 0 captures") == 2 and "# after the run: target decode fast" in log
    assert "# loads and b(k) took " in log and " s since the start" in log  # where a run cut by its limit was
    assert json.loads((out / folder / "batch_cost.json").read_text())["1"] == 1.0
    with tarfile.open(out / f"{folder}.tgz") as packed:  # the folder whole in one archive, for the device's return
        assert {f"{folder}/results.json", f"{folder}/traces/target.jsonl"} <= set(packed.getnames())


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{}, {"SKIP": "1", "ADAPTIVE_METHODS": "semanticspec", "GAMMAS": "1",
                                       "TARGET_PRIORITY": "high"}])
def test_adaptive_phase(tmp_path, extra):
    out, _ = _smoke("adaptive", tmp_path, **extra)
    summary = json.loads((out / "adaptive_gamma" / "summary.json").read_text())
    assert "adaptive / best fixed" in (out / "adaptive.txt").read_text()
    with tarfile.open(out / "adaptive_gamma.tgz") as packed:
        assert "adaptive_gamma/summary.json" in packed.getnames()
    methods = {m for run in summary.values() for m in run["speedup_over_target"]}
    assert {run["accept_draws"] for run in summary.values()} == {"prefix"}  # as every earlier run
    assert "Acceptance draws keyed by prefix" in (out / "adaptive_gamma" / "summary.md").read_text()
    if extra:
        assert set(summary) == {"b_semanticspec"}
        assert methods == {"target", "semanticspec:gamma=1", "semanticspec:gamma=adaptive",
                           "semanticspec:gamma=adaptive:forecast_skip=true"}
        run = json.loads((out / "adaptive_gamma" / "b_semanticspec" / "results.json").read_text())
        assert run["config"]["models"]["target_stream_priority"] == "high"
    else:
        assert set(summary) == {"b_lr_sync", "b_semanticspec"} and "lr_sync:gamma=2" in methods


@pytest.mark.slow
def test_open_phase_goes_on_past_a_part_that_hits_its_limit(tmp_path):
    """The open issues' phase: a part stopped at its limit is noted in its file and the next parts run; a check that
    does not pass turns the captured joins off for the parts after it; the runtime's log is summarised at the end,
    finished or not; a limit of 0 skips a part."""
    out, _ = _smoke("open", tmp_path, LIMITS="300 300 300 300 300", CHECK_MODEL="random:no-such-shape")
    check = (out / "check.txt").read_text()
    assert "## stopped: exit" in check and "run the joins eagerly" in check  # (a model it cannot build: failed)
    summary = json.loads((out / "adaptive_gamma" / "summary.json").read_text())
    assert set(summary) == {"b_lr_sync"}  # issue 24's GPU run: lr_sync on the mixture, the 32B pair
    run = json.loads((out / "adaptive_gamma" / "b_lr_sync" / "results.json").read_text())
    assert run["config"]["models"]["capture_joins"] is False  # the failed check turned them off
    assert run["config"]["models"]["draft_decode_graph"] == "none"  # (compile on a GPU)
    with tarfile.open(out / "adaptive_gamma.tgz") as packed:
        assert "adaptive_gamma/summary.json" in packed.getnames()
    engine32, engine7 = (out / "engine32.txt").read_text(), (out / "engine7.txt").read_text()
    assert "stopped" not in engine32 + engine7 and "b(2)=" in engine7 and "b(2)=" not in engine32
    assert engine32.count("## decode fast") == 2 and engine7.count("## decode fast") == 2  # merged off, on
    assert "2 problems finished by every method" in (out / "runtime_summary.md").read_text()
    res = json.loads((out / "runtime_7b" / "results.json").read_text())
    assert [r["method"] for r in res["rows"]] == ["target", "lr_sync", "semanticspec", "draft"]
    (tmp_path / "second").mkdir()
    cut, _ = _smoke("open", tmp_path / "second", LIMITS="300 0 0 300 2")
    names = {p.name for p in cut.iterdir()}
    assert {"check.txt", "engine7.txt", "runtime_7b.txt", "runtime_summary.md"} <= names
    assert not names & {"adaptive.txt", "adaptive_gamma", "engine32.txt"}
    assert "stopped" not in (cut / "check.txt").read_text()
    assert (cut / "engine7.txt").read_text().count("## decode fast") == 4  # merged x captured joins, off and on
    (tmp_path / "cut_check").mkdir()  # a check cut by its limit is unchecked, not failed: the joins stay captured
    unchecked, _ = _smoke("open", tmp_path / "cut_check", LIMITS="1 0 0 0 0")
    check = (unchecked / "check.txt").read_text()
    assert "(124 = its 1 s limit)" in check and "unchecked" in check and "eagerly" not in check
    assert (cut / "runtime_7b.txt").read_text().rstrip().endswith("(124 = its 2 s limit)")
    assert "no problem finished" in (cut / "runtime_summary.md").read_text()
    (tmp_path / "third").mkdir()  # the runtime phases take the same limit (RUNTIME_S)
    cut, _ = _smoke("runtime", tmp_path / "third", RUNTIME_S="2")
    assert (cut / "runtime_7b.txt").read_text().rstrip().endswith("(124 = its 2 s limit)")
    assert "no problem finished" in (cut / "runtime_7b_summary.md").read_text()
    (tmp_path / "fourth").mkdir()  # a run that fails (not stopped at its limit) is summarised and fails the phase
    cut, _ = _smoke("runtime", tmp_path / "fourth", rc=1, RUNTIME_S="300", METHODS="target,no_such_method")
    assert "## stopped: exit" in (cut / "runtime_7b.txt").read_text()
    assert "no problem finished" in (cut / "runtime_7b_summary.md").read_text()


@pytest.mark.parametrize("seconds", ["0", "ten", "-5", "1.5"])
def test_runtime_phases_refuse_a_limit_they_cannot_read(tmp_path, seconds):
    res = subprocess.run(["bash", "benchmarks/gpu_bench.sh", "runtime", str(tmp_path)], cwd=REPO,
                         env=_env(SMOKE="1", RUNTIME_S=seconds), capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "RUNTIME_S" in res.stderr


@pytest.mark.parametrize("limits", ["0 0 0 0", "0 0 0 5 5 5", "0 0.5 0 0 0", "0 0 0 ten 0"])
def test_open_phase_refuses_limits_it_cannot_read(tmp_path, limits):
    res = subprocess.run(["bash", "benchmarks/gpu_bench.sh", "open", str(tmp_path)], cwd=REPO,
                         env=_env(SMOKE="1", LIMITS=limits), capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "LIMITS" in res.stderr


@pytest.mark.slow
def test_lookahead_phase(tmp_path):
    out, _ = _smoke("lookahead", tmp_path)
    text = (out / "lookahead_llama-tiny_w3_n3_fast.txt").read_text()
    assert "(fast decode path), W=3, N=3, n=2" in text and "speedup median" in text


@pytest.mark.parametrize("knob,words", [("FUSED_NORM", "auto, off, on or off,on"),
                                        ("MERGED_LINEAR", "auto, off, on or off,on"), ("CAPTURE_JOINS", "on, off or off,on")])
def test_a_swap_setting_it_cannot_read_is_refused_before_anything_runs(tmp_path, knob, words):
    res = subprocess.run(["bash", "benchmarks/gpu_bench.sh", "engine", str(tmp_path / "out")], cwd=REPO,
                         env=_env(SMOKE="1", **{knob: "yes"}), capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and f"{knob} takes {words}, got 'yes'" in res.stderr
    assert not (tmp_path / "out").exists()


def test_an_unknown_phase_is_refused(tmp_path):
    res = subprocess.run(["bash", "benchmarks/gpu_bench.sh", "nonsense", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "unknown phase nonsense" in res.stderr


def _summary(monkeypatch, header: str, lines: list[str]) -> str:
    """runtime_log_summary's text for a log of `header` (the verifier and γ), the b(k) line and `lines`."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from runtime_log_summary import summarize

    return summarize("\n".join([
        f"# runtime benchmark: target t, draft d, bfloat16, {header}, problems x 4 steps",
        "# target batch cost b(k) = ...: b(1)=1.00, b(2)=1.05, b(3)=1.08, b(4)=1.10  (1 row: 0.4 s/step)", *lines]))


def _cells(text: str, method: str) -> list[str]:
    row = next(line for line in text.splitlines() if line.startswith(f"| {method} "))
    return [c.strip() for c in row.strip("|").split("|")]


def test_runtime_log_summary_reads_an_unfinished_run(monkeypatch):
    """The GPU runs' speedups were read from logs whose report was never written: per-problem ratios over the
    problems every method finished, their median, the pooled ratio and c from the target-only and draft-only lines."""
    text = _summary(monkeypatch, "Bernoulli(0.6), γ=3, 3", [
        "  [1/3] target                   10.00s   100 tok  stop=max_steps      answer=None gold='1'",
        "  [1/3] lr_sync                   5.00s   100 tok  stop=max_steps      answer='x' gold='1'  accept=0.50",
        "  [1/3] draft                     2.00s   100 tok  stop=max_steps      answer=None gold='1'",
        "  [2/3] target                   12.00s   100 tok  stop=max_steps      answer=None gold='2'",
        "  [2/3] lr_sync                   8.00s   100 tok  stop=max_steps      answer=None gold='2'  accept=0.70",
        "  [2/3] draft                     3.00s   100 tok  stop=max_steps      answer=None gold='2'",
        "  [3/3] target                   11.00s   100 tok  stop=max_steps      answer=None gold='3'",
    ])
    assert "2 problems finished by every method (of 3 started); γ = 3, b(4) = 1.1, c = 0.227" in text
    cells = _cells(text, "lr_sync")
    assert cells[1] == "2.00 1.50" and cells[2] == "1.75 [1.50, 2.00]" and cells[3] == f"{22 / 13:.2f}"
    assert cells[4] == "0.60" and float(cells[5]) > 1 and abs(float(cells[6]) - 22 / 13 / float(cells[5])) < 0.02
    # the verifier's own α is the run's here: the formula at it is the run's, and the projection is the run
    assert cells[7] == cells[5] and cells[8] == cells[3]
    draft = _cells(text, "draft")
    assert draft[7] == draft[8] == "–"  # the draft alone does not depend on α


def test_runtime_log_summary_projects_a_lucky_draw_to_the_verifiers_alpha(monkeypatch):
    """A Bernoulli(0.5) verifier whose draws gave 0.6: the formula at 0.5 and the run's measured / predicted
    carried to it, which is below the run's own speedup."""
    from specprobe.infer.decoding.analytic import predict

    text = _summary(monkeypatch, "Bernoulli(0.5), γ=3, 1", [
        "  [1/1] target                   10.00s   100 tok  stop=max_steps      answer=None gold='1'",
        "  [1/1] semanticspec              6.00s   100 tok  stop=max_steps      answer=None gold='1'  accept=0.60",
        "  [1/1] draft                     1.00s   100 tok  stop=max_steps      answer=None gold='1'",
    ])
    assert "verifier Bernoulli(0.5)" in text.splitlines()[0]
    header = next(line for line in text.splitlines() if line.startswith("| method"))
    assert "predicted at α = 0.5" in header and "projected to α = 0.5" in header
    cells = _cells(text, "semanticspec")
    at_run = predict("semanticspec", 0.6, 0.1, 3)["ideal"]
    at_v = predict("semanticspec", 0.5, 0.1, 3)["ideal"]
    assert float(cells[5]) == pytest.approx(at_run, abs=0.006) and float(cells[7]) == pytest.approx(at_v, abs=0.006)
    assert float(cells[8]) == pytest.approx(at_v * (10 / 6) / at_run, abs=0.006) and float(cells[8]) < float(cells[3])


def test_runtime_log_summary_compares_adaptive_with_the_best_fixed_gamma(monkeypatch):
    """Issue 24's runs: adaptive against the fixed γ with the least total latency, pooled over the problems every
    method finished, with bench_adaptive_gamma's bootstrap interval."""
    rows = {"target": (10, 12), "lr_sync:gamma=1": (8, 9), "lr_sync:gamma=2": (6, 8), "lr_sync:gamma=adaptive": (5, 7)}
    text = _summary(monkeypatch, "Bernoulli(0.6), γ=3, 2", [
        f"  [{p + 1}/2] {m:24s} {t[p]:6.2f}s   100 tok  stop=max_steps      answer=None gold='1'  accept=0.50"
        for p in range(2) for m, t in rows.items()])
    from bench_adaptive_gamma import ratio_ci95

    low, high = ratio_ci95([6, 8], [5, 7])
    assert (f"lr_sync: adaptive / best fixed γ in hindsight (γ = 2), a ratio of speedups = that γ's latency / "
            f"adaptive's = 14.00 s / 12.00 s = 1.167 [{low:.3f}, {high:.3f}] (95% bootstrap over the 2 problems)"
            ) in text
    assert low <= 14 / 12 <= high


def test_runtime_log_summary_without_a_bernoulli_verifier_keeps_its_seven_columns(monkeypatch):
    """A real verifier has no α of its own to project to: no such columns, and the header names none."""
    text = _summary(monkeypatch, "verifier nli, γ=3, 1", [
        "  [1/1] target                   10.00s   100 tok  stop=max_steps      answer=None gold='1'",
        "  [1/1] lr_sync                   6.00s   100 tok  stop=max_steps      answer=None gold='1'  accept=0.60",
    ])
    assert "Bernoulli" not in text and "projected" not in text
    assert len(_cells(text, "lr_sync")) == 7 and _cells(text, "lr_sync")[5] == "–"  # no draft line: no c
