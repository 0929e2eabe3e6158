"""probe-bench: problems, the CLI table (offline GSM-style problems), checkpoints, system-speed mode."""
from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
import torch

from specprobe.infer import bench
from specprobe.infer.bench_cli import main
from specprobe.infer.config import load_inference_config
from specprobe.infer.decoding import read_trace, replay_text
from specprobe.inputs.config import ConfigError
from specprobe.inputs.records import BenchSourceConfig, question_digest
from specprobe.probes.adaptive_gamma import CycleCosts, forecast_pays
from specprobe.probes.features import FeatureSpec
from specprobe.probes.metrics import wilson_interval
from specprobe.probes.mlp import ProbeMLPConfig, SemanticProbe
from specprobe.train.config import load_config

TINY_MODELS = ["models.target=random:llama-20m", "models.draft=random:llama-tiny", "models.device=cpu",
               "runtime.max_steps=3", "sampling.max_step_tokens=6", "runtime.accept_length_cut=true"]


def test_short_names_load_the_hub_sets_they_name(monkeypatch):
    """A short name (probe-bench's `name: gsm8k`, a data source's default) is resolved in one table
    (inputs.records.HUB_NAMES) to its hub id and default config; probe-bench reads each set's own split unless
    bench.source.split names one (the traces' source keeps train)."""
    from specprobe.data_gen.sources import iter_gsm8k, iter_s1k
    from specprobe.infer.config import load_inference_config
    from specprobe.inputs import records

    asked = []

    def hub(name, config, split):
        asked.append((name, config, split))
        return iter([records.Record(0, f"{name}[{split}] row 0", {"question": "Q?", "answer": "7"})])

    monkeypatch.setattr(records, "iter_hub", hub)
    for name in ("gsm8k", "aime24", "org/other", "openai/gsm8k"):  # the hub id reads the set's own split too
        assert bench.load_problems(BenchSourceConfig(kind="jsonl", name=name), 1)[0].answer == "7"
    bench.load_problems(BenchSourceConfig(kind="gsm8k"), 1)
    for name, split in (("gsm8k", "train"), ("openai/gsm8k", "train"), ("aime24", "validation")):
        bench.load_problems(BenchSourceConfig(kind="jsonl", name=name, split=split), 1)  # a split set wins
    list(iter_gsm8k())
    list(iter_s1k())
    cfg = load_inference_config(None, ["bench.source.kind=gsm8k"])
    assert cfg.bench.source.split is None and cfg.source.split == "train"
    assert load_inference_config(None, ["bench.source.split=train"]).bench.source.split == "train"
    assert asked == [("openai/gsm8k", "main", "test"), ("HuggingFaceH4/aime_2024", None, "train"),
                     ("org/other", None, "train"), ("openai/gsm8k", "main", "test"), ("openai/gsm8k", "main", "test"),
                     ("openai/gsm8k", "main", "train"), ("openai/gsm8k", "main", "train"),
                     ("HuggingFaceH4/aime_2024", None, "validation"),
                     ("openai/gsm8k", "main", "train"), ("simplescaling/s1K-1.1", None, "train")]
    # a record without an id is numbered after the set's last name part, as the data stage numbers it
    assert bench.load_problems(BenchSourceConfig(kind="jsonl", name="org/other"), 1)[0].id == "other-0"


def test_load_problems_local_files(tmp_path, monkeypatch):
    math = tmp_path / "math500.jsonl"
    math.write_text("\n".join(json.dumps(r) for r in [
        {"problem": "What is 1+1?", "answer": "2", "unique_id": "a"},
        {"problem": "Simplify 2/4.", "solution": r"We get \boxed{\frac{1}{2}}."}]))
    probs = bench.load_problems(BenchSourceConfig(kind="jsonl", path=str(math)), 5)
    assert [(p.id, p.answer) for p in probs] == [("a", "2"), ("math500-1", r"\frac{1}{2}")]
    # the ids the data stage gives the same records (held-out questions are matched by id): a stripped id, else
    # the file's stem and the index
    from specprobe.data_gen.sources import load_traces
    both = tmp_path / "both.jsonl"
    both.write_text("\n".join(json.dumps(r) for r in [{"question": "Q1?", "steps": ["s"], "answer": "1", "id": " q1 "},
                                                      {"question": "Q2?", "steps": ["s"], "answer": "2"}]))
    traces = load_traces("jsonl", path=str(both))
    assert [p.id for p in bench.load_problems(BenchSourceConfig(kind="jsonl", path=str(both)), 5)] == \
        [t.id for t in traces] == ["q1", "both-1"]
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"question": "Q?", "answer": "3 + 4 = 7\n#### 7"}))
    assert bench.load_problems(BenchSourceConfig(kind="gsm8k", path=str(gsm)), 5)[0].answer == "7"
    rg = bench.load_problems(BenchSourceConfig(kind="reasoning_gym", task="gsm_symbolic", size=2, seed=3), 3)
    assert len(rg) == 3 and all(p.question and p.answer for p in rg)
    # ids and families (templates) as the data stage gives the same items: a checkpoint's test questions are
    # benchmarked by id, and α's interval draws whole templates
    traces = load_traces("reasoning_gym", size=3, seed=3)
    assert [(p.id, p.family, p.question) for p in rg] == [(t.id, t.family, t.question) for t in traces]
    assert all(p.family.startswith("gsm_symbolic/template-") for p in rg)
    # a record's family (as export_test_questions writes it): a string or a template number; else an error naming it
    fam = tmp_path / "fam.jsonl"
    fam.write_text("\n".join(json.dumps(r) for r in [{"question": "Q1?", "answer": "1", "family": "t/7"},
                                                      {"question": "Q2?", "answer": "2", "family": 7},
                                                      {"question": "Q3?", "answer": "3"}]))
    assert [p.family for p in bench.load_problems(BenchSourceConfig(kind="jsonl", path=str(fam)), 5)] == \
        ["t/7", "7", None]
    # bench.source.fields renames a record's fields, domains keeps some; a named field missing is an error naming it
    own = tmp_path / "own.jsonl"
    own.write_text("\n".join(json.dumps(r) for r in [
        {"query": "Q1?", "label": "1", "key": "a", "area": "math"}, {"query": "Q2?", "label": "2", "key": "b",
                                                                     "area": "chemistry"}]))
    fields = {"question": "query", "answer": "label", "id": "key", "domain": "area"}
    mine = bench.load_problems(BenchSourceConfig(kind="jsonl", path=str(own), fields=fields, domains=["Math"]), 5)
    assert [(p.id, p.question, p.answer) for p in mine] == [("a", "Q1?", "1")]
    with pytest.raises(ConfigError, match=r"own.jsonl:1: no field 'prompt' \(bench.source.fields.question\)"):
        bench.load_problems(BenchSourceConfig(kind="jsonl", path=str(own), fields={"question": "prompt"}), 5)
    # as the data stage reads them: a dotted name walks nested fields, another mapped field missing reads as absent
    # (a domain as unknown), null maps nothing
    nested = tmp_path / "nested.jsonl"
    nested.write_text("\n".join(json.dumps(r) for r in [{"input": {"text": "Q1?"}, "label": "1", "area": "math"},
                                                         {"input": {"text": "Q2?"}, "label": "2"}]))
    dotted = {"question": "input.text", "answer": "label", "domain": "area", "family": None}
    kept = bench.load_problems(BenchSourceConfig(kind="jsonl", path=str(nested), fields=dotted,
                                                 domains=["unknown"]), 5)
    assert [(p.question, p.answer, p.family) for p in kept] == [("Q2?", "2", None)]
    with pytest.raises(ConfigError, match="gsm8k problems are all of one domain"):
        BenchSourceConfig(kind="gsm8k", domains=["math"])
    # trace settings it does not read are refused, saying what to set instead
    for key, value, instead in (("delimiter", "\n", "source.delimiter"), ("limit", 3, "bench.num_problems")):
        with pytest.raises(ConfigError, match=rf"bench.source.{key} is not read by probe-bench .*{instead}"):
            BenchSourceConfig(kind="jsonl", path=str(own), **{key: value})
    with pytest.raises(ConfigError, match=r"fields: probe-bench reads id, question, .* not \['steps'\]"):
        BenchSourceConfig(kind="jsonl", path=str(own), fields={"steps": "s"})
    fam.write_text(json.dumps({"question": "Q1?", "answer": "1", "family": ["t"]}))
    with pytest.raises(ConfigError, match=r"fam.jsonl:1: field 'family'"):
        bench.load_problems(BenchSourceConfig(kind="jsonl", path=str(fam)), 5)
    # its reference answers are read by the same rule as a record's (and the data stage's): stripped, no thousands
    # separators (a double for the generator: no offline task is known to print "1,234")
    import reasoning_gym
    monkeypatch.setattr(reasoning_gym, "create_dataset", lambda task, size, seed: [
        {"question": "Q1?", "answer": "1,234"}, {"question": "Q2?", "answer": 7}, {"question": "Q3?", "answer": " x "}])
    rg = bench.load_problems(BenchSourceConfig(kind="reasoning_gym", task="t", size=3, seed=0), 3)
    assert [p.answer for p in rg] == ["1234", "7", "x"]
    with pytest.raises(ConfigError, match="reasoning_gym, gsm8k or jsonl"):
        bench.load_problems(BenchSourceConfig(kind="champ"), 2)
    with pytest.raises(ConfigError, match="not found"):
        bench.load_problems(BenchSourceConfig(kind="jsonl", path=str(tmp_path / "none.jsonl")), 2)


def _write_probes(folder, target_name, draft_name):
    from specprobe.infer.engines import HFStepEngine

    for role, name, bias in (("target", target_name, -0.85), ("draft", draft_name, 0.4)):
        eng = HFStepEngine(name, device="cpu")
        spec = FeatureSpec(eng.info.model_id, eng.info.num_layers, eng.info.hidden_size, layers="last")
        torch.manual_seed(0)
        probe = SemanticProbe(spec, ProbeMLPConfig(hidden_dim=8, dropout=0.0)).eval()
        with torch.no_grad():
            probe.mlp[-1].bias.fill_(bias)
        probe.save(folder, f"probe_{role}")


def test_cli_with_a_probe_checkpoint_prints_the_table(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    _write_probes(ckpt, "random:llama-20m", "random:llama-tiny")
    # the checkpoint's split records the problem's question as trained on (by its text): the report says so
    problem = bench.load_problems(load_inference_config("configs/tiny.yaml").bench.source, 1)[0]
    (ckpt / "metrics.json").write_text(json.dumps(
        {"split": {"question_digests": {"train": [question_digest(" " + problem.question + "\n")], "val": []}}}))
    out = tmp_path / "out"
    code = main(["--config", "configs/tiny.yaml", "--checkpoint", str(ckpt), "--num-problems", "1",
                 "--methods", "target,semanticspec,lr_sync,lr_async:verifier=bernoulli", "--out", str(out),
                 "bench.warmup=false", *TINY_MODELS])
    text = capsys.readouterr().out
    assert code == 0, text
    for name in ("| target |", "| semanticspec |", "| lr_sync |", "| lr_async:verifier=bernoulli |"):
        assert name in text
    report = json.loads((out / "results.json").read_text())
    rows = {r["method"]: r for r in report["rows"]}
    assert rows["target"]["speedup"] == 1.0 and rows["semanticspec"]["verifier"] == "probe"
    assert rows["lr_sync"]["judged"] > 0 and rows["lr_sync"]["analytic_ideal"] is not None
    assert rows["lr_sync"]["measured_over_ideal"] == pytest.approx(rows["lr_sync"]["speedup"] / rows["lr_sync"]["analytic_ideal"])
    trace = read_trace(out / "traces" / "semanticspec.jsonl")
    assert trace and all(r["method"] == "semanticspec" for r in trace)
    assert any("p" in (d["verdict"] or {}) for r in trace for d in r["drafts"])  # the probes decided
    assert report["trained_on"] == [problem.id]
    assert "1 of 1 problems were trained or validated on by the checkpoint" in (out / "results.md").read_text()


def test_cli_rejects_a_checkpoint_for_other_models(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    _write_probes(ckpt, "random:llama-tiny", "random:llama-tiny")  # target probe for the wrong model
    code = main(["--config", "configs/tiny.yaml", "--checkpoint", str(ckpt), "--num-problems", "1", *TINY_MODELS])
    err = capsys.readouterr().err
    assert code == 2 and "probe_target does not fit the target model" in err and "random:llama-20m" in err
    assert main(["--config", "configs/tiny.yaml", "--methods", "lr_warp", "--verifier", "exact", *TINY_MODELS]) == 2
    assert main(["--config", "configs/tiny.yaml", "runtime.gamma=0"]) == 2
    assert "runtime.gamma" in capsys.readouterr().err


def test_cli_input_mistakes_fail_before_the_models_load(tmp_path, capsys, monkeypatch):
    """A misspelt method, a missing problems file, a missing checkpoint (also one only a method's own
    `:verifier=` reads), or the data folder given as the checkpoint: exit 2 naming it, before any model loads
    (minutes for a full-size pair)."""
    monkeypatch.setattr(bench, "build_engine_pair", lambda *a, **k: pytest.fail("the models were loaded"))
    data = tmp_path / "run" / "data"
    data.mkdir(parents=True)
    (data / "manifest.json").write_text("{}")
    run, empty = tmp_path / "run2", tmp_path / "empty"
    (run / "checkpoint").mkdir(parents=True)
    (run / "checkpoint" / "checkpoint.json").write_text("{}")
    empty.mkdir()
    for argv, message in [
            (["--methods", "target,lr_snyc"], "lr_snyc"),
            (["bench.source.kind=jsonl", f"bench.source.path={tmp_path}/none.jsonl"],
             "bench.source.path: .*none.jsonl does not exist"),
            (["bench.source.kind=jsonl", f"bench.source.path={tmp_path}/test_questions.jsonl"],
             "does not exist .*probe-train writes <output_dir>/test_questions.jsonl"),
            (["--checkpoint", str(tmp_path / "nope")], "checkpoint folder .*nope does not exist"),
            (["--system-speed", "--verifier", "probe"], "--system-speed judges with the Bernoulli verifier"),
            # the run's verifier reads none, but a method names one that does
            (["--verifier", "exact", "--methods", "target,lr_sync:verifier=probe", "--checkpoint",
              str(tmp_path / "nope")], "checkpoint folder .*nope does not exist"),
            (["--checkpoint", str(data)], "is a data folder .*not a checkpoint"),
            (["--verifier", "probe", f"runtime.checkpoint={data}"], "is a data folder"),
            # the run folder above the checkpoint; a folder without the verifier the run judges with
            (["--verifier", "probe", "--checkpoint", str(run)], "did you mean .*run2/checkpoint"),
            (["--verifier", "probe", "--checkpoint", str(empty)], "has no probe 'probe_target'.*train the probes"),
            (["--verifier", "embedding", "--checkpoint", str(empty)], "embedding"),
            (["runtime.checkpoint_judge_base=./no-base"], "runtime.checkpoint_judge_base: local model path")]:
        assert main(["--config", "configs/tiny.yaml", *argv, *TINY_MODELS]) == 2, argv
        assert re.search(message, capsys.readouterr().err), message


def test_methods_that_judge_nothing_need_no_checkpoint(tmp_path, capsys):
    """target and draft alone run before any training: the run's verifier (probe) is neither checked nor loaded."""
    out = tmp_path / "out"
    code = main(["--config", "configs/tiny.yaml", "--methods", "target,draft", "--num-problems", "1", "--out", str(out),
                 f"output_dir={tmp_path / 'untrained'}", "bench.warmup=false", *TINY_MODELS])
    assert code == 0, capsys.readouterr().err
    assert {r["method"] for r in json.loads((out / "results.json").read_text())["rows"]} == {"target", "draft"}
    # a method that judges still needs the checkpoint, before the models load
    assert main(["--config", "configs/tiny.yaml", "--methods", "target,lr_sync", f"output_dir={tmp_path / 'untrained'}",
                 *TINY_MODELS]) == 2
    assert "the probe verifier is loaded from a checkpoint" in capsys.readouterr().err


def test_system_speed_mode(tmp_path, capsys):
    code = main(["--config", "configs/tiny.yaml", "--system-speed", "--num-problems", "1",
                 "--methods", "target,lr_sync,lr_async,semanticspec", "--out", str(tmp_path),
                 "bench.system_target=random:llama-20m", "bench.system_draft=random:llama-tiny",
                 "runtime.max_steps=4", "sampling.max_step_tokens=4", "bench.warmup=false"])
    assert code == 0
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["system_speed"] and report["verifier"] == "bernoulli"
    assert report["models"] == {"target": "random:llama-20m", "draft": "random:llama-tiny"}
    lr = next(r for r in report["rows"] if r["method"] == "lr_sync")
    assert lr["judged"] > 0 and lr["acceptance"] is not None and lr["c"] > 0 and lr["b"] > 0
    lo, hi = lr["acceptance_ci95"]  # Wilson interval from the run's own counts
    assert lo <= lr["acceptance"] <= hi and hi - lo > 0
    target = next(r for r in report["rows"] if r["method"] == "target")
    assert target["pass@1_ci95"] == list(wilson_interval(target["correct"], target["problems"]))  # JSON: a list
    assert target["acceptance_ci95"] is None  # target-only judges nothing
    assert "system-speed mode" in capsys.readouterr().out
    # each problem's template is recorded, as α's intervals draw whole templates where problems share one
    (pid,) = report["problems"]
    (first,) = bench.load_problems(BenchSourceConfig(kind="reasoning_gym", task="gsm_symbolic", size=4, seed=1234), 1)
    assert report["families"] == {pid: first.family} and first.family.startswith("gsm_symbolic/template-")
    assert "95% intervals: pass@1 Wilson over problems; α, α over decided and speedup a bootstrap over problems (" in \
        (tmp_path / "results.md").read_text()


@pytest.mark.slow
def test_cli_on_offline_gsm_problems_with_smollm2(tmp_path, capsys):
    """The offline default: SmolLM2 as target and (hotter) draft, reasoning-gym GSM problems."""
    out = tmp_path / "bench"
    code = main(["--config", "configs/tiny.yaml", "--verifier", "bernoulli", "--num-problems", "2",
                 "--methods", "target,draft,lr_sync,lr_async,semanticspec,lr_sync+ngram", "--out", str(out),
                 "runtime.max_steps=2", "sampling.max_step_tokens=12", "bench.warmup=false"])
    text = capsys.readouterr().out
    assert code == 0, text
    report = json.loads((out / "results.json").read_text())
    assert len(report["problems"]) == 2 and report["models"]["target"] == "offline:smollm2-135m-instruct"
    assert [r["method"] for r in report["rows"]] == ["target", "draft", "lr_sync", "lr_async", "semanticspec",
                                                     "lr_sync+ngram"]
    assert all(r["error"] is None and r["problems"] == 2 and r["pass@1"] is not None for r in report["rows"])
    assert "| lr_sync+ngram |" in text and "meas/analytic" in text and "| speedup | per problem |" in text
    assert (out / "speedup.png").read_bytes()[:4] == b"\x89PNG"
    for r in report["rows"]:
        if r["method"] == "target":  # the baseline: no interval around its own 1.0
            assert r["speedup_ci95"] is None and r["speedup_per_problem"] is None
        else:  # two problems: the pooled speedup lies between the two problems' own, the interval's ends
            (lo, hi), spread = r["speedup_ci95"], r["speedup_per_problem"]
            assert lo <= r["speedup"] <= hi and (lo, hi) == pytest.approx((spread["min"], spread["max"]))
            m_lo, m_hi = spread["median_ci95"]  # the median's: drawn over the two problems too
            assert spread["min"] <= m_lo <= spread["median"] <= m_hi <= spread["max"]
            assert r["speedup_ci95_resamples"] == "problems"
        assert sum(r["stop_reasons"].values()) == 2 and set(r["stop_reasons"]) <= {"max_steps", "eos"}
    trace = read_trace(out / "traces" / "lr_sync.jsonl")
    first = trace[0]["problem"]
    assert replay_text([t for t in trace if t["problem"] == first])


def test_a_problem_without_a_reference_answer_is_timed_not_graded(tmp_path, caplog):
    """Through the CLI: a problems file where one record has no answer field probe-bench reads. Both problems are
    decoded and timed; pass@1 is over the one with an answer, and the report says so."""
    problems = tmp_path / "mine.jsonl"
    problems.write_text(json.dumps({"question": "What is 1 + 1?", "answer": "2"}) + "\n"
                        + json.dumps({"question": "What is 2 + 2?", "label": "4"}) + "\n")
    out = tmp_path / "out"
    assert main(["--config", "configs/tiny.yaml", "--system-speed", "--num-problems", "2", "--methods", "target",
                 "--out", str(out), "bench.system_target=random:llama-20m", "bench.system_draft=random:llama-tiny",
                 "runtime.max_steps=2", "sampling.max_step_tokens=4", "bench.warmup=false", "bench.source.kind=jsonl",
                 f"bench.source.path={problems}"]) == 0
    assert "1 of 2 problems have no reference answer" in caplog.text  # (the CLI logs warnings to stderr)
    row = json.loads((out / "results.json").read_text())["rows"][0]
    assert (row["problems"], row["graded"], len(row["latencies_s"])) == (2, 1, 2)
    assert "pass@1 is over the problems with a reference answer: target 1 of 2." in (out / "results.md").read_text()


@pytest.mark.parametrize("method", ["lr_sync:verifier=probe", "lr_sync:gamma=adaptive:verifier=probe"])
def test_a_method_that_cannot_run_fails_the_command_unless_told_to_go_on(tmp_path, capsys, method):
    """A probe verifier whose checkpoint's probes cannot be read cannot run (nor can gamma=adaptive's acceptance
    probe be loaded for it, which the warm-up meets first): exit 3 naming the method, the other methods' results
    written; --keep-going exits 0. (A folder that does not exist, or lacks the probes' files, stops the command
    before the models load; these files are there, and unreadable.)"""
    (tmp_path / "empty-checkpoint").mkdir()
    for role in ("target", "draft"):
        for suffix in (".safetensors", ".json"):
            (tmp_path / "empty-checkpoint" / f"probe_{role}{suffix}").write_text("cut short")
    args = ["--config", "configs/tiny.yaml", "--system-speed", "--num-problems", "1", "--methods",
            f"target,{method}", "--out", str(tmp_path / "out"), "bench.system_target=random:llama-20m",
            "bench.system_draft=random:llama-tiny", "runtime.max_steps=2", "sampling.max_step_tokens=4",
            f"runtime.checkpoint={tmp_path}/empty-checkpoint"]
    assert main(args) == 3
    err = capsys.readouterr().err
    assert f"method {method} could not run" in err and "--keep-going" in err
    assert {r["method"] for r in json.loads((tmp_path / "out" / "results.json").read_text())["rows"]} >= {"target"}
    assert main([*args, "--keep-going"]) == 0


def test_system_speed_adaptive_depth_with_heterogeneous_acceptance(tmp_path):
    """:gamma=adaptive through the CLI: the simulated acceptance probe, costs measured on the engines, the
    kept depths reported and traced; the suffix is refused where no depth is chosen."""
    code = main(["--config", "configs/tiny.yaml", "--system-speed", "--num-problems", "1",
                 "--methods", "target,lr_sync:gamma=adaptive,semanticspec:gamma=adaptive", "--out", str(tmp_path),
                 "bench.system_target=random:llama-20m", "bench.system_draft=random:llama-tiny",
                 "runtime.max_steps=6", "sampling.max_step_tokens=4", "bench.warmup=false",
                 "runtime.adaptive.gamma_max=3", "runtime.bernoulli_alpha=0.95", "runtime.difficulty.hard_share=0.5",
                 "runtime.difficulty.hard_alpha=0.05"])
    assert code == 0
    report = json.loads((tmp_path / "results.json").read_text())
    for label in ("lr_sync:gamma=adaptive", "semanticspec:gamma=adaptive"):
        row = next(r for r in report["rows"] if r["method"] == label)
        assert row["gamma"] == "adaptive<=3" and sum(row["depth_kept"]) > 0 and row["formula"] == "adaptive γ"
        measured = row["depth_policy"]["measured"]
        assert row["depth_policy"]["estimator"] == "simulated" and all(m["c"] > 0 for m in measured)
        trace = read_trace(bench.trace_file(tmp_path, label))
        estimates = {round(a, 9) for rec in trace for a in rec.get("depth", {}).get("estimates", [])}
        assert estimates <= {0.95, 0.05, 0.0} and len(estimates - {0.0}) >= 1
        assert row["forecast_skip"] is False and not any(rec.get("depth", {}).get("skipped") for rec in trace)
    # the option reaches the loop: a cycle drafts nothing exactly where its forecast does not pay. Costs given, not
    # measured: measured ones follow the machine's load, and under a heavy one every forecast paid (no skip to see)
    skip_out = tmp_path / "skip"
    code = main(["--config", "configs/tiny.yaml", "--system-speed", "--num-problems", "1",
                 "--methods", "target,lr_sync:gamma=adaptive:forecast_skip=true", "--out", str(skip_out),
                 "bench.system_target=random:llama-20m", "bench.system_draft=random:llama-tiny",
                 "runtime.max_steps=6", "sampling.max_step_tokens=4", "bench.warmup=false",
                 "runtime.adaptive.gamma_max=3", "runtime.bernoulli_alpha=0.95", "runtime.difficulty.hard_share=0.5",
                 "runtime.difficulty.hard_alpha=0.05", "runtime.adaptive.c=0.3", "runtime.adaptive.b=[1.0,1.05,1.1,1.15]"])
    assert code == 0
    row = next(r for r in json.loads((skip_out / "results.json").read_text())["rows"]
               if r["method"] == "lr_sync:gamma=adaptive:forecast_skip=true")
    trace = read_trace(bench.trace_file(skip_out, row["method"]))
    costs = CycleCosts(0.3, b=[1.0, 1.05, 1.1, 1.15], kind="lookahead")
    assert forecast_pays(0.95, costs, 3) and not forecast_pays(0.05, costs, 1)  # the two kinds of position differ
    cycles = [rec for rec in trace if "depth" in rec]
    for rec in cycles:
        forecast, g = rec["depth"]["forecast"], min(3, 6 - rec["start_step"] - 1)
        assert bool(rec["depth"].get("skipped")) == (forecast is not None and not forecast_pays(forecast, costs, g))
    skipped = [rec for rec in cycles if rec["depth"].get("skipped")]
    assert row["forecast_skip"] is True and skipped and row["depth_drafted"][0] == len(skipped)
    assert all(rec["drafts"] == [] for rec in skipped)
    assert bench.parse_method("lr_async:gamma=adaptive").overrides == {"gamma_policy": "adaptive"}
    assert bench.parse_method("semanticspec:gamma=adaptive:forecast_skip=true").overrides == {
        "gamma_policy": "adaptive", "forecast_skip": True}
    for bad, match in (("lr_async:gamma=adaptive:forecast_skip=1", "applies to lr_sync and semanticspec"),
                       ("lr_sync:gamma=adaptive:forecast_skip=yes", "must be true or false")):
        with pytest.raises(ConfigError, match=match):
            bench.parse_method(bad)
    env = bench.prepare(load_config("configs/tiny.yaml", ["bench.system_speed=true"]).bench_setup(), engines=(None, None),
                        problems=[bench.Problem("p", "q", None)])
    with pytest.raises(ConfigError, match="gamma=adaptive applies to"):
        bench.is_adaptive(env, bench.parse_method("target:gamma=adaptive"))
    with pytest.raises(ConfigError, match="forecast_skip applies with gamma=adaptive"):
        bench.check_method(env, bench.parse_method("lr_sync:forecast_skip=true"))
    # config-wide: runtime.adaptive.forecast_skip for the sync cycles, a method option overrides it
    wide = bench.prepare(load_config("configs/tiny.yaml", ["bench.system_speed=true", "runtime.gamma_policy=adaptive",
                                                           "runtime.adaptive.forecast_skip=true"]).bench_setup(),
                         engines=(None, None), problems=[bench.Problem("p", "q", None)])
    bench.check_method(wide, bench.parse_method("lr_sync:forecast_skip=true"))  # adaptive by the config
    assert [bench.forecast_skips(wide, bench.parse_method(m)) for m in
            ("semanticspec", "lr_async", "lr_sync:forecast_skip=false", "target")] == [True, False, False, False]


def test_a_stopped_run_resumes_with_the_problems_it_finished(tmp_path, capsys, monkeypatch):
    """Stopped at its third problem: the report keeps two, marked as such. The same command with --resume decodes
    the third only and writes the table (and traces) an uninterrupted run writes; other settings are refused."""
    args = ["--config", "configs/tiny.yaml", "--system-speed", "--num-problems", "3",
            "--methods", "target,lr_sync,semanticspec", "bench.system_target=random:llama-20m",
            "bench.system_draft=random:llama-tiny", "runtime.max_steps=4", "sampling.max_step_tokens=4",
            "bench.warmup=false"]
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    err = capsys.readouterr().err  # after each problem, how far and, at this run's rate, how long is left
    assert re.search(r"probe-bench: 1 of 3 problems, 0:\d\d:\d\d elapsed, about 0:\d\d:\d\d left\n", err)
    assert re.search(r"probe-bench: 3 of 3 problems, 0:\d\d:\d\d elapsed\n", err)
    decoded, real = [], bench.run_problems

    def stopped_at_the_third(env, specs, results, log=print, on_trace=None, only=None):
        decoded.extend(only)

        def written_then_stopped(label, records):  # the first method's trace of the third problem is written
            on_trace(label, records)
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's time limit
            time.sleep(5)  # the handler raises here

        stopped = only == [2] and stop
        return real(env, specs, results, log, written_then_stopped if stopped else on_trace, only)

    monkeypatch.setattr(bench, "run_problems", stopped_at_the_third)
    out = tmp_path / "stopped"
    stop = True
    def ignore(*_):  # should probe-bench's handler be missing
        pass

    original = signal.signal(signal.SIGTERM, ignore)
    try:
        assert main([*args, "--out", str(out)]) == 143  # SIGTERM's code, with what to do next
        assert signal.getsignal(signal.SIGTERM) is ignore  # the caller's handler is back
    finally:
        signal.signal(signal.SIGTERM, original)
    assert "stopped (SIGTERM); the 2 problems it finished are in" in capsys.readouterr().err
    stopped_report = json.loads((out / "results.json").read_text())
    assert stopped_report["finished"] == "2 of 3 problems"
    with monkeypatch.context() as m:  # the same command without --resume: refused, nothing replaced
        m.setattr(bench, "prepare", lambda *a, **k: pytest.fail("models loaded for a run that would replace work"))
        assert main([*args, "--out", str(out)]) == 2
        assert main([*args, "--out", str(out), "--resume", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "holds a run stopped after 2 of 3 problems" in err and "--overwrite starts over" in err
    assert json.loads((out / "results.json").read_text()) == stopped_report
    with open(out / "problems.jsonl", "a") as f:  # a kill while the third's line was being written
        f.write('{"position": 2, "problem": "gsm')
    stop = False
    decoded.clear()
    assert main([*args, "--out", str(out), "--resume"]) == 0
    err = capsys.readouterr().err
    assert decoded == [2] and "resuming" in err and "probe-bench: 3 of 3 problems, " in err
    whole, resumed = (json.loads((tmp_path / run / "results.json").read_text()) for run in ("whole", "stopped"))
    assert resumed["resumed"] == "2 of 3 problems decoded by an earlier run of this command"
    assert "finished" not in resumed and resumed["problems"] == whole["problems"]
    assert resumed["wall_s"] > stopped_report["wall_s"]  # the earlier run's time goes on
    logged = [json.loads(line) for line in (out / "problems.jsonl").read_text().splitlines()]
    assert [line["position"] for line in logged[1:]] == [0, 1, 2]  # the cut line is gone, the third appended
    for a, b in zip(resumed["rows"], whole["rows"]):
        keys = ("method", "problems", "judged", "acceptance", "output_tokens", "correct", "acceptance_ci95")
        assert [a[k] for k in keys] == [b[k] for k in keys] and len(a["latencies_s"]) == 3
    for label in ("target", "lr_sync", "semanticspec"):  # (the stopped run had written the third's target trace)
        assert read_trace(out / "traces" / f"{label}.jsonl") == read_trace(tmp_path / "whole" / "traces" /
                                                                          f"{label}.jsonl")
    # a finished run resumes to its report, decoding nothing; another setting is an error naming it
    decoded.clear()
    assert main([*args, "--out", str(out), "--resume"]) == 0 and decoded == []
    more = [("4" if a == "3" else a) for a in args]  # --num-problems 4: the fourth is decoded, the three kept
    assert main([*more, "--out", str(out), "--resume"]) == 0 and decoded == [3]
    assert json.loads((out / "results.json").read_text())["resumed"] == \
        "3 of 4 problems decoded by an earlier run of this command"
    with monkeypatch.context() as m:  # refused before the models load
        m.setattr(bench, "prepare", lambda *a, **k: pytest.fail("models loaded for a run that cannot resume"))
        assert main([*args, "runtime.gamma=2", "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "holds a run with other settings (" in err and "config.runtime.gamma: 3 -> 2" in err
    decoded.clear()
    assert main([*args, "runtime.gamma=2", "--out", str(out)]) == 0 and decoded == [0, 1, 2]  # starts over


def test_a_method_that_failed_decodes_no_later_problem_even_after_a_resume(tmp_path, monkeypatch):
    """lr_sync fails on the second of three problems: the third starts with its error (it decodes nothing there) and
    the report counts the first only, as one process stops a failed method. A resumed run that reads the failure
    from the log skips it the same way."""
    args = ["--config", "configs/tiny.yaml", "--system-speed", "--num-problems", "3", "--methods", "target,lr_sync",
            "bench.system_target=random:llama-20m", "bench.system_draft=random:llama-tiny", "runtime.max_steps=2",
            "sampling.max_step_tokens=4", "bench.warmup=false", "--keep-going", "--out", str(tmp_path)]
    seen, real = {}, bench.run_problems

    def fails_on_the_second(env, specs, results, log=print, on_trace=None, only=None):
        seen[only[0]] = results["lr_sync"].error  # as the loop hands it over
        real(env, specs, results, log, on_trace, only)
        if only == [1]:
            results["lr_sync"].error = "RuntimeError: out of memory"

    monkeypatch.setattr(bench, "run_problems", fails_on_the_second)
    assert main(args) == 0
    assert seen == {0: None, 1: None, 2: "RuntimeError: out of memory"}
    rows = {r["method"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    assert rows["lr_sync"]["error"] == "RuntimeError: out of memory" and len(rows["lr_sync"]["latencies_s"]) == 1
    assert len(rows["target"]["latencies_s"]) == 3
    log = tmp_path / "problems.jsonl"
    log.write_text("".join(log.read_text().splitlines(keepends=True)[:3]))  # the run and its first two problems
    seen.clear()
    assert main([*args, "--resume"]) == 0
    assert seen == {2: "RuntimeError: out of memory"}
