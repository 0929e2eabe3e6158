"""SpecS, SEED and Lookahead Decoding in the runtime and probe-bench: method names, config sections,
Lookahead Decoding in a real (tiny random) transformers engine's batches, and one small benchmark."""
from __future__ import annotations

import pytest
import torch

from specprobe.infer import bench
from specprobe.infer.engines import HFStepEngine, SamplingParams
from specprobe.infer.engines.base import Prefix, StepRequest
from specprobe.infer.engines.token_spec import LookaheadConfig, TokenSpecConfig
from specprobe.inputs.config import ConfigError
from specprobe.train.config import format_help, load_config

from _margins import assert_same_greedy


def test_method_names_and_config_sections():
    spec = bench.parse_method("target+lookahead")
    assert (spec.base, spec.token_spec) == ("target", "lookahead")
    assert bench.parse_method("specs:verifier=bernoulli:alpha=0.3").overrides == {"verifier": "bernoulli", "alpha": 0.3}
    with pytest.raises(ConfigError, match=r"\+lookahead"):
        bench.parse_method("target+jacobi")
    cfg = load_config(None, ["runtime.specs.tau=0.9", "runtime.tree.k_config=[1,1,1]", "runtime.lookahead.window=4"])
    assert cfg.runtime.specs.tau == 0.9 and cfg.runtime.tree.k_config == [1, 1, 1] and cfg.runtime.lookahead.window == 4
    for bad in ("runtime.specs.n=0", "runtime.tree.k_config=[2,0]", "runtime.lookahead.ngram=1"):
        with pytest.raises(ConfigError):
            load_config(None, [bad])
    help_text = format_help()
    assert "runtime.specs.tau" in help_text and "runtime.tree.k_config" in help_text
    assert "runtime.lookahead.window" in help_text


@pytest.fixture(scope="module")
def engines(one_thread):
    target = HFStepEngine("random:llama-20m", device="cpu", stop_at_eos=False)
    draft = HFStepEngine("random:llama-tiny", device="cpu", stop_at_eos=False)
    return target, draft


@pytest.mark.slow
def test_lookahead_in_the_engines_batches_writes_the_engines_greedy_steps(engines):
    target, _ = engines
    la = target.with_token_spec(TokenSpecConfig("lookahead", lookahead=LookaheadConfig(window=4, ngram=3)))
    params = SamplingParams(temperature=0.0, max_step_tokens=24)
    prefixes = [Prefix("What is 2 + 3? Count: 1 2 3 1 2 3 1 2 3"), Prefix("Say hello.")]
    plain = target.generate([StepRequest(p) for p in prefixes], params)
    mine = la.generate([StepRequest(p) for p in prefixes], params)
    for p, got, want in zip(prefixes, mine.steps, plain.steps):
        n = assert_same_greedy(target.model, target.prefix_ids(p), got[0].token_ids, want[0].token_ids, at_least=8)
        if n == want[0].num_tokens:  # no near-tie: where the step stopped is the same too
            assert got[0].stop_reason == want[0].stop_reason
    # every row-iteration writes one token plus the proposals it accepted
    assert mine.stats.spec_accepted > 0 and mine.stats.row_iterations < plain.stats.row_iterations
    assert mine.stats.row_iterations + mine.stats.spec_accepted >= mine.stats.generated_tokens
    # the step's log-probability is the model's log-probability of its own tokens
    ids, toks = target.prefix_ids(prefixes[0]), mine.steps[0][0].token_ids
    with torch.inference_mode():
        lsm = torch.log_softmax(target.model(torch.tensor([ids + toks])).logits[0, len(ids) - 1:-1].float(), -1)
    assert mine.steps[0][0].logprob == pytest.approx(float(lsm[torch.arange(len(toks)), torch.tensor(toks)].sum()),
                                                     abs=1e-2)
    # continuing the same answer (from the KV its step kept) writes the engine's own next step
    after = prefixes[1].extend(mine.steps[1][0])
    nxt = la.generate([StepRequest(after)], params).steps[0][0]
    ref = target.generate([StepRequest(after)], params).steps[0][0]
    assert_same_greedy(target.model, target.prefix_ids(after), nxt.token_ids, ref.token_ids, at_least=4)


@pytest.mark.slow
def test_bench_runs_the_three_methods_with_their_baselines(engines, tmp_path):
    cfg = load_config(None, ["runtime.max_new_tokens=16", "runtime.max_steps=3", "sampling.max_step_tokens=4",
                             "runtime.specs.n=2", "runtime.tree.thoughts=2", "runtime.tree.depth=2",
                             "runtime.tree.k_config=[2,1]", "runtime.tree.threaded=false",
                             "runtime.lookahead.window=3", "runtime.lookahead.ngram=3", "bench.warmup=false"])
    env = bench.prepare(cfg.bench_setup(), engines=engines, system_speed=True,
                        problems=[bench.Problem("p0", "What is 2 + 3?", "5")])
    report = bench.run_benchmark(env, ["specs", "seed_tot", "target+lookahead"], out_dir=tmp_path, log=lambda s: None)
    rows = {r["method"]: r for r in report["rows"]}
    assert set(rows) == {"target", "specs", "seed_tot", "target+lookahead", "beam_target", "tot_target"}
    assert all(r["error"] is None for r in rows.values()), {k: r["error"] for k, r in rows.items()}
    assert rows["specs"]["baseline"] == "beam_target" and rows["specs"]["speedup_vs_baseline"] > 0
    assert rows["seed_tot"]["speedup_vs_baseline"] > 0 and rows["seed_tot"]["acceptance"] is not None
    for name in ("specs", "seed_tot"):  # a search method is measured against its own search baseline
        row = rows[name]
        assert row["analytic_ideal"] is not None and row["formula"] not in ("baseline", "search baseline")
        assert row["measured_over_ideal"] == pytest.approx(row["speedup_vs_baseline"] / row["analytic_ideal"])
    assert rows["target+lookahead"]["analytic_ideal"] >= 1.0  # tokens per target forward
    # the ratio over its own baseline per problem, as the speedup over target-only has it (one problem: no interval)
    each = rows["specs"]["speedup_vs_baseline_per_problem"]
    beam, specs = rows["beam_target"]["latency_total_s"], rows["specs"]["latency_total_s"]
    assert each["ratios"] == [pytest.approx(beam / specs)] and rows["specs"]["speedup_vs_baseline_ci95"] is None
    text = (tmp_path / "results.md").read_text()
    assert f"specs over its own baseline beam_target (same run): {rows['specs']['speedup_vs_baseline']:.2f}×" in text


def test_predictions_of_the_search_methods():
    from specprobe.infer.decoding.metrics import RunStats
    from specprobe.infer.decoding.seed import seed_predicted_speedup
    from specprobe.infer.decoding.specs import specs_predicted_speedup
    from specprobe.probes.speedup import token_sd_speedup

    st = RunStats(target_calls=2, draft_calls=6, target_time_s=4.0, draft_time_s=1.2, score_time_s=0.6)
    for i in range(8):
        st.record_position(0, i >= 2)  # 6 of 8 rounds drafted
    rho = (1.8 / 6) / (4.0 / 2)
    assert specs_predicted_speedup(st)["ideal"] == pytest.approx(1 / (0.25 + 0.75 * rho))
    sd = RunStats(draft_forward_passes=30, target_forward_passes=10, draft_time_s=3.0, target_time_s=10.0)
    for a in (3, 1, 0, 2):  # accepted tokens per round, tree depth 3
        for i in range(min(a + 1, 3)):
            sd.record_position(i, i < a)
    alpha = sd.acceptance_rate
    assert alpha == pytest.approx(6 / 9)
    assert seed_predicted_speedup(sd, (2, 2, 1))["ideal"] == pytest.approx(float(token_sd_speedup(alpha, 0.1, 3)))


@pytest.mark.slow
def test_token_speculation_is_chosen_per_method_not_left_in_the_engines(engines, tmp_path):
    """+ngram speculates in its own generations only, in the engine that writes the steps (the draft for
    draft+ngram, whose counters are reported too): the methods after it propose nothing, and the shared engines
    carry no token speculation afterwards."""
    cfg = load_config(None, ["runtime.max_new_tokens=24", "runtime.max_steps=3", "sampling.max_step_tokens=8",
                             "bench.warmup=false", "runtime.num_speculative_tokens=4", "runtime.ngram_size=2"])
    env = bench.prepare(cfg.bench_setup(), engines=engines, system_speed=True,
                        problems=[bench.Problem("p0", "Count: 1 2 3 1 2 3 1 2 3 1 2 3", None)])
    report = bench.run_benchmark(env, ["target+ngram", "lr_sync", "lr_sync+ngram", "draft+ngram", "draft"],
                                 out_dir=tmp_path, log=lambda s: None)
    proposed = {r["method"]: r["stats"]["spec_proposed"] for r in report["rows"]}
    assert proposed["target+ngram"] > 0 and proposed["lr_sync+ngram"] > 0 and proposed["draft+ngram"] > 0
    assert proposed["target"] == 0 and proposed["lr_sync"] == 0 and proposed["draft"] == 0
    assert env.target.token_spec is None and env.draft.token_spec is None


def test_a_grader_failure_is_logged_and_the_run_goes_on(engines, tmp_path, monkeypatch):
    """A GPU box once lacked math-verify: the grader's ImportError on the fifth problem lost every timing of a 7-minute
    run. The problem now counts as not correct, the log says why, and the report keeps every problem."""
    def broken_grade(text, gold):
        raise ImportError("No module named 'math_verify'")

    monkeypatch.setattr(bench, "grade", broken_grade)
    cfg = load_config(None, ["runtime.max_new_tokens=8", "runtime.max_steps=1", "sampling.max_step_tokens=4",
                             "bench.warmup=false"])
    env = bench.prepare(cfg.bench_setup(), engines=engines, system_speed=True,
                        problems=[bench.Problem(f"p{i}", f"What is {i} + 1?", str(i + 1)) for i in range(2)])
    lines: list[str] = []
    report = bench.run_benchmark(env, ["target"], out_dir=tmp_path, log=lines.append)
    row = report["rows"][0]
    assert row["error"] is None and row["problems"] == 2 and row["correct"] == 0
    assert sum("could not grade p" in line and "math_verify" in line for line in lines) == 2


def test_a_run_stopped_midway_keeps_the_problems_it_finished(engines, tmp_path):
    """A GPU session's time limit once cut a benchmark after 3 of 4 problems and left no results.json: the report
    is now written after every problem, so a stopped run keeps each finished problem's latencies for every method."""
    cfg = load_config(None, ["runtime.max_new_tokens=8", "runtime.max_steps=1", "sampling.max_step_tokens=4",
                             "bench.warmup=false"])
    env = bench.prepare(cfg.bench_setup(), engines=engines, system_speed=True,
                        problems=[bench.Problem(f"p{i}", f"What is {i} + 1?", str(i + 1)) for i in range(3)])

    class Stopped(Exception):
        pass

    def log(line: str) -> None:  # the limit strikes as the third problem's first method ends
        if line.startswith("[3/3]"):
            raise Stopped

    with pytest.raises(Stopped):
        bench.run_benchmark(env, ["target", "draft"], out_dir=tmp_path, log=log)
    assert "2 problems (stopped midway: 2 of 3 problems)." in (tmp_path / "results.md").read_text()
    import json

    report = json.loads((tmp_path / "results.json").read_text())
    assert report["problems"] == ["p0", "p1"] and report["finished"] == "2 of 3 problems"
    rows = {r["method"]: r for r in report["rows"]}
    assert [len(rows[m]["latencies_s"]) for m in ("target", "draft")] == [2, 2]
    assert rows["draft"]["speedup"] == pytest.approx(sum(rows["target"]["latencies_s"])
                                                     / sum(rows["draft"]["latencies_s"]))
    with pytest.raises(Stopped):  # stopped before any problem finished: no report, not the last run's
        bench.run_benchmark(env, ["target"], out_dir=tmp_path, log=lambda line: log(line.replace("[1/3]", "[3/3]")))
    assert not (tmp_path / "results.json").exists() and not (tmp_path / "results.md").exists()
    full = bench.run_benchmark(env, ["target"], out_dir=tmp_path / "whole", log=lambda s: None)
    assert "finished" not in full and json.loads((tmp_path / "whole" / "results.json").read_text())["problems"] == [
        "p0", "p1", "p2"]
