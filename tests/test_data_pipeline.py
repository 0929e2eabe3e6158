"""The training-data generator: contexts, labels, and whole runs on the real SmolLM2 + MiniLM (tiny)."""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from specprobe.data_gen.cluster import normalise_step
from specprobe.data_gen.contexts import (
    DataWarning,
    build_contexts,
    coerce_traces,
    context_positions,
    context_seed,
    context_text,
    parse_part,
    part_shards,
    plan_shards,
)
from specprobe.data_gen.labels import build_pairs, draft_under_target, model_labels, pair_key
from specprobe.data_gen.pipeline import generate_dataset, layer_rows, loads_models
from specprobe.data_gen.sources import Trace
from specprobe.data_gen.store import DataFolderError, DataMismatchError, merge_parts, open_dataset, read_manifest
from specprobe.infer.engines import Prefix

from _data_fixtures import HIDDEN, LAYERS, BlankingEngine, assert_same_data, dataset_arrays, write_config

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


# ----------------------------------------------------------------------------- pure parts
def test_context_positions():
    assert context_positions(5, 3, "spread") == [0, 2, 4]
    assert context_positions(5, 2, "spread") == [0, 4]
    assert context_positions(5, 1, "spread") == [0]
    assert context_positions(3, 8, "spread") == [0, 1, 2]  # more wanted than exist: all
    assert context_positions(5, 2, "first") == [0, 1]
    assert context_positions(4, 1, "all") == [0, 1, 2, 3]
    assert context_positions(9, 3, "spread", max_steps=4) == [0, 2, 4]
    assert context_positions(1, 3, "spread") == [0]  # j = S-1 at most: one reference step always follows
    with pytest.raises(ValueError, match="unknown context_positions"):
        context_positions(4, 2, "middle")


def test_the_data_stage_judges_read_the_runtime_judges_context():
    """The judge-LoRA is trained on the data stage's context text and reads the runtime's: one rule, the data
    stage's ending with the delimiter its next step follows."""
    from specprobe.infer.verifiers import StepContext

    question, steps = "  What is 6 x 7?\n", ["6 x 7 = 42.  ", "\nSo the answer is 42."]
    runtime = StepContext(question, tuple(steps)).text()
    assert runtime == "What is 6 x 7?\n\n6 x 7 = 42.\n\nSo the answer is 42."
    assert context_text(question, steps) == runtime + "\n\n"
    assert context_text(question, [], delimiter="\n") == "What is 6 x 7?\n"


def test_contexts_ids_seeds_and_shard_plan():
    traces = [Trace("q1", "math", "Q one?", ["a", "b", "c"], "1"), Trace("q2", "math", "Q two?", ["x"], "2")]
    contexts = build_contexts(traces, 2, "spread")
    assert [c.id for c in contexts] == ["q1@0", "q1@2", "q2@0"]
    assert contexts[1].steps == ("a", "b") and contexts[1].text == "Q one?\n\na\n\nb\n\n"
    assert [c.id for c in build_contexts(traces, 2, "spread")] == [c.id for c in contexts]  # deterministic
    seed = context_seed(0, "q1@0", "target")
    assert seed == context_seed(0, "q1@0", "target") and 0 <= seed < 2**63
    assert len({seed, context_seed(0, "q1@0", "draft"), context_seed(1, "q1@0", "target"),
                context_seed(0, "q1@2", "target")}) == 4
    shards = plan_shards(list(range(7)), 3)
    assert shards == [[0, 1, 2], [3, 4, 5], [6]]
    parts = [part_shards(len(shards), i, 2) for i in range(2)]
    assert parts == [[0, 2], [1]]
    assert parse_part("1/4") == (1, 4)
    for bad in ("4/4", "x", "1/0", "-1/3"):
        with pytest.raises(ValueError, match="--shard"):
            parse_part(bad)


def test_malformed_traces_are_skipped_with_a_warning_naming_them():
    items = [Trace("ok", "math", "Q?", ["s"], "1"), {"id": "no-question", "steps": ["s"]},
             {"id": "empty-steps", "question": "Q?", "steps": []}, {"id": "ok", "question": "Q?", "steps": ["t"]},
             {"id": "bad-step", "question": "Q?", "steps": ["fine", "  "]}]
    with pytest.warns(DataWarning) as caught:
        traces = coerce_traces(items)
    assert [t.id for t in traces] == ["ok"]
    text = "\n".join(str(w.message) for w in caught)
    assert "'no-question'" in text and "'question'" in text
    assert "'empty-steps'" in text and "'steps'" in text
    assert "'bad-step'" in text and "steps[1]" in text
    assert "trace #3 (id 'ok'): id repeats" in text


def test_layer_rows():
    assert layer_rows("all", 3) == [0, 1, 2, 3]
    assert layer_rows("last", 30) == [30]
    assert layer_rows("range:27-30", 30) == LAYERS
    assert layer_rows("4, 2,2", 30) == [2, 4]
    with pytest.raises(ValueError, match="out of range"):
        layer_rows("range:28-31", 30)


def test_labels_with_empty_draws():
    lab = model_labels([0, 1, 0, 0, 2], num_samples=8)  # 3 empty draws not stored
    assert lab.cluster_sizes == [3, 1, 1] and lab.num_empty == 3
    assert lab.semantic_probs == [3 / 8, 1 / 8, 3 / 8, 3 / 8, 1 / 8]
    assert lab.num_clusters == 4  # the empty group is a meaning of its own
    want = -sum(p * math.log(p) for p in (3 / 8, 1 / 8, 1 / 8, 3 / 8))
    assert lab.semantic_entropy == pytest.approx(want)
    assert lab.representatives() == [0, 1, 4]
    ids, probs = draft_under_target([1, None, 0], lab)
    assert ids == [1, -1, 0] and probs == [1 / 8, 0.0, 3 / 8]
    with pytest.raises(ValueError, match="0..K-1"):
        model_labels([0, 2], 4)


def test_target_labels_count_the_sample_itself_draft_labels_do_not():
    """The documented scale (labels.py, data card): for a meaning with target probability pi, a target
    sample's |C_k| / N averages pi + (1 - pi) / N, a draft step's label under the target averages pi."""
    rng = random.Random(0)
    meanings, weights, n = ["m0", "m1", "m2"], [0.6, 0.3, 0.1], 5
    target_sums, draft_sums = defaultdict(list), defaultdict(list)
    for _ in range(20000):
        drawn = rng.choices(meanings, weights, k=n)
        ids = [sorted(set(drawn), key=drawn.index).index(m) for m in drawn]  # 0..K-1 by first appearance
        lab = model_labels(ids, n)
        target_sums[drawn[0]].append(lab.semantic_probs[0])  # the first target sample's own label
        draft = rng.choices(meanings, weights)[0]  # a draft step with the target's meaning distribution
        match = ids[drawn.index(draft)] if draft in drawn else None
        draft_sums[draft].append(draft_under_target([match], lab)[1][0])
    for m, pi in zip(meanings, weights):
        assert sum(target_sums[m]) / len(target_sums[m]) == pytest.approx(pi + (1 - pi) / n, abs=0.01)
        assert sum(draft_sums[m]) / len(draft_sums[m]) == pytest.approx(pi, abs=0.01)
    # a draft step equal to a target sample gets exactly that sample's label
    lab = model_labels([0, 1, 0], 3)
    assert draft_under_target([0, 1], lab)[1] == [lab.semantic_probs[0], lab.semantic_probs[1]]


def test_pairs_are_unique_per_unordered_pair_and_judged_labels_win():
    ctx = "C\n\n"
    texts = {"target": ["x", "y", "z"], "draft": ["y", "w"]}
    labels = {"target": model_labels([0, 0, 1], 3), "draft": model_labels([0, 1], 2)}
    # x~y judged; z vs x judged no; draft: y vs w judged no; w matched to no target cluster
    judged = {pair_key(ctx, "x", "y"): True, pair_key(ctx, "x", "z"): False, pair_key(ctx, "y", "w"): False,
              pair_key(ctx, "x", "w"): False, pair_key(ctx, "z", "w"): False}
    pairs, conflicts = build_pairs(ctx, texts, labels, [0, None], judged)
    keys = [pair_key(ctx, p["a_text"], p["b_text"]) for p in pairs]
    assert len(keys) == len(set(keys)) and conflicts == 0
    by_key = {k: p for k, p in zip(keys, pairs)}
    assert by_key[pair_key(ctx, "x", "y")]["equivalent"] is True
    # y vs z was never judged: implied different by the target clusters
    yz = by_key[pair_key(ctx, "y", "z")]
    assert yz["equivalent"] is False and yz["judged"] is False and yz["source"] == "cluster"
    assert by_key[pair_key(ctx, "x", "w")]["source"] == "draft_vs_target"
    # a judge that is not transitive: the judge's own decision beats the implied label
    judged[pair_key(ctx, "y", "z")] = True
    pairs, _ = build_pairs(ctx, texts, labels, [0, None], judged)
    yz = [p for p in pairs if {p["a_text"], p["b_text"]} == {"y", "z"}]
    assert len(yz) == 1 and yz[0]["equivalent"] is True and yz[0]["judged"] is True


# ----------------------------------------------------------------------------- real runs


@pytest.fixture(scope="module")
def engines():
    from specprobe.infer.config import ModelsConfig
    from specprobe.infer.engines import build_engine_pair

    return build_engine_pair(ModelsConfig(device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def judge():
    from specprobe.data_gen.judges import EmbeddingNumberJudge

    return EmbeddingNumberJudge("offline:minilm", threshold=0.8, device="cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, engines, judge):
    """The uninterrupted reference run (3 contexts, 3 shards)."""
    root = tmp_path_factory.mktemp("tiny")
    _, cfg = write_config(root, root / "run")
    result = generate_dataset(cfg.data_job(), engines=engines, judge=judge, progress=False)
    assert result.complete and not result.reused
    # the writer records the files it hashed, so the first open does not read them all again
    verified = json.loads((result.data_dir / ".verified.json").read_text())
    for shard in result.manifest["shards"]:
        for kind, rel in shard["files"].items():
            assert verified[rel][-1] == shard["digests"][kind]["sha256"]
    return cfg, result


@pytest.mark.slow
def test_labels_follow_the_clusters(tiny):
    cfg, result = tiny
    ds = open_dataset(result.data_dir)
    rows = ds.samples.to_pylist()
    n = cfg.data.num_samples
    assert len(ds.contexts) == 3 and {r["model"] for r in rows} == {"target", "draft"}
    groups = defaultdict(list)
    for r in rows:
        groups[(r["context_id"], r["model"])].append(r)
    assert len(groups) == 6
    for (_context, model), members in groups.items():
        sizes = defaultdict(int)
        for r in members:
            sizes[r["cluster_id"]] += 1
        assert sorted(sizes) == list(range(len(sizes)))  # ids 0..K-1
        empty = members[0]["num_empty"]
        assert sum(sizes.values()) + empty == n == members[0]["num_samples"]
        assert len(members) == n - empty
        assert members[0]["num_clusters"] == len(sizes) + (1 if empty else 0)
        dist = [s / n for s in sizes.values()] + ([empty / n] if empty else [])
        for r in members:
            assert r["cluster_size"] == sizes[r["cluster_id"]]
            assert r["semantic_prob"] == pytest.approx(sizes[r["cluster_id"]] / n)
            assert r["own_prob"] == pytest.approx((sizes[r["cluster_id"]] - 1) / (n - 1))  # the other N - 1 agree
            assert r["semantic_entropy"] == pytest.approx(-sum(p * math.log(p) for p in dist))
            assert r["mean_logprob"] == pytest.approx(r["logprob"] / r["num_tokens"])
            assert r["stop_reason"] in ("delimiter", "eos", "length") and r["text"].strip()
            if model == "target":
                assert r["target_cluster_id"] == r["cluster_id"] and r["prob_under_target"] == r["own_prob"]
    contexts = {c["context_id"]: c for c in ds.contexts.to_pylist()}
    for (cid, model), members in groups.items():
        assert contexts[cid][f"{model}_num_clusters"] == members[0]["num_clusters"]
        assert contexts[cid][f"{model}_seed"] == context_seed(cfg.sampling.seed, cid, model)


@pytest.mark.slow
def test_draft_under_target_agrees_with_clusters_and_pairs(tiny, judge):
    _, result = tiny
    ds = open_dataset(result.data_dir)
    rows = ds.samples.to_pylist()
    pairs = ds.pairs.to_pylist()
    n = ds.manifest["num_samples"]
    checked_pairs = 0
    for cid in {r["context_id"] for r in rows}:
        target = [r for r in rows if r["context_id"] == cid and r["model"] == "target"]
        reps = {}
        for r in target:
            reps.setdefault(r["cluster_id"], r["text"])
        size = defaultdict(int)
        for r in target:
            size[r["cluster_id"]] += 1
        ctx_pairs = {pair_key("", p["a_text"], p["b_text"]): p for p in pairs if p["context_id"] == cid}
        for d in (r for r in rows if r["context_id"] == cid and r["model"] == "draft"):
            same_text = [t["cluster_id"] for t in target if normalise_step(t["text"]) == normalise_step(d["text"])]
            if same_text:
                want = same_text[0]
            else:  # the last target representative (in id order) the stored pairs call equivalent (reference scheme)
                verdicts = [ctx_pairs[pair_key("", reps[k], d["text"])]["equivalent"] for k in sorted(reps)]
                want = max((k for k, v in zip(sorted(reps), verdicts) if v), default=-1)
                checked_pairs += len(verdicts)
            assert d["target_cluster_id"] == want, d["sample_id"]
            assert d["prob_under_target"] == pytest.approx(size[want] / n if want >= 0 else 0.0)
    assert checked_pairs > 0
    # Which outcomes (matched / unmatched draft steps) a sampled run contains depends on the sampled text,
    # so it is not asserted here; both outcomes are covered on fixed relations in test_cluster.py
    # (test_assign_to_clusters).


@pytest.mark.slow
def test_pairs_are_symmetric_and_carry_the_judges_decisions(tiny, judge):
    _, result = tiny
    ds = open_dataset(result.data_dir)
    pairs = ds.pairs.to_pylist()
    assert pairs and {p["source"] for p in pairs} <= {"cluster", "draft_vs_target"}
    keys = [(p["context_id"],) + pair_key("", p["a_text"], p["b_text"])[1:] for p in pairs]
    assert len(keys) == len(set(keys)), "an unordered pair is stored twice"
    assert all(normalise_step(p["a_text"]) != normalise_step(p["b_text"]) for p in pairs)
    contexts = {c["context_id"]: c["context_text"] for c in ds.contexts.to_pylist()}
    judged = [p for p in pairs if p["judged"]]
    assert judged
    from specprobe.data_gen.cluster import PairQuery

    swapped = judge.judge([PairQuery(contexts[p["context_id"]], p["b_text"], p["a_text"]) for p in judged])
    assert swapped == [p["equivalent"] for p in judged]  # (b, a) decided afresh gives the stored label
    both = ds.symmetric_pairs()
    assert both.num_rows == 2 * len(pairs)
    # within one model's clustering, implied labels are exactly "same cluster"
    rows = ds.samples.to_pylist()
    cluster_of = {(r["context_id"], r["model"], normalise_step(r["text"])): r["cluster_id"] for r in rows}
    for p in pairs:
        if p["source"] == "cluster" and not p["judged"]:
            same = (cluster_of[(p["context_id"], p["a_model"], normalise_step(p["a_text"]))]
                    == cluster_of[(p["context_id"], p["b_model"], normalise_step(p["b_text"]))])
            assert p["equivalent"] == same


@pytest.mark.slow
def test_features_on_disk_and_through_the_loader(tiny, engines):
    cfg, result = tiny
    ds = open_dataset(result.data_dir)
    rows = ds.samples.to_pylist()
    manifest = ds.manifest
    assert manifest["layers"] == {"target": LAYERS, "draft": LAYERS}
    for shard in manifest["shards"]:
        with safe_open(str(result.data_dir / shard["files"]["features"]), framework="pt") as f:
            assert set(f.keys()) == {"target.mean", "target.last", "draft.mean", "draft.last"}
            for key in f.keys():
                t = f.get_tensor(key)
                assert t.dtype == torch.float16 and t.shape[1:] == (len(LAYERS), HIDDEN)
                want = shard["rows"] if key.startswith("target") else shard["draft_feature_rows"]
                assert t.shape[0] == want and torch.isfinite(t).all()
    target_view = ds.target_view_features()
    assert target_view.shape == (len(rows), len(LAYERS), HIDDEN) and target_view.dtype == torch.float32
    assert ds.own_features("target").shape[0] == sum(r["model"] == "target" for r in rows)
    # alignment: recompute one draft row through the target and through the draft, alone
    target, draft = engines
    i = next(k for k, r in enumerate(rows) if r["model"] == "draft")
    r = rows[i]
    ctx = next(c for c in ds.contexts.to_pylist() if c["context_id"] == r["context_id"])
    prefix = Prefix(ctx["question"], tuple(ctx["steps"]))
    via_target = target.score(prefix, [r["text"]], layers=LAYERS).steps[0]
    via_draft = draft.score(prefix, [r["text"]], layers=LAYERS).steps[0]
    tol = dict(rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(ds.target_view_features([i])[0], via_target.mean_hidden, **tol)
    torch.testing.assert_close(ds.target_view_features([i], pooling="last")[0], via_target.last_hidden, **tol)
    draft_rows = ds.rows("draft")
    pos = int((draft_rows == i).nonzero()[0][0])
    torch.testing.assert_close(ds.own_features("draft")[pos], via_draft.mean_hidden, **tol)
    assert r["target_logprob"] == pytest.approx(via_target.logprob, abs=1e-3)
    with pytest.raises(ValueError, match="target sample"):
        ds.features("draft", rows=[next(k for k, x in enumerate(rows) if x["model"] == "target")])


@pytest.mark.slow
def test_manifest_card_datasets_and_splits(tiny, tmp_path):
    cfg, result = tiny
    ds = open_dataset(result.data_dir.parent)  # the output_dir works too
    m = ds.manifest
    assert m["status"] == "complete" and m["num_samples"] == 4 and m["judge"].startswith("embedding:")
    assert m["engines"]["target"]["model_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert {"torch", "transformers", "specprobe"} <= set(m["versions"])
    assert m["counts"]["rows"] == len(ds) and [s["index"] for s in m["shards"]] == [0, 1, 2]
    card = (result.data_dir / "README.md").read_text()
    for name in ds.samples.column_names[:-1] + ["target.mean", "draft.last", "a_text", "equivalent"]:
        assert f"`{name}`" in card
    import datasets

    loaded = datasets.load_dataset(str(result.data_dir), split="train", cache_dir=str(tmp_path / "hf"))  # card configs
    assert loaded.num_rows == len(ds) and "prob_under_target" in loaded.column_names
    questions = ds.question_ids()
    # reasoning-gym's templates are the questions' families (its own record of the items it generated)
    import reasoning_gym

    src = cfg.source
    templates = reasoning_gym.create_dataset(src.task, size=src.size, seed=src.seed).task_indices[:len(questions)]
    assert len(questions) == 3 and m["question_families"] == ds.question_families() == {
        q: f"gsm_symbolic/template-{k}" for q, k in zip(questions, templates)}
    assert f"come from {len(set(templates))} templates" in card
    mask = ds.question_mask(questions[:1])
    assert 0 < mask.sum() < len(ds)
    assert set(ds.samples.filter(mask).column("question_id").to_pylist()) == {questions[0]}
    assert ds.target_view_features(mask).shape[0] == mask.sum()


@pytest.mark.slow
def test_complete_folder_is_reused_and_other_models_are_refused(tiny, monkeypatch):
    cfg, result = tiny

    def no_loading(*a, **k):
        raise AssertionError("models must not be loaded")

    monkeypatch.setattr("specprobe.data_gen.pipeline.build_engine_pair", no_loading)  # (the name the pipeline calls)
    assert not loads_models(cfg.data_job())  # what the config check asks before it checks the models' paths
    with pytest.warns(DataWarning, match="clustered by the judge .* passed from code, not built from the config"):
        again = generate_dataset(cfg.data_job(), progress=False)  # (the fixture passed its judge in)
    assert again.reused and again.manifest["counts"] == result.manifest["counts"]
    other = dataclasses.replace(cfg, models=dataclasses.replace(cfg.models, draft="random:llama-tiny"))
    assert not loads_models(other.data_job())  # refused before anything loads
    with pytest.raises(DataMismatchError, match=r"different models:\n  models.draft: .*random:llama-tiny"):
        generate_dataset(other.data_job(), progress=False)


@pytest.mark.slow
def test_kill_9_then_resume_equals_uninterrupted(tiny, tmp_path):
    _, reference = tiny
    path, cfg = write_config(tmp_path, tmp_path / "run")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "specprobe.train.cli", "--config", str(path), "--stage", "data", "--no-progress"]
    log = open(tmp_path / "killed-run.log", "wb")
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    data_dir = cfg.data_dir
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            manifest = read_manifest(data_dir) if (data_dir / "manifest.json").exists() else None
            if manifest and manifest["shards"]:
                break
            time.sleep(0.05)
        alive = proc.poll() is None
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        log.close()
    assert alive, "the run ended before it could be killed:\n" + (tmp_path / "killed-run.log").read_text()[-3000:]
    manifest = read_manifest(data_dir)
    assert manifest["status"] == "in_progress" and 1 <= len(manifest["shards"]) < 3
    with pytest.raises(DataFolderError, match="incomplete"):
        open_dataset(data_dir)
    partial = open_dataset(data_dir, allow_incomplete=True)
    assert len(partial.contexts) == len(manifest["shards"])
    # a half-written shard left behind must never count: plant garbage under a final name
    missing = min({0, 1, 2} - {s["index"] for s in manifest["shards"]})
    (data_dir / "shards" / f"samples-{missing:05d}.parquet").write_bytes(b"not parquet")
    (data_dir / "shards" / "samples-00099.parquet").write_bytes(b"not in the plan")  # never redone: removed
    from specprobe.train.cli import main

    with pytest.warns(DataWarning, match="removed .* shard file"):  # at least the garbage and the stray file
        assert main(["--config", str(path), "--stage", "data", "--no-progress"]) == 0
    resumed = read_manifest(data_dir)
    assert resumed["status"] == "complete"
    assert [s["index"] for s in resumed["shards"]] == [0, 1, 2]
    assert resumed["shards"][0] == manifest["shards"][0]  # the finished shard was not redone
    listed = {rel.split("/")[-1] for s in resumed["shards"] for rel in s["files"].values()}
    assert {p.name for p in (data_dir / "shards").iterdir()} == listed
    assert_same_data(dataset_arrays(data_dir), dataset_arrays(reference.data_dir))


@pytest.mark.slow
def test_a_broken_shard_of_a_finished_run_is_redone_not_reused(tiny, tmp_path, engines, judge):
    import shutil

    cfg, reference = tiny
    _, copy_cfg = write_config(tmp_path, tmp_path / "run")
    shutil.copytree(reference.data_dir, copy_cfg.data_dir)
    before = read_manifest(copy_cfg.data_dir)
    path = copy_cfg.data_dir / before["shards"][1]["files"]["features"]
    path.write_bytes(path.read_bytes()[:-100])  # truncated after the run finished
    assert loads_models(copy_cfg.data_job())  # complete, but shard 1 is made again: the models are checked first
    with (pytest.warns(DataWarning, match="removed 4 shard file.*a broken shard's"),  # shard 1's four files
          pytest.warns(DataWarning, match="shard 1 will be generated again: .*features-00001.safetensors has")):
        result = generate_dataset(copy_cfg.data_job(), engines=engines, judge=judge, progress=False)
    assert result.complete and not result.reused
    after = read_manifest(copy_cfg.data_dir)
    assert after["shards"][0] == before["shards"][0] and after["shards"][2] == before["shards"][2]  # kept
    assert_same_data(dataset_arrays(copy_cfg.data_dir), dataset_arrays(reference.data_dir))


def test_shards_without_a_manifest_are_not_overwritten(tiny, tmp_path, engines, judge):
    import shutil

    _, reference = tiny
    _, cfg = write_config(tmp_path, tmp_path / "run")
    shutil.copytree(reference.data_dir, cfg.data_dir)
    (cfg.data_dir / "manifest.json").unlink()
    stamp = {p.name: p.stat().st_mtime_ns for p in (cfg.data_dir / "shards").iterdir()}
    with pytest.raises(DataFolderError, match="holds 12 shard files .* but no manifest.json.*nothing was overwritten"):
        generate_dataset(cfg.data_job(), engines=engines, judge=judge, progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in (cfg.data_dir / "shards").iterdir()} == stamp


def test_a_run_killed_before_its_first_shard_is_listed_resumes(tiny, tmp_path, engines, judge, monkeypatch):
    """Killed after shard 0's files are in place but before the manifest lists them: the next run redoes that
    shard instead of refusing the folder as foreign shard files, and may change the settings, since nothing was
    finished under them."""
    import specprobe.data_gen.pipeline as pipeline

    _, reference = tiny
    _, first = write_config(tmp_path, tmp_path / "run", data={"num_samples": 3})
    _, cfg = write_config(tmp_path, tmp_path / "run")
    listed = pipeline.write_manifest

    def killed_when_listing(folder, manifest):
        if manifest["shards"]:
            raise KeyboardInterrupt
        listed(folder, manifest)

    monkeypatch.setattr(pipeline, "write_manifest", killed_when_listing)
    with pytest.raises(KeyboardInterrupt):
        generate_dataset(first.data_job(), engines=engines, judge=judge, progress=False)
    assert any((cfg.data_dir / "shards").glob("samples-00000*")) and read_manifest(cfg.data_dir)["shards"] == []
    stray = cfg.data_dir / "shards" / "samples-00099.parquet"  # an index the new plan lacks, so never redone
    stray.write_bytes(b"left by the failed run")
    monkeypatch.setattr(pipeline, "write_manifest", listed)
    with pytest.warns(DataWarning, match="removed .* shard file"):
        result = generate_dataset(cfg.data_job(), engines=engines, judge=judge, progress=False)
    assert result.complete
    listed_files = {rel.split("/")[-1] for s in result.manifest["shards"] for rel in s["files"].values()}
    assert {p.name for p in (cfg.data_dir / "shards").iterdir()} == listed_files  # the stray file is gone
    assert_same_data(dataset_arrays(cfg.data_dir), dataset_arrays(reference.data_dir))


def test_a_second_launch_on_a_locked_folder_touches_nothing(tmp_path, monkeypatch):
    """The folder lock comes first: a second run neither repairs the running one's judge cache (cutting the line
    it may be appending) nor loads models."""
    from specprobe.data_gen.store import JUDGE_CACHE, FolderLock

    monkeypatch.setattr("specprobe.data_gen.pipeline.build_judge",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("no judge may load first")))
    _, cfg = write_config(tmp_path, tmp_path / "run")
    cache = cfg.data_dir / JUDGE_CACHE
    cache.parent.mkdir(parents=True)
    cache.write_text('{"key": "a", "equivalent": true}\n{"key": "b", "equiv')  # a writer mid-line
    with FolderLock(cfg.data_dir), pytest.raises(DataFolderError, match="another process is writing"):
        generate_dataset(cfg.data_job(), progress=False)
    assert cache.read_text().endswith('"equiv')


def test_train_refuses_data_whose_recorded_model_differs_in_any_field(tiny):
    from specprobe.train.pipeline import check_data_models
    from specprobe.train.probes_train import TrainingDataError

    cfg, reference = tiny
    manifest = read_manifest(reference.data_dir)
    check_data_models(manifest, cfg)  # as written: every field matches
    edited = json.loads(json.dumps(manifest))
    edited["engines"]["target"]["model_id"] = "someone/other-model"  # name and config entry still match
    with pytest.raises(TrainingDataError, match=r"fields that differ: engines\.target\.model_id"):
        check_data_models(edited, cfg)
    model_id = manifest["engines"]["target"]["model_id"]
    assert "/" in model_id  # an org/name hub id
    edited["engines"]["target"]["model_id"] = "other-org/" + model_id.rsplit("/", 1)[-1]  # same name, other org
    with pytest.raises(TrainingDataError, match=r"fields that differ: engines\.target\.model_id"):
        check_data_models(edited, cfg)
    edited["engines"]["target"]["model_id"] = "/models/" + model_id.rsplit("/", 1)[-1]  # a local copy of it
    check_data_models(edited, cfg)


@pytest.mark.slow
def test_shard_parts_then_merge_equals_single_run(tiny, tmp_path, engines, judge):
    _, reference = tiny
    _, cfg = write_config(tmp_path, tmp_path / "run")
    first = generate_dataset(cfg.data_job(), engines=engines, judge=judge, part=(0, 2), progress=False)
    assert first.data_dir == cfg.data_dir / "part-0-of-2" and first.complete
    assert [s["index"] for s in first.manifest["shards"]] == [0, 2]
    with pytest.raises(DataFolderError):
        open_dataset(cfg.data_dir)  # nothing merged yet
    half = merge_parts(cfg.data_dir)  # part 1 not run yet: merged but incomplete
    assert half["status"] == "in_progress" and [s["index"] for s in half["shards"]] == [0, 2]
    generate_dataset(cfg.data_job(), engines=engines, judge=judge, part=(1, 2), progress=False)
    merged = merge_parts(cfg.data_dir)
    assert merged["status"] == "complete" and [s["index"] for s in merged["shards"]] == [0, 1, 2]
    assert_same_data(dataset_arrays(cfg.data_dir), dataset_arrays(reference.data_dir))


class _OtherJudge:
    """A judge known only by its name (never asked: every check refuses it before a pair is judged)."""

    name = "other-judge"

    def judge(self, items):
        raise AssertionError("not to be called")


def _copy_folder(src: Path, dst: Path, **manifest_fields) -> Path:
    """A copy of the data folder `src` at `dst` with `manifest_fields` set in its manifest."""
    import shutil

    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest.update(manifest_fields)
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def test_data_made_by_one_judge_is_not_reused_resumed_or_merged_with_another(tiny, tmp_path, engines):
    """The clusters (and so every label) are the judge's: a folder is reused, resumed and merged only with the judge
    that made it. A judge passed from code is not in the settings' fingerprint; its recorded name is compared."""
    cfg, reference = tiny
    made_by = reference.manifest["judge"]
    with pytest.raises(DataMismatchError, match=f"clustered by the judge '{made_by}', not by 'other-judge'"):
        generate_dataset(cfg.data_job(), engines=engines, judge=_OtherJudge(), progress=False)
    # resumed with the configured judge a folder that another judge started (its last shard not yet finished)
    _, other = write_config(tmp_path, tmp_path / "run")
    shards = reference.manifest["shards"]
    _copy_folder(reference.data_dir, other.data_dir, judge="other-judge", shards=shards[:-1], status="in_progress",
                 completed=None)
    with pytest.raises(DataMismatchError, match=f"clustered by the judge 'other-judge', not by '{made_by}'"):
        generate_dataset(other.data_job(), engines=engines, progress=False)
    assert len(read_manifest(other.data_dir)["shards"]) == len(shards) - 1  # nothing was redone or dropped
    # parts made by two judges are not joined
    _, merged = write_config(tmp_path, tmp_path / "merged")
    for i, mine, judge_name in ((0, [0, 2], made_by), (1, [1], "other-judge")):
        _copy_folder(reference.data_dir, merged.data_dir / f"part-{i}-of-2", judge=judge_name,
                     part={"index": i, "count": 2, "shards": mine}, shards=[s for s in shards if s["index"] in mine])
    with pytest.raises(DataMismatchError, match="part-1-of-2 was clustered by the judge 'other-judge'"):
        merge_parts(merged.data_dir)
    assert not (merged.data_dir / "manifest.json").exists()


def test_a_folder_of_the_old_draft_assignment_is_not_resumed_or_merged(tiny, tmp_path, engines):
    """Folders made before draft steps took the last match under the reference scheme record no rule (first
    match): resuming or merging one would mix two labelling rules in one data set."""
    cfg, reference = tiny
    assert reference.manifest["draft_assignment"] == "last_match"
    shards = reference.manifest["shards"]
    _, old = write_config(tmp_path, tmp_path / "old")
    _copy_folder(reference.data_dir, old.data_dir, draft_assignment=None, shards=shards[:-1], status="in_progress",
                 completed=None)
    with pytest.raises(DataMismatchError, match="by the first_match rule, this run by the last_match rule"):
        generate_dataset(old.data_job(), engines=engines, progress=False)
    assert len(read_manifest(old.data_dir)["shards"]) == len(shards) - 1  # nothing was redone or dropped
    _, merged = write_config(tmp_path, tmp_path / "merged")
    for i, mine, rule in ((0, [0, 2], "last_match"), (1, [1], None)):
        _copy_folder(reference.data_dir, merged.data_dir / f"part-{i}-of-2", draft_assignment=rule,
                     part={"index": i, "count": 2, "shards": mine}, shards=[s for s in shards if s["index"] in mine])
    with pytest.raises(DataMismatchError, match="part-1-of-2 placed draft steps .* by the first_match rule"):
        merge_parts(merged.data_dir)


class _FailingEngine:
    """A real engine that fails (as a driver or an out-of-memory error would) for prompts holding "FAIL-HERE"."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, requests, params):
        if any("FAIL-HERE" in r.prefix.question for r in requests):
            raise RuntimeError("device lost")
        return self.engine.generate(requests, params)


def test_an_unexpected_engine_error_names_its_context(tmp_path, engines, judge, monkeypatch, capsys):
    from specprobe.data_gen.sources import load_traces
    from specprobe.train import cli

    good = load_traces("reasoning_gym", name="gsm_symbolic", size=1, seed=5)[0]
    bad = Trace("failing", "math", "FAIL-HERE " + good.question, good.steps, good.answer)
    _, cfg = write_config(tmp_path, tmp_path / "run")
    wrapped = tuple(_FailingEngine(e) for e in engines)
    with pytest.raises(RuntimeError, match="device lost") as info:
        generate_dataset(cfg.data_job(), traces=[bad], engines=wrapped, judge=judge, progress=False)
    notes = sys.version_info >= (3, 11)  # exception notes need Python 3.11; the error and exit code do not
    if notes:
        assert any("while sampling for context failing@0 (question failing)" in n for n in info.value.__notes__)
    # probe-train prints the note with the error
    monkeypatch.setattr(cli, "run_data_stage", lambda *a, **k: (_ for _ in ()).throw(info.value))
    assert cli.main(["--config", str(tmp_path / "tiny-test.yaml"), "--stage", "data"]) == 1
    err = capsys.readouterr().err
    assert "RuntimeError: device lost" in err
    if notes:
        assert "RuntimeError: device lost\n  (while sampling for context failing@0" in err


def test_skip_failing_contexts_keeps_the_others_and_the_reason(tmp_path, engines, judge, caplog):
    import logging

    from specprobe.data_gen.sources import load_traces

    caplog.set_level(logging.INFO, logger="specprobe.data_gen.pipeline")

    good = load_traces("reasoning_gym", name="gsm_symbolic", size=1, seed=5)[0]
    bad = Trace("failing", "math", "FAIL-HERE " + good.question, good.steps[:1], good.answer)
    _, cfg = write_config(tmp_path, tmp_path / "run", data={"skip_failing_contexts": True, "max_context_steps": 1,
                                                            "contexts_per_shard": 2})
    wrapped = tuple(_FailingEngine(e) for e in engines)
    result = generate_dataset(cfg.data_job(), traces=[bad, good], engines=wrapped, judge=judge, progress=False)
    skipped = [x for shard in result.manifest["shards"] for x in shard["skipped"]]
    assert [x["context_id"] for x in skipped] == ["failing@0"]
    assert skipped[0]["reason"] == "RuntimeError while sampling: device lost (data.skip_failing_contexts)"
    ds = open_dataset(result.data_dir)
    assert set(ds.column("question_id")) == {good.id}  # the other question's contexts are kept
    # progress=False: no bar, so a line per shard says how far the run is and how long is left
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: shard ")]
    assert lines and lines[-1].startswith("data: shard ") and " of 2 contexts, " in lines[-1]
    assert "2 of 2 contexts" in lines[-1] and lines[-1].endswith(" elapsed")  # all done: nothing left to estimate
    # a shard whose every context failed stops the run (a lasting fault would empty the rest of the data)
    _, alone = write_config(tmp_path, tmp_path / "alone", data={"skip_failing_contexts": True, "max_context_steps": 1})
    with pytest.raises(DataFolderError, match="every context of shard 0 failed .*device lost"):
        generate_dataset(alone.data_job(), traces=[bad], engines=wrapped, judge=judge, progress=False)


class _AtRevision:
    """A real engine that reports another revision of its weights."""

    def __init__(self, engine, revision):
        self.engine, self.info = engine, dataclasses.replace(engine.info, revision=revision)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def test_a_resume_refuses_edited_source_texts_and_other_weights(tiny, tmp_path, engines, judge):
    """A started folder resumes only on the same contexts (texts, not only ids) and the same revision of each
    model; an older folder whose plan lacks the texts' hash still resumes."""
    from specprobe.data_gen.pipeline import load_source_traces

    cfg, reference = tiny
    shards = reference.manifest["shards"]
    _, started = write_config(tmp_path, tmp_path / "run")
    _copy_folder(reference.data_dir, started.data_dir, shards=shards[:-1], status="in_progress", completed=None)
    traces = load_source_traces(cfg.source)
    edited = [dataclasses.replace(traces[0], question=traces[0].question + " (edited)"), *traces[1:]]
    with pytest.raises(DataFolderError, match=r"the context plan changed .*\(context_texts_sha256 differ\)"):
        generate_dataset(started.data_job(), traces=edited, engines=engines, judge=judge, progress=False)
    manifest = read_manifest(started.data_dir)
    manifest["engines"]["target"]["revision"] = "abc123"
    (started.data_dir / "manifest.json").write_text(json.dumps(manifest))
    moved = (_AtRevision(engines[0], "def456"), engines[1])
    with pytest.raises(DataFolderError, match="at revision abc123, but the loaded one is at revision def456"):
        generate_dataset(started.data_job(), engines=moved, judge=judge, progress=False)
    # a folder started before the texts were hashed (and at an unknown revision) resumes and completes
    manifest["engines"]["target"]["revision"] = None
    manifest["plan"].pop("context_texts_sha256")
    (started.data_dir / "manifest.json").write_text(json.dumps(manifest))
    result = generate_dataset(started.data_job(), engines=engines, judge=judge, progress=False)
    assert result.complete and len(result.manifest["shards"]) == len(shards)


def test_a_part_with_no_shard_is_an_error_before_the_models_load(tiny, tmp_path, monkeypatch, judge):
    cfg, reference = tiny

    def no_loading(*a, **k):
        raise AssertionError("models must not be loaded")

    monkeypatch.setattr("specprobe.data_gen.pipeline.build_engine_pair", no_loading)
    _, fresh = write_config(tmp_path, tmp_path / "run")
    n = reference.manifest["plan"]["num_shards"]
    with pytest.raises(DataFolderError, match=rf"part {n} of {n + 1} has no shard: the plan has {n} shard\(s\)"):
        generate_dataset(fresh.data_job(), part=(n, n + 1), judge=judge, progress=False)
    assert read_manifest(fresh.data_dir / f"part-{n}-of-{n + 1}") is None


@pytest.mark.slow
def test_bad_traces_and_empty_contexts_are_skipped_with_warnings(tmp_path, engines, judge):
    from specprobe.data_gen.sources import load_traces

    good = load_traces("reasoning_gym", name="gsm_symbolic", size=2, seed=5)
    half = Trace(good[1].id, "math", good[1].question + " (EMPTY-HALF)", good[1].steps, good[1].answer)
    empty = Trace("all-empty", "math", "EMPTY-ALL " + good[0].question, good[0].steps, good[0].answer)
    unscorable = Trace("too-long", "math", "SCORE-TOO-LONG " + good[0].question, good[0].steps, good[0].answer)
    traces = [good[0], {"id": "broken", "steps": ["s"]}, half, empty, unscorable]
    _, cfg = write_config(tmp_path, tmp_path / "run", data={"contexts_per_shard": 8})
    wrapped = tuple(BlankingEngine(e) for e in engines)
    with pytest.warns(DataWarning) as caught:
        result = generate_dataset(cfg.data_job(), traces=traces, engines=wrapped, judge=judge, progress=False)
    messages = "\n".join(str(w.message) for w in caught)
    assert "id 'broken'" in messages and "'question'" in messages
    assert "context 'all-empty@0'" in messages and "samples are empty" in messages
    ds = open_dataset(result.data_dir)
    assert ds.contexts.column("context_id").to_pylist() == [f"{good[0].id}@0", f"{good[1].id}@0"]
    skipped = result.manifest["shards"][0]["skipped"]
    assert [x["context_id"] for x in skipped] == ["all-empty@0", "too-long@0"]  # the others' work is kept
    assert "too long to score" in skipped[1]["reason"] and "context 'too-long@0'" in messages
    rows = [r for r in ds.samples.to_pylist() if r["question_id"] == good[1].id]
    n = cfg.data.num_samples
    for model in ("target", "draft"):
        mine = [r for r in rows if r["model"] == model]
        assert len(mine) == n - n // 2 and all(r["num_empty"] == n // 2 for r in mine)
        assert [r["sample_index"] for r in mine] == list(range(n // 2, n))
        sizes = defaultdict(int)
        for r in mine:
            sizes[r["cluster_id"]] += 1
        assert sum(sizes.values()) + n // 2 == n
        assert all(r["semantic_prob"] == pytest.approx(sizes[r["cluster_id"]] / n) for r in mine)
        assert mine[0]["num_clusters"] == len(sizes) + 1


def test_nli_model_without_entailment_label_fails_before_any_work(tmp_path, monkeypatch):
    from transformers import AutoTokenizer, DebertaV2Config, DebertaV2ForSequenceClassification

    from specprobe.infer.models import offline_model_folder

    tok = AutoTokenizer.from_pretrained(offline_model_folder("minilm"))
    config = DebertaV2Config(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                             intermediate_size=32, num_labels=2, id2label={0: "yes", 1: "no"},
                             label2id={"yes": 0, "no": 1}, pad_token_id=tok.pad_token_id)
    folder = tmp_path / "nli"
    DebertaV2ForSequenceClassification(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    monkeypatch.setattr("specprobe.data_gen.pipeline.build_engine_pair",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("no model may load first")))
    monkeypatch.setattr("specprobe.data_gen.pipeline.load_source_traces",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("no trace may load first")))
    _, cfg = write_config(tmp_path, tmp_path / "run", data={"judge": "nli", "nli_model": str(folder)})
    with pytest.raises(ValueError, match="no 'entailment' label"):
        generate_dataset(cfg.data_job(), progress=False)
    assert not (cfg.data_dir / "manifest.json").exists() and not (cfg.data_dir / "shards").exists()


def test_cli_help_config_and_train_stage(capsys):
    from specprobe.train.cli import main

    assert main(["--help-config"]) == 0
    out = capsys.readouterr().out
    assert "data.judge_pairs_per_call" in out and "data.layers" in out
    with pytest.raises(SystemExit):
        main(["--stage", "data"])  # --config missing
    assert main(["--config", "does-not-exist.yaml", "--stage", "data"]) == 1
    assert "config file not found" in capsys.readouterr().err


def test_pilot_stops_a_run_whose_steps_hit_the_cap_and_keeps_its_shards(tmp_path, engines, judge):
    """A 3-token cap cuts nearly every step: after the 1-context pilot the run stops with an error naming the
    share, the cap and the delimiter; the finished shard stays, and the same folder goes on once told to."""
    from specprobe.data_gen.pipeline import CappedStepsError
    from specprobe.data_gen.store import read_manifest

    sections = dict(sampling={"max_step_tokens": 3}, data={"pilot_contexts": 1, "max_capped_share": 0.15})
    _, cfg = write_config(tmp_path, tmp_path / "run", **sections)
    with pytest.raises(CappedStepsError, match=r"after the pilot's 1 contexts, \d+\.\d% .*max_step_tokens=3.*'\\n\\n'"):
        generate_dataset(cfg.data_job(), engines=engines, judge=judge, progress=False)
    manifest = read_manifest(cfg.data_dir)
    assert len(manifest["shards"]) == 1 and manifest["status"] != "complete"
    capped, samples = manifest["shards"][0]["stats"]["capped"], manifest["shards"][0]["stats"]["samples"]
    assert sum(capped.values()) > 0.15 * sum(samples.values())
    sections["data"]["max_capped_share"] = None
    _, cfg = write_config(tmp_path, tmp_path / "run", **sections)  # not in the fingerprint: the folder is reused
    result = generate_dataset(cfg.data_job(), engines=engines, judge=judge, progress=False)
    assert result.complete and len(result.manifest["shards"]) == 3


@pytest.mark.slow
def test_a_run_that_skips_every_context_is_an_error_and_bad_text_is_cleaned(tmp_path, engines, judge):
    from specprobe.data_gen.sources import load_traces

    good = load_traces("reasoning_gym", name="gsm_symbolic", size=1, seed=5)[0]
    empty = Trace("all-empty", "math", "EMPTY-ALL " + good.question, good.steps, good.answer)
    _, cfg = write_config(tmp_path, tmp_path / "run")
    wrapped = tuple(BlankingEngine(e) for e in engines)
    with pytest.warns(DataWarning), pytest.raises(DataFolderError, match="all 1 contexts were skipped.*all-empty@0"):
        generate_dataset(cfg.data_job(), traces=[empty], engines=wrapped, judge=judge, progress=False)
    # the folder is finished (its shards are kept), and asking for it again is the same error, not an empty data set
    with pytest.raises(DataFolderError, match="all 1 contexts were skipped.*all-empty@0"):
        generate_dataset(cfg.data_job(), traces=[empty], engines=wrapped, judge=judge, progress=False)
    # a record far larger than the context window (the 5 MB case): skipped, and the empty run is an error
    huge = Trace("huge", "math", good.question + " 12 apples." * 9000, good.steps, good.answer)
    _, cfg = write_config(tmp_path, tmp_path / "run-huge")
    with pytest.warns(DataWarning), pytest.raises(DataFolderError, match="all 1 contexts were skipped.*huge@0.*too long"):
        generate_dataset(cfg.data_job(), traces=[huge], engines=engines, judge=judge, progress=False)
    # a lone surrogate and a control character: replaced, the record kept and named
    bad = {"id": "surrogate", "question": good.question + " \ud800\x07", "steps": list(good.steps), "answer": good.answer}
    _, cfg = write_config(tmp_path, tmp_path / "run2")
    with pytest.warns(DataWarning, match=r"id 'surrogate'.*replaced 2 lone surrogate or control characters in question"):
        result = generate_dataset(cfg.data_job(), traces=[bad], engines=engines, judge=judge, progress=False)
    assert result.complete and open_dataset(result.data_dir).contexts.num_rows == 1


@pytest.mark.slow
def test_the_nli_judge_built_from_the_config_decides_the_clusters(tmp_path, engines):
    """data.judge=nli end to end (every full-size config's judge): the pipeline builds the NLI judge from
    data.nli_model, and its verdicts are the clusters. A tiny random DeBERTa with MNLI's labels whose classifier
    always says entailment puts each context's samples in one meaning; always contradiction, one per distinct text."""
    from transformers import AutoTokenizer, DebertaV2Config, DebertaV2ForSequenceClassification

    from specprobe.data_gen.pipeline import load_source_traces
    from specprobe.infer.models import offline_model_folder

    tok = AutoTokenizer.from_pretrained(offline_model_folder("minilm"))
    labels = {0: "CONTRADICTION", 1: "NEUTRAL", 2: "ENTAILMENT"}  # (deberta-large-mnli's names)
    config = DebertaV2Config(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                             intermediate_size=32, num_labels=3, id2label=labels,
                             label2id={v: k for k, v in labels.items()}, pad_token_id=tok.pad_token_id)
    traces = [t for t in load_source_traces(write_config(tmp_path, tmp_path / "src")[1].source)][:2]
    for winner, name in ((2, "entails"), (0, "contradicts")):
        torch.manual_seed(0)
        model = DebertaV2ForSequenceClassification(config).eval()
        with torch.no_grad():
            model.classifier.weight.zero_()
            model.classifier.bias.copy_(torch.nn.functional.one_hot(torch.tensor(winner), 3) * 10.0)
        folder = tmp_path / f"nli-{name}"
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        _, cfg = write_config(tmp_path, tmp_path / name, data={"judge": "nli", "nli_model": str(folder),
                                                               "num_samples": 3})
        result = generate_dataset(cfg.data_job(), traces=traces, engines=engines, progress=False)
        assert str(folder) in result.manifest["judge"]
        rows = open_dataset(result.data_dir).samples.to_pylist()
        varied = 0  # groups whose samples differ: where the two judges must disagree
        for (context, model_name), group in itertools.groupby(sorted(rows, key=lambda r: (r["context_id"], r["model"])),
                                                              key=lambda r: (r["context_id"], r["model"])):
            group = list(group)
            meanings = len({r["cluster_id"] for r in group})
            distinct = len({normalise_step(r["text"]) for r in group})
            varied += distinct > 1
            assert meanings == (1 if winner == 2 else distinct), (name, context, model_name)
            assert all(r["semantic_prob"] == pytest.approx(
                sum(o["cluster_id"] == r["cluster_id"] for o in group) / cfg.data.num_samples) for r in group)
        assert varied >= 2, name
