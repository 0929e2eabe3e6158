"""benchmarks/bench_runtime.py explains itself: α's interval and the problems it needs, predictions with
the independently measured b(k), no speedup for a failed method, the same prefix-cache state for all."""
from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
from _scripts import benchmark_script

from specprobe.infer import bench
from specprobe.infer.decoding import RunStats
from specprobe.infer.decoding.analytic import predict
from specprobe.inputs.records import BenchSourceConfig
from specprobe.probes.metrics import wilson_interval
from specprobe.train.config import load_config

REPO = Path(__file__).resolve().parents[1]


br = benchmark_script("bench_runtime")


def test_wilson_interval():
    lo, hi = br.wilson_interval(60, 100)
    assert lo == pytest.approx(0.502, abs=1e-3) and hi == pytest.approx(0.691, abs=1e-3)
    assert br.wilson_interval(0, 0) is None
    lo0, hi0 = br.wilson_interval(0, 20)
    assert lo0 == 0.0 and 0 < hi0 < 0.2
    # the positions_needed count gives a half-width of about the target
    n = br.positions_needed(0.6, 0.05)
    lo, hi = br.wilson_interval(round(0.6 * n), n)
    assert (hi - lo) / 2 == pytest.approx(0.05, abs=0.002)


def test_acceptance_interval_resamples_problems():
    # one problem: only its judged positions can be resampled (Wilson); none judged: no interval
    assert bench.acceptance_interval([(3, 4)]) == (wilson_interval(3, 4), "positions")
    assert bench.acceptance_interval([(0, 0), (3, 4)]) == (wilson_interval(3, 4), "positions")
    assert bench.acceptance_interval([(0, 0)]) == (None, None)
    # four problems, 20 of 40 positions accepted: all-or-nothing problems leave the pooled rate far less certain
    # than 40 independent positions would; identical problems leave it at 0.5 in every resample
    (lo, hi), over = bench.acceptance_interval([(10, 10), (0, 10), (10, 10), (0, 10)])
    w_lo, w_hi = wilson_interval(20, 40)
    assert over == "problems" and lo < w_lo and hi > w_hi and 0.0 <= lo < 0.5 < hi <= 1.0
    # identical problems: every resample is 0.5, so the interval is Wilson's over the 4 problems at that rate
    assert bench.acceptance_interval([(5, 10)] * 4) == (wilson_interval(2, 4), "problems (Wilson: one rate in every unit)")


def test_speedup_interval_draws_each_problems_two_latencies_together():
    """The pooled speedup's interval resamples problems (or whole families) with both their latencies: a method
    exactly twice as fast on every problem, however long, is 2.0 in every resample; drawn apart, the problems'
    different lengths would spread it."""
    base, mine = [1.0, 2.0, 3.0, 4.0], [0.5, 1.0, 1.5, 2.0]
    assert bench.speedup_interval(base, mine) == ((2.0, 2.0), "problems")
    (lo, hi), over = bench.speedup_interval([1.0] * 6, [0.5, 1.0, 2.0, 0.5, 1.0, 2.0])
    assert over == "problems" and lo < 6 / 7 < hi and 0.5 < lo and hi < 2.0
    # two families of four: exactly the interval of the families pooled, wider than drawing the eight problems;
    # one family (or one problem): none
    fam = bench.speedup_interval([1.0] * 8, [0.5] * 4 + [2.0] * 4, ["a"] * 4 + ["b"] * 4)
    assert fam == (bench.speedup_interval([4.0, 4.0], [2.0, 8.0])[0], "families") and fam[0] == (0.5, 2.0)
    (p_lo, p_hi), _ = bench.speedup_interval([1.0] * 8, [0.5] * 4 + [2.0] * 4)
    assert 0.5 < p_lo < p_hi < 2.0
    assert bench.speedup_interval(base, mine, ["t"] * 4) == (None, "none: every problem is of one family")
    assert bench.speedup_interval([1.0], [0.5]) == (None, None)
    with pytest.raises(ValueError, match="3 baseline latencies for 2 problems"):
        bench.speedup_interval([1.0] * 3, [1.0] * 2)
    # each problem alone: its own ratio, then their median and range
    # (the median of 3 draws is the smallest ratio with chance 7/27 and the largest too: both ends of its interval)
    assert bench.per_problem_speedups([1.0, 2.0, 9.0], [1.0, 1.0, 1.0]) == {"median": 2.0, "min": 1.0, "max": 9.0,
                                                                             "median_ci95": (1.0, 9.0),
                                                                             "ratios": [1.0, 2.0, 9.0]}


def test_acceptance_interval_resamples_whole_families():
    """Problems of one template rise and fall together: the interval draws whole families, so two families of eight
    problems give exactly the interval of the two families pooled, wider than drawing the sixteen problems."""
    counts = [(9, 10), (8, 10)] * 4 + [(1, 10), (2, 10)] * 4  # two templates, eight problems each
    families = ["t1"] * 8 + ["t2"] * 8
    (lo, hi), over = bench.acceptance_interval(counts, families)
    assert over == "families" and (lo, hi) == bench.acceptance_interval([(68, 80), (12, 80)])[0] == (0.15, 0.85)
    (p_lo, p_hi), p_over = bench.acceptance_interval(counts)
    assert p_over == "problems" and 0.15 + 0.1 < p_lo < 0.5 < p_hi < 0.85 - 0.1
    # a problem without a family is its own; no two sharing one: the draws are the problems'
    own = [f"t{i}" for i in range(16)]
    own[3] = own[9] = None
    (o_lo, o_hi), o_over = bench.acceptance_interval(counts, own)
    assert o_over == "problems" and 0.15 + 0.1 < o_lo < 0.5 < o_hi < 0.85 - 0.1
    # one family: resampling one unit says nothing; problems that judged nothing are not drawn
    assert bench.acceptance_interval(counts[:4], ["t"] * 4) == (None, "none: every problem is of one family")
    assert bench.acceptance_interval([(0, 0), (3, 4)], ["a", "b"]) == (wilson_interval(3, 4), "positions")
    # none accepted (or all): every resample is 0 (or 1), so the interval is Wilson's over the units, not a point
    assert bench.acceptance_interval([(0, 10)] * 4, ["a", "a", "b", "c"]) == (
        (0.0, wilson_interval(0, 3)[1]), "families (Wilson: one rate in every unit)")
    assert bench.acceptance_interval([(10, 10)] * 4) == ((wilson_interval(4, 4)[0], 1.0),
                                                         "problems (Wilson: one rate in every unit)")
    # a family named like a problem's place is still a family (units are not names)
    (lo, hi), over = bench.acceptance_interval([(9, 10), (1, 10), (8, 10)], ["problem 1", None, "problem 1"])
    assert over == "families" and (lo, hi) == bench.acceptance_interval([(17, 20), (1, 10)])[0]
    with pytest.raises(ValueError, match="2 families for 16 problems"):
        bench.acceptance_interval(counts, ["a", "b"])


def test_the_warm_up_runs_past_eos_to_max_steps(monkeypatch):
    """A real model answers the warm-up question in a few steps; its steps then run past EOS (as system-speed
    runs do), so every buffer length a timed problem reaches is warmed; the timed run still stops at EOS."""
    from _toy_engine import ToyEngine

    class Engine(ToyEngine):  # what the bench asks of an engine beyond the toy's decoding
        model_name = "toy"

        def clear_prefix_cache(self):
            pass

        def with_token_spec(self, spec, assistant=None):
            return self

    target, draft = Engine("target", eos_weight=80), Engine("draft", eos_weight=80)
    setup = load_config(REPO / "configs" / "tiny.yaml", ["runtime.max_steps=6", "runtime.max_new_tokens=2000", "bench.warmup=true"]).bench_setup()
    env = bench.prepare(setup, verifier="bernoulli", engines=(target, draft),
                        problems=[bench.Problem("p", bench.WARMUP_QUESTION, None)])
    gens, run = [], bench.decode_question
    monkeypatch.setattr(bench, "decode_question", lambda *args: gens.append(run(*args)) or gens[-1])
    specs = bench.method_specs(["target", "lr_sync"])
    logged: list[str] = []
    results = bench.warm_up(env, specs, log=logged.append)
    assert not any(r.error for r in results.values())
    assert [line.split(":")[0] for line in logged] == ["  warm-up 1/2 target", "  warm-up 2/2 lr_sync"]  # not silent
    assert [len(g.steps) for g in gens] == [6, 6] and all(g.stop_reason == "max_steps" for g in gens)
    assert target.text.stop_at_eos and draft.text.stop_at_eos  # as they were
    gens.clear()
    bench.run_problems(env, specs, results, log=lambda line: None)  # the same question, timed: EOS ends it
    assert [g.stop_reason for g in gens] == ["eos", "eos"] and all(len(g.steps) < 6 for g in gens)


def test_judged_per_step_matches_simulated_sync_cycles():
    rng = random.Random(0)
    for alpha, gamma in ((0.6, 3), (0.9, 2), (0.3, 4)):
        judged = committed = 0
        for _ in range(40000):
            j = 0
            while j < gamma and rng.random() < alpha:
                j += 1
            judged += min(j + 1, gamma)  # positions up to the first failure, or all γ
            committed += j + 1  # accepted drafts plus the target's (or bonus) step
        assert judged / committed == pytest.approx(br.judged_per_step(alpha, gamma), abs=0.01)
    assert br.problems_needed(0.6, 3, 24, 0.05) == 18  # ceil(369 / (0.90 * 24))
    assert br.problems_needed(0.6, 3, 48, 0.05) == 9
    with pytest.raises(ValueError, match="half_width"):
        br.positions_needed(0.5, 0)


def _row(method, **kw):
    row = {"method": method, "error": None, "acceptance": 0.6, "judged": 100, "c": 0.1, "b": 1.1, "k": 4,
           "speedup": 1.2, "analytic_ideal": 1.7, "analytic_adjusted": 1.25, "stats": {"accepted": 60}}
    return row | kw


def test_predictions_use_the_independent_batch_cost():
    b_of_k = {1: 1.0, 2: 1.2, 3: 1.5, 4: 2.0}
    for method in ("lr_sync", "lr_async"):
        got = br.predict_with_batch_cost(_row(method), 3, b_of_k)
        assert got == pytest.approx(predict(method, 0.6, 0.1, 3, 2.0)["adjusted"])
        assert got != pytest.approx(predict(method, 0.6, 0.1, 3, 1.1)["adjusted"])  # not the run's own b
    assert br.predict_with_batch_cost(_row("draft"), 3, b_of_k) is None
    rows = br.explained_rows({"rows": [_row("target", speedup=1.0), _row("lr_sync")]}, 3, b_of_k)
    (r,) = rows
    assert r["over_b_k"] == pytest.approx(1.2 / predict("lr_sync", 0.6, 0.1, 3, 2.0)["adjusted"])
    assert r["over_ideal"] == pytest.approx(1.2 / 1.7)
    assert r["alpha_ci"] == pytest.approx(br.wilson_interval(60, 100))  # a report without the run's interval
    assert "0.60 [0.50, 0.69]" in br.format_explained(rows, 3, b_of_k)
    # the run's own interval (by problem), as the run's table gives it: one α, one interval
    (r,) = br.explained_rows({"rows": [_row("target", speedup=1.0), _row("lr_sync", acceptance_ci95=[0.4, 0.8])]},
                             3, b_of_k)
    assert r["alpha_ci"] == [0.4, 0.8]


def test_failed_methods_get_no_speedup():
    b_of_k = {4: 2.0}
    report = {"rows": [_row("target", speedup=1.0), _row("lr_sync", error="RuntimeError: boom"), _row("lr_async")]}
    failed, ok = br.explained_rows(report, 3, b_of_k)
    assert failed["speedup"] is None and failed["over_b_k"] is None and "boom" in failed["error"]
    assert ok["speedup"] == 1.2
    text = br.format_explained([failed, ok], 3, b_of_k)
    assert "| lr_sync | failed: RuntimeError: boom |" in text
    report["rows"][0]["error"] = "RuntimeError: baseline died"
    failed, ok = br.explained_rows(report, 3, b_of_k)
    assert failed["speedup"] is None and ok["speedup"] is None and "baseline failed" in ok["error"]


def _stats(latency):
    st = RunStats()
    st.problems, st.latency_s, st.target_time_s, st.target_rows, st.target_iterations = 1, latency, latency, 4, 4
    return st


def _summary_env(problems):
    """What `bench.summarize` reads of a run (tiny.yaml's settings, system-speed, no checkpoint)."""
    cfg = load_config(REPO / "configs" / "tiny.yaml", [])
    return SimpleNamespace(setup=cfg.bench_setup(), opts=bench.options_from_config(cfg.bench_setup()),
                           verifier_kind="bernoulli", system_speed=True, checkpoint=None,
                           target=SimpleNamespace(model_name="t"), draft=SimpleNamespace(model_name="d"),
                           problems=problems, trained_on=[])


def test_the_report_draws_alpha_over_the_problems_families():
    """Each problem's family travels from its counts to the row's intervals, the report and its notes."""
    problems = [bench.Problem(f"p{i}", "Q?", "1", f"t{i // 2}") for i in range(4)]  # two templates, two each
    env = _summary_env(problems)
    results = {label: bench.MethodResult(bench.parse_method(label)) for label in ("target", "lr_sync")}
    for res in results.values():
        res.stats, res.latencies, res.answered = _stats(2.0), [2.0] * 4, 4
    results["lr_sync"].counts = [bench.ProblemCounts(a, 10, a, 8, p.family, a // 5)
                                 for a, p in zip((9, 8, 2, 1), problems)]  # the first template's two solved
    results["lr_sync"].correct = 2
    results["target"].counts = [bench.ProblemCounts(0, 0, 0, 0, p.family, 0) for p in problems]  # none solved
    report = bench.summarize(env, results)
    row = next(r for r in report["rows"] if r["method"] == "lr_sync")
    assert (row["acceptance_ci95_resamples"], row["decided_acceptance_ci95_resamples"]) == ("families", "families")
    assert row["acceptance_ci95"] == bench.acceptance_interval([(17, 20), (3, 20)])[0]
    assert report["families"] == {"p0": "t0", "p1": "t0", "p2": "t1", "p3": "t1"}
    text = bench.format_markdown(report)
    assert "95% intervals draw whole families (2 units for 4 problems" in text
    assert "α's intervals drew: lr_sync families." in text
    # pass@1 too: solved or missed by template, the two templates are the draws (not a Wilson over 4 problems)
    assert row["pass@1"] == 0.5 and row["pass@1_ci95_resamples"] == "families"
    assert row["pass@1_ci95"] == bench.acceptance_interval([(2, 2), (0, 2)])[0] == (0.0, 1.0)
    assert "pass@1's intervals drew: target families (Wilson: one rate in every unit); lr_sync families." in text


def test_pass_at_1_leaves_out_problems_without_a_reference_answer(tmp_path, caplog):
    """A problems file with answers under a field probe-bench does not read: a warning naming how many, and
    pass@1 over the graded problems only (n/a when none is), not 0 for every method."""
    src = tmp_path / "mine.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in [{"question": "1+1?", "gt": "2"}, {"question": "2+2?", "answer": "4"},
                                                     {"question": "3+3?", "gt": "6"}]))
    with caplog.at_level("WARNING"):
        problems = bench.load_problems(BenchSourceConfig(kind="jsonl", path=str(src)), 5)
    assert [p.answer for p in problems] == [None, "4", None]
    assert "2 of 3 problems have no reference answer" in caplog.text and "first: mine-0" in caplog.text
    env = _summary_env(problems)
    results = {label: bench.MethodResult(bench.parse_method(label)) for label in ("target", "draft")}
    for res in results.values():
        res.stats, res.latencies, res.answered = _stats(2.0), [2.0] * 3, 3
        res.counts = [bench.ProblemCounts(0, 0, 0, 0, None, int(p.answer == "4"), int(p.answer is not None))
                      for p in problems]
        res.correct = 1
    results["draft"].counts[1] = results["draft"].counts[1]._replace(correct=0)
    results["draft"].correct = 0
    report = bench.summarize(env, results)
    rows = {r["method"]: r for r in report["rows"]}
    assert (rows["target"]["pass@1"], rows["draft"]["pass@1"], rows["target"]["graded"]) == (1.0, 0.0, 1)
    assert rows["target"]["pass@1_ci95"] == wilson_interval(1, 1)  # one graded problem, not three
    assert "pass@1 is over the problems with a reference answer: target 1 of 3; draft 1 of 3." in \
        bench.format_markdown(report)
    # the report says whether timing began warm (tiny.yaml warms up)
    assert report["warmup"] is True and "No warm-up" not in bench.format_markdown(report)
    assert "No warm-up (bench.warmup=false)" in bench.format_markdown({**report, "warmup": False})
    for res in results.values():  # no problem graded: n/a
        res.counts = [c._replace(graded=0, correct=0) for c in res.counts]
        res.correct = 0
    assert all(r["pass@1"] is None for r in bench.summarize(env, results)["rows"])


def test_the_per_problem_median_has_an_interval_over_the_problems_or_their_families():
    base, mine = [2.0, 4.0, 6.0, 8.0], [1.0, 4.0, 2.0, 8.0]  # ratios 2, 1, 3, 1
    spread = bench.per_problem_speedups(base, mine)
    assert spread["ratios"] == [2.0, 1.0, 3.0, 1.0] and spread["median"] == 1.5
    lo, hi = spread["median_ci95"]
    assert 1.0 <= lo <= 1.5 <= hi <= 3.0 and lo < hi
    assert bench.per_problem_speedups([2.0] * 4, [1.0] * 4)["median_ci95"] == (2.0, 2.0)  # one ratio: a point
    # every problem of one template: one unit, no interval; two templates: drawn as two
    assert bench.per_problem_speedups(base, mine, ["t"] * 4)["median_ci95"] is None
    assert bench.per_problem_speedups(base, mine, ["a", "a", "b", "b"])["median_ci95"] is not None


def test_only_methods_that_judge_with_a_checkpoint_read_it():
    """What decides whether a run's problems are checked against the checkpoint's training split."""
    specs = bench.method_specs
    assert not bench.reads_checkpoint(specs(["target", "draft"]), "probe")  # (target-only is always added)
    assert not bench.reads_checkpoint(specs(["lr_sync", "semanticspec"]), "exact")
    assert bench.reads_checkpoint(specs(["lr_sync:verifier=embedding"]), "exact")
    assert bench.reads_checkpoint(specs(["semanticspec"]), "judge")


def test_summary_gives_no_speedup_to_a_method_that_failed_mid_run():
    env = _summary_env([])
    results = {label: bench.MethodResult(bench.parse_method(label)) for label in ("target", "lr_sync", "lr_async")}
    for res in results.values():
        res.stats, res.latencies, res.answered = _stats(2.0), [2.0, 2.0], 2
    results["lr_sync"].latencies, results["lr_sync"].error = [1.0], "RuntimeError: failed on p2"
    rows = {r["method"]: r for r in bench.summarize(env, results)["rows"]}
    assert rows["lr_sync"]["speedup"] is None and rows["lr_async"]["speedup"] == pytest.approx(1.0)
    results["target"].error = "RuntimeError: failed on p2"
    rows = {r["method"]: r for r in bench.summarize(env, results)["rows"]}
    assert all(r["speedup"] is None for r in rows.values())


@pytest.mark.slow
def test_every_method_starts_with_the_same_prefix_cache_state():
    """Target-only run after another method on the same question reuses none of its prompt prefill."""
    cfg = load_config(REPO / "configs" / "tiny.yaml", [
        "bench.system_speed=true", "bench.system_target=random:llama-20m", "bench.system_draft=random:llama-tiny",
        "models.device=cpu", "runtime.max_steps=2", "sampling.max_step_tokens=4", "bench.num_problems=1"])
    env = bench.prepare(cfg.bench_setup())
    question = env.problems[0].question
    target = bench.parse_method("target")
    work = {"prefill_tokens": 0, "reused_prefix_tokens": 0}
    generate = env.target.generate

    def counting_generate(requests, params):
        out = generate(requests, params)
        for key in work:
            work[key] += getattr(out.stats, key)
        return out

    env.target.generate = counting_generate

    def prefill_and_reuse(spec):
        before = dict(work)
        bench.decode_question(env, spec, question)
        return {k: work[k] - before[k] for k in work}

    cold = prefill_and_reuse(target)
    prefill_and_reuse(bench.parse_method("lr_sync"))
    again = prefill_and_reuse(target)
    assert again == cold and cold["prefill_tokens"] > 0


def test_forward_batch_cost_times_the_decode_step_on_k_row_buffers():
    """b(k) of the decode forward alone: the fast path's own step on a buffer of each k's slot bucket, every timed
    forward run on it (the write offset moves one column a forward), b(1) = 1; as a batch runs it (no autograd:
    a pooled buffer a batch left is taken and given back intact); the eager path has no such step."""
    from specprobe.infer.engines import HFStepEngine, Prefix, SamplingParams, StepRequest

    fast = HFStepEngine("random:llama-tiny", device="cpu", dtype="float32", decode="fast")
    fast.generate([StepRequest(Prefix("What is 2 + 3?"))], SamplingParams(temperature=0.0, max_step_tokens=4))
    (left,) = fast.kv_pool.free  # the 1-slot buffer the batch gave back, its tensors made in inference mode
    b = br.forward_batch_cost(fast, [1, 3, 4], columns=left.columns, forwards=3, repeats=5)
    assert set(b) == {1, 3, 4, "seconds_per_forward"} and b[1] == 1.0
    assert all(v > 0 for v in b.values())
    shapes = sorted((kv.slots, kv.columns, int(kv.layers[0].cumulative_length)) for kv in fast.kv_pool.free)
    # k = 1 took the batch's buffer; k = 3 and 4 share the 4-slot bucket's; 1 untimed + 5 x 3 timed forwards
    # fill the last 16 columns of each
    c = left.columns
    assert shapes == [(1, c, c), (4, c, c)] and fast.kv_pool.created == 2
    assert not any(kv.layers[0].keys.requires_grad for kv in fast.kv_pool.free)  # no autograd graph kept
    with pytest.raises(ValueError, match="cannot hold 16 timed decode steps"):
        br.forward_batch_cost(fast, [1], columns=16, forwards=3)
    eager = HFStepEngine("random:llama-tiny", model=fast.model, tokenizer=fast.tokenizer, decode="eager")
    assert br.forward_batch_cost(eager, [1, 2]) is None


def test_the_speedup_figure_draws_each_problems_ratio_beside_the_pooled_one(tmp_path):
    """speedup.png: every method but the baseline, each problem's own ratio (target-only latency / the method's),
    the pooled speedup and its interval; a failed method (no speedup) is left out, and so is a report without one."""
    from specprobe.infer.bench_plot import FIGURE, speedup_figure, speedup_points, write_speedup_figure

    spread = bench.per_problem_speedups([2.0, 4.0, 6.0], [1.0, 4.0, 2.0])
    assert {k: v for k, v in spread.items() if k != "median_ci95"} == {"median": 2.0, "min": 1.0, "max": 3.0,
                                                                        "ratios": [2.0, 1.0, 3.0]}
    report = {"system_speed": True, "rows": [
        {"method": "target", "latencies_s": [2.0, 4.0, 6.0], "speedup": 1.0, "speedup_per_problem": None},
        {"method": "lr_sync", "latencies_s": [1.0, 4.0, 2.0], "speedup": 12 / 7, "speedup_ci95": [1.0, 3.0],
         "speedup_per_problem": spread},
        {"method": "semanticspec", "latencies_s": [1.0], "speedup": None, "error": "boom",
         "speedup_per_problem": None}]}
    assert speedup_points(report) == [("lr_sync", [2.0, 1.0, 3.0], 2.0, 12 / 7, (1.0, 3.0))]
    fig = speedup_figure(report)
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["lr_sync"]
    drawn = sorted(x for c in ax.collections for x in c.get_offsets()[:, 0])
    assert drawn == pytest.approx(sorted([2.0, 1.0, 3.0, 12 / 7, 2.0]))  # problems, pooled, median
    path = write_speedup_figure(report, tmp_path)
    assert path == tmp_path / FIGURE and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert write_speedup_figure({"rows": report["rows"][:1]}, tmp_path / "none") is None
    bench.start_out_dir(tmp_path, bench.method_specs(["target"]))  # a new run: no earlier run's figure beside it
    assert not path.exists()
