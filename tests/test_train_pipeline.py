"""train.pipeline on a synthetic data folder: question split, probes vs baselines, checkpoint round trip,
runtime loading, CLI and wandb offline. (The MLP itself is tested in test_probe_mlp.py.)"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors import safe_open

from specprobe.data_gen.store import open_dataset
from specprobe.infer.checkpoint_format import Checkpoint, find_pickles
from specprobe.train import pipeline
from specprobe.train.pipeline import SIDES, QuestionSplit, train_all
from specprobe.train.probes_train import TrainingDataError

from _train_fixtures import synthetic_config, write_synthetic_data

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny MLPs: one thread is fastest


@pytest.fixture(scope="module")
def embedder():
    from specprobe.infer.embedder import SentenceEmbedder

    return SentenceEmbedder("offline:minilm", device="cpu")


@pytest.fixture(scope="module")
def run(tmp_path_factory, embedder):
    out = tmp_path_factory.mktemp("syn")
    write_synthetic_data(out, questions=12)
    cfg = synthetic_config(out, out)
    lines: list[str] = []
    result = train_all(cfg, print_fn=lines.append, embedder=embedder)
    return cfg, result, "\n".join(lines)


def test_split_is_by_question_everywhere(run):
    cfg, result, _ = run
    ds = open_dataset(cfg.data_dir)
    split = QuestionSplit.of_data(ds, cfg.probe)
    prepared = pipeline.prepare(ds, cfg, split)
    sides = {}
    for side, sets in prepared.sets[cfg.probe.pooling].items():
        for rows in sets.values():
            for q in rows.questions:
                assert sides.setdefault(q, side) == side, f"question {q} is on two sides"
    for side, pairs in prepared.pairs.items():
        for q in pairs.questions:
            assert sides.setdefault(q, side) == side, f"question {q}'s pairs are on another side than its samples"
    recorded = result.metrics["split"]
    assert set(recorded["train"]).isdisjoint(recorded["val"])
    assert sorted(recorded["train"] + recorded["val"] + recorded["test"]) == ds.question_ids()
    assert {q for q, s in sides.items() if s == "val"} == set(recorded["val"])


def test_a_checkpoint_without_a_recorded_split_is_split_with_the_settings_it_recorded():
    """probe-eval recomputes an old checkpoint's split from its probe section: a key it lacks predates the setting
    (no test split then), the others take the config's default; what it recorded wins."""
    assert vars(QuestionSplit.recorded_settings({})) == {"val_fraction": 0.2, "test_fraction": 0.0, "seed": 0}
    assert vars(QuestionSplit.recorded_settings({"val_fraction": 0.3, "test_fraction": 0.25, "seed": 5})) == \
        {"val_fraction": 0.3, "test_fraction": 0.25, "seed": 5}


def test_test_questions_carry_the_groups_the_split_kept_together(tmp_path):
    """probe-train's test questions for probe-bench: a template's members share its name, a renamed duplicate record
    and its original share one family, a question alone has none; a question the data lacks is an error."""
    import pyarrow as pa

    from specprobe.train.pipeline import write_questions

    ids = ["a", "a-dup1", "t1", "t2", "solo"]
    families = {"a-dup1": "a", "t1": "tmpl/3", "t2": "tmpl/3"}
    ds = SimpleNamespace(folder=tmp_path, question_ids=lambda: ids, question_families=lambda: families,
                         contexts=pa.table({"question_id": ids + ["t1"], "question": [f"{q}?" for q in ids] + ["t1?"],
                                            "answer": ["1", "1", "2", "3", "4", "2"]}))
    out = tmp_path / "q.jsonl"
    assert write_questions(ds, ids, out) == 5  # one line per question, though t1 has two contexts
    got = {r["id"]: r.get("family") for r in map(json.loads, out.read_text().splitlines())}
    assert got == {"a": "a", "a-dup1": "a", "t1": "tmpl/3", "t2": "tmpl/3", "solo": None}
    with pytest.raises(TrainingDataError, match=r"no context of question\(s\) \['gone'\]"):
        write_questions(ds, ["solo", "gone"], out)


def test_question_split_keeps_a_family_on_one_side():
    qids = [f"q{i:02d}" for i in range(40)]
    families = {q: f"template-{i % 10}" for i, q in enumerate(qids)}  # 10 templates of 4 questions
    settings = SimpleNamespace(val_fraction=0.2, test_fraction=0.2, seed=3)
    split = QuestionSplit.make(qids, settings, families)
    for family in set(families.values()):
        assert len({split.side_of[q] for q in qids if families[q] == family}) == 1, family
    assert [len(split.families(side)) for side in ("train", "val", "test")] == [6, 2, 2]  # fractions count families
    recorded = split.to_dict()
    assert recorded["by"] == "question family" and recorded["families"]["test"] == split.families("test")
    # a renamed duplicate record (family: its original's id) lands with its original, which has no family
    copies = {f"q{i:02d}-dup1": f"q{i:02d}" for i in range(40)}
    with_copies = QuestionSplit.make(qids + list(copies), settings, copies)
    assert all(with_copies.side_of[c] == with_copies.side_of[q] for c, q in copies.items())
    assert [with_copies.side_of[q] for q in qids] == [QuestionSplit.make(qids, settings).side_of[q] for q in qids]
    alone = QuestionSplit.make(qids, settings)  # without families each question is split on its own
    assert "families" not in alone.to_dict() and alone.to_dict()["by"] == "question_id"
    assert any(len({alone.side_of[q] for q in qids if families[q] == f}) > 1 for f in set(families.values()))


def test_probe_train_keeps_a_template_on_one_side_and_records_it(tmp_path, embedder):
    from specprobe.data_gen.store import FAMILIES, MANIFEST, write_manifest

    data = write_synthetic_data(tmp_path, questions=12)
    manifest = json.loads((data / MANIFEST).read_text())
    manifest[FAMILIES] = {f"q{i}": f"template-{i % 4}" for i in range(12)}  # 4 templates of 3 questions
    write_manifest(data, manifest)
    lines: list[str] = []
    cfg = synthetic_config(tmp_path, tmp_path)
    result = train_all(cfg, print_fn=lines.append, embedder=embedder)
    split = result.metrics["split"]
    assert split["by"] == "question family" and "warning" not in split
    card = (Path(cfg.checkpoint_dir) / "README.md").read_text()
    assert f"- split by question family (seed {split['seed']}): train {len(split['train'])} questions of " in card
    for i in range(4):
        members = {f"q{j}" for j in range(12) if j % 4 == i}
        assert sum(bool(members & set(split[side])) for side in SIDES) == 1, i  # one side per template
    assert sorted(f for side in SIDES for f in split["families"][side]) == [f"template-{i}" for i in range(4)]
    assert any("(templates " in line for line in lines)
    # a reasoning-gym folder made before families were recorded: the split says it may leak
    del manifest[FAMILIES]
    manifest["config"]["source"]["kind"] = "reasoning_gym"
    write_manifest(data, manifest)
    again = train_all(synthetic_config(tmp_path, tmp_path / "old"), dataset=open_dataset(data),
                      print_fn=lines.append, embedder=embedder)
    assert "before the data stage recorded question families" in again.metrics["split"]["warning"]


def test_probes_beat_the_constant_baseline(run):
    _, result, _ = run
    probes = result.metrics["probes"]
    assert set(probes) == {"probe_target", "probe_draft", "probe_acceptance"}
    draft = probes["probe_draft"]["val"]["draft_own"]
    assert draft["probe"]["mae"] < 0.7 * draft["constant"]["mae"]
    target = probes["probe_target"]["val"]["draft_via_target"]
    assert target["probe"]["mae"] < 0.7 * target["constant"]["mae"]
    assert set(target) == {"probe", "logistic", "variant", "last_layer", "logprob", "logprob_isotonic", "constant"}
    assert target["logistic"]["mae"] < 0.7 * target["constant"]["mae"]  # the planted signal is linear
    logistic = probes["probe_target"]["logistic"]
    assert logistic["kind"] == "logistic" and logistic["selection"] and logistic["l2"] > 0
    assert probes["probe_target"]["trained_on"] == ["target_own", "draft_via_target"]


def test_console_table_lists_every_verifier_and_baseline(run):
    _, _, printed = run
    for text in ("probe_target", "probe_draft", "on draft_via_target", "last-layer probe",
                 "log-prob, logistic fit on this set", "logistic probe (same sets)", "constant (this set's mean label)",
                 "embedding threshold verifier", "cosine>=0.85", "accept all", "[probe_draft] epoch 0"):
        assert text in printed


def test_checkpoint_round_trip_gives_identical_predictions(run):
    cfg, result, _ = run
    ckpt = Checkpoint(cfg.checkpoint_dir)
    assert {"probe_target", "probe_draft", "probe_target_own", "baseline_last_layer_target",
            "baseline_last_layer_draft", "baselines", "embedding_threshold"} <= set(ckpt.components)
    ds = open_dataset(cfg.data_dir)
    x_target = ds.features("target", "mean")
    x_draft = ds.features("draft", "mean")
    for name, x in (("probe_target", x_target), ("probe_draft", x_draft), ("baseline_last_layer_target", x_target)):
        trained = result.probes.probes[name]
        want = trained.probe.predict_proba(x[:, trained.cols])
        torch.testing.assert_close(ckpt.probe(name).predict_proba(x[:, trained.cols]), want, rtol=0, atol=0)
    lp = np.linspace(-3, 0, 7)
    np.testing.assert_array_equal(ckpt.baselines()["target"].logprob.predict(lp),
                                  result.probes.baselines["target"].logprob.predict(lp))
    assert ckpt.baselines()["draft"].constant.value == result.probes.baselines["draft"].constant.value
    assert ckpt.embedding().threshold == result.embedding.fit.threshold
    assert ckpt.metrics["split"] == result.metrics["split"]


def test_checkpoint_has_no_pickle_and_plain_safetensors(run):
    cfg, _, _ = run
    folder = Path(cfg.checkpoint_dir)
    assert find_pickles(folder) == []
    files = list(folder.rglob("*"))
    assert not [f for f in files if f.suffix in (".pt", ".pth", ".pkl", ".bin", ".ckpt")]
    assert all(f.stat().st_mode & 0o044 == 0o044 for f in files), "checkpoint files must be readable by others"
    tensors = [f for f in files if f.suffix == ".safetensors"]
    assert sorted(p.stem for p in tensors) == ["baseline_last_layer_draft", "baseline_last_layer_target",
                                               "probe_acceptance", "probe_draft",
                                               "probe_draft_logistic", "probe_target", "probe_target_logistic",
                                               "probe_target_own"]
    for path in tensors:
        with safe_open(str(path), framework="pt") as f:
            assert f.keys()
    spec = json.loads((folder / "probe_target.json").read_text())["feature_spec"]
    assert spec == {"model_id": "toy/target-model", "num_layers": 3, "hidden_size": 8, "layers": [0, 1, 2, 3],
                    "combine": "concat", "pooling": "mean", "revision": None}
    meta = json.loads((folder / "checkpoint.json").read_text())
    assert meta["format"] == "specprobe-checkpoint" and meta["config"]["probe"]["hidden_dim"] == 16
    assert meta["data"]["folder"] == "../data"  # relative: a copied checkpoint + data finds its own copy
    card = (folder / "README.md").read_text()
    assert "## Validation metrics" in card and "validation-question numbers" in card and "probe-eval --checkpoint" in card


def test_a_copied_checkpoint_reads_the_copied_data(run, tmp_path):
    import shutil

    from specprobe.train.report.inputs import open_checkpoint, training_data_folder

    cfg, _, _ = run
    copy = tmp_path / "moved"
    shutil.copytree(Path(cfg.output_dir) / "data", copy / "data")
    shutil.copytree(cfg.checkpoint_dir, copy / "checkpoint")
    shutil.move(str(Path(cfg.output_dir) / "data"), str(tmp_path / "original-gone"))  # the original is away
    try:
        assert training_data_folder(open_checkpoint(copy / "checkpoint")) == copy / "checkpoint" / "../data"
    finally:
        shutil.move(str(tmp_path / "original-gone"), str(Path(cfg.output_dir) / "data"))


def test_model_card_carries_hub_metadata(run):
    import yaml

    cfg, result, _ = run
    card = (Path(cfg.checkpoint_dir) / "README.md").read_text()
    assert f"- split by question (seed {result.metrics['split']['seed']}): train " in card  # no families here
    assert card.startswith("---\n")
    head, _, body = card[4:].partition("\n---\n")
    meta = yaml.safe_load(head)
    assert meta["library_name"] == "specprobe"
    assert meta["base_model"] == ["toy/target-model", "toy/draft-model"]
    assert {"specprobe", "speculative-decoding", "semantic-probe"} <= set(meta["tags"])
    assert meta["datasets"] == [f"reasoning_gym/{cfg.source.task}"]
    assert body.lstrip().startswith(f"# specprobe checkpoint `{cfg.name}`")
    assert "(probe_target / probe_draft, the ones the runtime loads): 3-layer MLP" in body
    assert "for comparison (`_logistic`): L2 logistic regression" in body


def test_model_card_describes_the_runtime_probes_kind():
    """A logistic run's card says its runtime probes are logistic (once it called every probe an MLP)."""
    from dataclasses import replace

    from specprobe.train.checkpoint import model_card
    from specprobe.train.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml",
                      ["probe.kind=logistic", "probe.logistic_pooling=[last]"])
    engines = {role: {"model_id": f"toy/{role}", "num_layers": 2, "hidden_size": 8} for role in ("target", "draft")}

    def probes_line(cfg) -> str:
        card = model_card(cfg, {}, ["probe_target", "probe_draft"], {"engines": engines}, "")
        return next(line for line in card.splitlines() if line.startswith("- probes"))

    runtime, _, beside = probes_line(cfg).partition("; beside them")
    assert "L2 logistic regression" in runtime and "pooling (of last)" in runtime and "MLP" not in runtime
    assert "(`_mlp`): 3-layer MLP" in beside
    assert probes_line(replace(cfg, probe=replace(cfg.probe, kind="mlp"))).startswith(
        "- probes (probe_target / probe_draft, the ones the runtime loads): 3-layer MLP")


def test_model_card_names_the_data_set_a_source_reads():
    """The card's `datasets:` is what the source reads: a local file's name, a hub id (also for a short name or a
    kind's default), reasoning-gym's task; nothing for CHAMP's packaged data."""
    from types import SimpleNamespace

    from specprobe.inputs.records import SourceConfig
    from specprobe.train.checkpoint import card_metadata

    manifest = {"engines": {"target": {"model_id": "t"}, "draft": {"model_id": "d"}}}
    for source, want in [(SourceConfig(kind="gsm8k"), ["openai/gsm8k"]),
                         (SourceConfig(kind="jsonl", name="math500", split="test"), ["HuggingFaceH4/MATH-500"]),
                         (SourceConfig(kind="s1k", name="simplescaling/s1K-1.1"), ["simplescaling/s1K-1.1"]),
                         (SourceConfig(kind="s1k"), ["simplescaling/s1K-1.1"]),
                         (SourceConfig(kind="jsonl", path="/data/steps.jsonl", name="org/x"), ["steps.jsonl"]),
                         (SourceConfig(kind="reasoning_gym", task="gsm_symbolic"), ["reasoning_gym/gsm_symbolic"]),
                         (SourceConfig(kind="champ"), None)]:
        meta = card_metadata(SimpleNamespace(source=source), [], manifest)
        assert meta.get("datasets") == want, source


def test_a_run_stopped_between_the_swaps_renames_leaves_a_checkpoint_to_find(run, tmp_path):
    """Killed after the old checkpoint was moved aside and before the new one was renamed in: readers name the
    moved one, and the next write puts it back first (so a failing write still leaves a checkpoint)."""
    import shutil

    from specprobe.infer.checkpoint_format import CheckpointError, assemble

    cfg, _, _ = run
    folder = tmp_path / "checkpoint"
    aside = tmp_path / ".checkpoint.old12345"
    shutil.copytree(cfg.checkpoint_dir, aside)
    with pytest.raises(CheckpointError, match=r"stopped while replacing it, and the previous checkpoint is .*old12345"):
        Checkpoint(folder)
    with pytest.raises(RuntimeError, match="the new one failed"), assemble(folder):
        raise RuntimeError("the new one failed")
    assert Checkpoint(folder).components == Checkpoint(cfg.checkpoint_dir).components and not aside.exists()


def test_find_pickles_flags_torch_save(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "weights.safetensors")  # a pickle under a safe name
    (tmp_path / "ok.json").write_text("{}")
    assert find_pickles(tmp_path) == [str(tmp_path / "weights.safetensors")]


def test_runtime_loader_reads_the_checkpoint(run):
    from specprobe.infer.verifiers import CheckpointError, load_verifier

    cfg, result, _ = run
    verifier = load_verifier(cfg.checkpoint_dir, kind="probe")
    ds = open_dataset(cfg.data_dir)
    rows = ds.rows("draft")[:8]
    p = verifier.p(ds.features("target", "mean", rows))
    torch.testing.assert_close(p, result.probes.probes["probe_target"].probe.predict_proba(
        ds.features("target", "mean", rows)))

    class Engine:  # an engine whose model has another hidden size
        class info:  # noqa: N801
            num_layers, hidden_size, model_id = 3, 16, "toy/target-model"

    with pytest.raises(CheckpointError, match="hidden size"):
        verifier.bind(Engine, None)
    with pytest.raises(ValueError, match="3 layers / hidden size 8"):
        verifier.probe_target.spec.check_compatible(4, 8, "toy/target-model")


def test_target_probe_without_draft_rows(tmp_path, embedder):
    write_synthetic_data(tmp_path, questions=6)
    cfg = synthetic_config(tmp_path, tmp_path, probe={"target_with_draft": False, "epochs": 3, "features": "range:1-2",
                                                      "combine": "mean", "pooling": "last"},
                           verifiers={"train": ["probes"]})
    result = train_all(cfg, print_fn=lambda _: None)
    assert result.probes.probes["probe_target"].plan.train_sets == ["target_own"]
    assert "probe_target_own" not in result.probes.probes
    spec = Checkpoint(cfg.checkpoint_dir).probe("probe_target").spec
    assert (spec.layers, spec.combine, spec.pooling) == ([1, 2], "mean", "last")
    assert not (Path(cfg.checkpoint_dir) / "embedding_threshold.json").exists()


def test_a_late_failure_keeps_what_trained_beside_the_checkpoint(tmp_path, embedder):
    """The judge fails after the probes and the embedding threshold trained: they are written to
    <checkpoint>-partial (loadable, its card and metrics saying what failed), the error is raised, and an earlier
    complete checkpoint stays as it was."""
    write_synthetic_data(tmp_path, questions=6)
    cfg = synthetic_config(tmp_path, tmp_path, probe={"epochs": 2}, verifiers={"train": ["probes", "embedding", "judge"]})
    earlier = Path(cfg.checkpoint_dir)
    earlier.mkdir(parents=True)
    (earlier / "checkpoint.json").write_text('{"from": "an earlier run"}')
    lines: list[str] = []
    broken = (None, None)  # a judge model that fails on its first use
    with pytest.raises((AttributeError, TypeError)):
        train_all(cfg, print_fn=lines.append, embedder=embedder, judge_model=broken)
    assert (earlier / "checkpoint.json").read_text() == '{"from": "an earlier run"}'
    partial = pipeline.partial_checkpoint_dir(cfg)
    assert partial == earlier.with_name(earlier.name + "-partial")
    ckpt = Checkpoint(partial)
    assert ckpt.has_probe("probe_target") and "embedding_threshold" in ckpt.components and "judge" not in ckpt.components
    assert ckpt.embedding().threshold == pytest.approx(ckpt.embedding().raw["threshold"])
    failed = json.loads((partial / "metrics.json").read_text())["failed"]
    assert failed["stage"] == "judge" and failed["error"].startswith(("AttributeError", "TypeError"))
    assert "**partial**: the judge step failed" in (partial / "README.md").read_text()
    assert any("the judge step failed" in line and str(partial) in line for line in lines)
    # a later run without the embedding verifier leaves the partial checkpoint, which holds one
    fewer = synthetic_config(tmp_path, tmp_path, probe={"epochs": 2}, verifiers={"train": ["probes"]})
    train_all(fewer, print_fn=lines.append)
    assert partial.is_dir() and any(line.startswith(f"kept {partial}") and "embedding_threshold" in line
                                    for line in lines)
    # a later run that trains everything replaces the checkpoint and removes the stale partial one
    done = synthetic_config(tmp_path, tmp_path, probe={"epochs": 2}, verifiers={"train": ["probes", "embedding"]})
    train_all(done, print_fn=lines.append, embedder=embedder)
    assert Checkpoint(earlier).has_probe("probe_target") and not partial.exists()


def test_a_failed_checkpoint_write_keeps_what_trained(tmp_path, monkeypatch):
    """Everything trained, then writing the checkpoint fails (a full disk, say): the probes go to the partial
    folder, as after a failed training step, and the error is raised."""
    write_synthetic_data(tmp_path, questions=6)
    cfg = synthetic_config(tmp_path, tmp_path, probe={"epochs": 2}, verifiers={"train": ["probes"]})
    real = pipeline.write_checkpoint

    def full_disk(folder, *args):
        if Path(folder) == Path(cfg.checkpoint_dir):
            raise OSError(28, "No space left on device")
        return real(folder, *args)

    monkeypatch.setattr(pipeline, "write_checkpoint", full_disk)
    lines: list[str] = []
    with pytest.raises(OSError, match="No space left"):
        train_all(cfg, print_fn=lines.append)
    kept = Checkpoint(pipeline.partial_checkpoint_dir(cfg))
    assert kept.has_probe("probe_target") and kept.has_probe("probe_draft")
    assert json.loads((kept.folder / "metrics.json").read_text())["failed"]["stage"] == "checkpoint"
    assert any("the checkpoint step failed" in line for line in lines)


def test_a_rerun_reuses_the_verifiers_a_failed_run_kept_when_data_and_settings_match(tmp_path, embedder):
    write_synthetic_data(tmp_path, questions=6)
    every = {"train": ["probes", "embedding", "judge"]}
    cfg = synthetic_config(tmp_path, tmp_path, probe={"epochs": 2}, verifiers=every)
    partial = pipeline.partial_checkpoint_dir(cfg)
    with pytest.raises((AttributeError, TypeError)):
        train_all(cfg, print_fn=lambda _: None, embedder=embedder, judge_model=(None, None))
    kept = Checkpoint(partial)
    weights = {name: (partial / f"{name}.safetensors").read_bytes() for name in kept.probe_names()}
    threshold, kept_probes = kept.embedding().threshold, kept.metrics["probes"]
    kept_seconds = kept.metrics["seconds"]["probes"]
    # the same command fails again (say, the judge still runs out of memory): nothing is trained twice, and the
    # partial checkpoint, source and destination at once, still holds both
    lines: list[str] = []
    with pytest.raises((AttributeError, TypeError)):
        train_all(cfg, print_fn=lines.append, embedder=embedder, judge_model=(None, None))
    assert any(line.startswith("reusing the probes and embedding of") for line in lines)
    again = Checkpoint(partial)
    assert {n: (partial / f"{n}.safetensors").read_bytes() for n in again.probe_names()} == weights
    assert again.embedding().threshold == threshold and again.metrics["failed"]["stage"] == "judge"
    # other judge settings (the usual fix) still reuse both; the checkpoint holds them, loadable, and the partial goes
    fixed = synthetic_config(tmp_path, tmp_path, probe={"epochs": 2},
                             verifiers={"train": ["probes", "embedding"], "judge_batch_size": 2})
    lines.clear()
    result = train_all(fixed, print_fn=lines.append, embedder=embedder)
    assert result.probes is None and result.embedding is None and not partial.exists()
    done = Checkpoint(fixed.checkpoint_dir)
    assert {n: (done.folder / f"{n}.safetensors").read_bytes() for n in done.probe_names()} == weights
    assert done.embedding().threshold == threshold and done.probe("probe_target") is not None
    assert done.metrics["reused"] == {"from": str(partial), "created": again.meta["created"],
                                      "verifiers": ["probes", "embedding"]}
    assert done.metrics["seconds"]["probes"] == kept_seconds > 0  # the time it took when it was trained
    assert "probes and embedding: reused as they were" in (done.folder / "README.md").read_text()
    assert not list(partial.parent.glob(".*reused*"))  # the staged copy is gone
    assert done.metrics["probes"] == kept_probes and "failed" not in done.metrics
    assert set(kept.components) <= set(done.components)
    # other probe settings, or other data: trained again, and the log says why
    with pytest.raises((AttributeError, TypeError)):
        train_all(cfg, print_fn=lambda _: None, embedder=embedder, judge_model=(None, None))
    changed = synthetic_config(tmp_path, tmp_path, probe={"epochs": 3}, verifiers={"train": ["probes", "embedding"]})
    lines.clear()
    result = train_all(changed, print_fn=lines.append, embedder=embedder)
    assert result.probes is not None and result.embedding is None  # the split is the same: the embedding is kept
    assert any("not reused where its probes were trained with other settings" in line for line in lines)
    for edit in ("created", "shards"):  # the folder made again; one of its shards made again
        with pytest.raises((AttributeError, TypeError)):
            train_all(cfg, print_fn=lambda _: None, embedder=embedder, judge_model=(None, None))
        manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
        if edit == "created":
            manifest["created"] = "2026-01-01T00:00:00+00:00"
        else:  # (this synthetic folder recorded no digests: its shard now has them, as one written again would)
            from specprobe.data_gen.store import file_digests
            shard = manifest["shards"][0]
            shard["digests"] = file_digests(tmp_path / "data", shard["files"])
        (tmp_path / "data" / "manifest.json").write_text(json.dumps(manifest))
        lines.clear()
        result = train_all(changed, print_fn=lines.append, embedder=embedder)
        assert result.probes is not None and result.embedding is not None, edit
        assert any("it was trained on other data" in line for line in lines), edit


def test_a_failure_inside_the_probes_step_keeps_the_finished_probes_and_a_rerun_trains_only_the_rest(
        tmp_path, monkeypatch, capsys):
    """The draft's MLP fails after four probes trained: those four go to <checkpoint>-partial (with what a rerun
    needs to score them); the rerun takes them as they are, trains the other four, and writes a complete checkpoint."""
    write_synthetic_data(tmp_path, questions=6)
    cfg = synthetic_config(tmp_path, tmp_path, probe={"epochs": 2}, verifiers={"train": ["probes"]})
    real_one, real_logistic = pipeline.probes_train.train_one, pipeline.probes_train.train_logistic
    trained: list[str] = []
    fail = [True]

    def one(plan, *args, **kwargs):
        if plan.name == "probe_draft" and fail[0]:
            raise RuntimeError("out of memory (on purpose)")
        trained.append(plan.name)
        return real_one(plan, *args, **kwargs)

    def logistic(plan, *args, **kwargs):
        trained.append(plan.name)
        return real_logistic(plan, *args, **kwargs)

    monkeypatch.setattr(pipeline.probes_train, "train_one", one)
    monkeypatch.setattr(pipeline.probes_train, "train_logistic", logistic)
    lines: list[str] = []
    with pytest.raises(RuntimeError, match="on purpose"):
        train_all(cfg, print_fn=lines.append)
    first = ["probe_target", "probe_target_logistic", "probe_target_own", "baseline_last_layer_target"]
    partial = pipeline.partial_checkpoint_dir(cfg)
    kept = Checkpoint(partial)
    assert kept.probe_names() == sorted(first) and not Path(cfg.checkpoint_dir).exists()
    assert kept.metrics["failed"]["stage"] == "probes" and list(kept.metrics["probes_finished"]) == first
    assert "the probes it had not finished" in (partial / "README.md").read_text()
    assert any(f"what had trained (the probes {', '.join(first)}) is in {partial}" in line for line in lines)
    rows = torch.randn(5, 4, 8)  # any rows of the synthetic models' shape
    before = {name: kept.probe(name).predict_proba(rows) for name in first}

    trained.clear()
    fail[0] = False
    lines.clear()
    capsys.readouterr()
    result = train_all(cfg, print_fn=lines.append, progress=True)
    assert trained == ["probe_draft", "probe_draft_logistic", "baseline_last_layer_draft", "probe_acceptance"]
    assert any(line.startswith(f"reusing {', '.join(first)} of {partial}") for line in lines)
    # each probe trained says so as it starts (the restored ones do not); the logistic ones' readings have a bar
    starts = [line for line in lines if line.startswith("probe ") and "/8: " in line]
    assert starts[0] == "probe 5/8: probe_draft (MLP)" and len(starts) == 4
    assert starts[1].startswith("probe 6/8: probe_draft_logistic (logistic, ") and " readings x " in starts[1]
    readings = int(starts[1].split("(logistic, ")[1].split(" readings")[0])
    assert f"probe_draft_logistic: readings:   0%|          | 0/{readings}" in capsys.readouterr().err
    done = Checkpoint(cfg.checkpoint_dir)
    assert len(done.probe_names()) == 8 and not partial.exists()
    for name in first:
        assert torch.equal(done.probe(name).predict_proba(rows), before[name]), name
        assert result.probes.probes[name].n_train == kept.metrics["probes_finished"][name]["n_train"]
    assert done.metrics["reused"]["probes"] == first and done.metrics["reused"]["verifiers"] == []
    history = done.metrics["probes"]["probe_target"]["history"]
    assert history == kept.metrics["probes_finished"]["probe_target"]["history"]
    assert done.metrics["probes"]["probe_target"]["logistic"]["selection"]  # the restored logistic's sweep
    assert set(done.metrics["probes"]) == {"probe_target", "probe_draft", "probe_acceptance"}
    assert "failed" not in done.metrics and "probes_finished" not in done.metrics
    assert "`probe_target`, `probe_target_logistic`" in (done.folder / "README.md").read_text()
    # scored as a run that never failed scores them (the same seeds: the same probes, the same columns read)
    whole = train_all(synthetic_config(tmp_path, tmp_path / "whole", probe={"epochs": 2},
                                       verifiers={"train": ["probes"]}), dataset=open_dataset(cfg.data_dir),
                      print_fn=lambda _: None)
    assert _without_seconds(done.metrics["probes"]) == _without_seconds(whole.metrics["probes"])


def _without_seconds(tree):
    if isinstance(tree, dict):
        return {k: _without_seconds(v) for k, v in tree.items() if k != "seconds"}
    return [_without_seconds(v) for v in tree] if isinstance(tree, list) else tree


def test_training_on_data_made_with_other_settings_says_so_and_names_the_datas_source(tmp_path):
    write_synthetic_data(tmp_path, questions=6)  # made with data.num_samples 6 from reasoning-gym's gsm_symbolic
    cfg = synthetic_config(tmp_path, tmp_path, data={"num_samples": 20}, source={"kind": "gsm8k"},
                           probe={"epochs": 2}, verifiers={"train": ["probes"]})
    lines: list[str] = []
    train_all(cfg, print_fn=lines.append)
    differ = json.loads((Path(cfg.checkpoint_dir) / "metrics.json").read_text())["data"]["config_differs"]
    assert differ == ["data.num_samples: 6 -> 20", "source.kind: 'reasoning_gym' -> 'gsm8k'"]
    assert any(line.startswith("WARNING: ") and "data.num_samples: 6 -> 20" in line for line in lines)
    card = (Path(cfg.checkpoint_dir) / "README.md").read_text()
    assert "reasoning_gym/gsm_symbolic" in card and "gsm8k" not in card.split("## Data")[0]
    assert "- source: `reasoning_gym` (gsm_symbolic)" in card and "data.num_samples: 6 -> 20" in card
    same = synthetic_config(tmp_path, tmp_path / "same", probe={"epochs": 2}, verifiers={"train": ["probes"]})
    write_synthetic_data(tmp_path / "same", questions=6)
    quiet: list[str] = []
    train_all(same, print_fn=quiet.append)
    assert "config_differs" not in json.loads((Path(same.checkpoint_dir) / "metrics.json").read_text())["data"]
    assert not any("other data settings" in line for line in quiet)


def test_sigterm_during_training_keeps_the_finished_verifiers(tmp_path, capsys, monkeypatch):
    """A batch scheduler's time limit (SIGTERM) while the embedding verifier trains: the probes already trained are
    kept in <checkpoint>-partial, the CLI says so and exits 143, and SIGTERM's handler is restored."""
    import os
    import signal
    import time

    from specprobe.train.cli import main

    def killed(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises here
        raise AssertionError("SIGTERM did not stop the run")

    monkeypatch.setattr(pipeline.pair_verifiers, "train_embedding", killed)
    cfg = synthetic_config(tmp_path, tmp_path, probe={"epochs": 2})
    write_synthetic_data(tmp_path, questions=6)
    def ignore(signum, frame):  # should the CLI's handler be missing, the test fails instead of pytest being killed
        pass

    original = signal.signal(signal.SIGTERM, ignore)
    try:
        assert main(["--config", str(tmp_path / "synthetic.yaml"), "--stage", "train", "--no-progress"]) == 143
        assert "stopped by SIGTERM" in capsys.readouterr().err
        assert signal.getsignal(signal.SIGTERM) is ignore
    finally:
        signal.signal(signal.SIGTERM, original)
    kept = Checkpoint(pipeline.partial_checkpoint_dir(cfg))
    assert kept.has_probe("probe_target") and "embedding_threshold" not in kept.components
    assert json.loads((kept.folder / "metrics.json").read_text())["failed"]["stage"] == "embedding"
    assert not Path(cfg.checkpoint_dir).exists()


def test_merge_refuses_shard_and_ray(tmp_path, capsys):
    from specprobe.train.cli import main

    for extra in (["--shard", "0/2"], ["--ray"]):
        with pytest.raises(SystemExit):
            main(["--config", "configs/tiny.yaml", "--merge", *extra])
        assert "--merge joins the finished part folders" in capsys.readouterr().err


def test_data_without_last_token_features_trains_on_mean_pooling(tmp_path):
    """data.store_last_token=false: the logistic probes choose among the poolings stored (mean); a config that asks
    for last-token features is refused before the data stage, naming the settings to change."""
    from specprobe.data_gen.store import MANIFEST
    from specprobe.inputs.config import ConfigError

    folder = write_synthetic_data(tmp_path, questions=6)
    manifest = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({**manifest, "store_last_token": False}))
    cfg = synthetic_config(tmp_path, tmp_path, probe={"epochs": 2}, verifiers={"train": ["probes"]})
    assert open_dataset(folder).poolings == ("mean",)
    result = train_all(cfg, print_fn=lambda _: None)
    logistic = [p for p in result.probes.probes.values() if p.plan.model == "logistic"]
    assert logistic and all(p.probe.spec.pooling == "mean" for p in logistic)
    last = synthetic_config(tmp_path, tmp_path, probe={"pooling": "last"}, verifiers={"train": ["probes"]})
    with pytest.raises(ValueError, match="probe.pooling=last, but the data stores only"):
        train_all(last, print_fn=lambda _: None)
    fresh = synthetic_config(tmp_path, tmp_path / "fresh", data={"store_last_token": False},
                             probe={"logistic_pooling": ["last"]})
    with pytest.raises(ConfigError, match=r"set probe.pooling=mean and probe.logistic_pooling=\[mean\]"):
        fresh.check_before_loading(sources=False, training=True)
    synthetic_config(tmp_path, tmp_path / "fresh", data={"store_last_token": False}).check_before_loading(
        sources=False, training=True)  # mean and last to choose from: mean is stored


def test_cli_train_stage(tmp_path, capsys):
    from specprobe.train.cli import main

    synthetic_config(tmp_path, tmp_path)
    config = str(tmp_path / "synthetic.yaml")
    assert main(["--config", config, "--stage", "train"]) == 1  # no data yet
    assert "generate" in capsys.readouterr().err
    write_synthetic_data(tmp_path, questions=6)
    code = main(["--config", config, "--stage", "train", "probe.epochs=2", "verifiers.train=[probes]"])
    out = capsys.readouterr().out
    assert code == 0
    assert "==== validation metrics ====" in out and "probe_draft" in out
    assert (tmp_path / "checkpoint" / "checkpoint.json").is_file()


def test_wandb_offline_run(tmp_path):
    write_synthetic_data(tmp_path, questions=6)
    cfg = synthetic_config(tmp_path, tmp_path, probe={"epochs": 2}, verifiers={"train": ["probes"]},
                           wandb={"enabled": True, "mode": "offline"})
    train_all(cfg, print_fn=lambda _: None)
    runs = list((tmp_path / "wandb").rglob("*.wandb"))
    assert runs, "no offline wandb run file written"
    assert any(b"probe_target/train_loss" in r.read_bytes() for r in runs)


def test_test_split_is_scored_and_printed(tmp_path):
    write_synthetic_data(tmp_path, questions=10)
    cfg = synthetic_config(tmp_path, tmp_path, probe={"epochs": 2, "val_fraction": 0.2, "test_fraction": 0.2},
                           verifiers={"train": ["probes"]})
    lines: list[str] = []
    result = train_all(cfg, print_fn=lines.append)
    split = result.metrics["split"]
    assert split["test"] and set(split["test"]).isdisjoint(split["train"] + split["val"])
    assert "draft_own" in result.metrics["probes"]["probe_draft"]["test"]
    assert "==== test metrics ====" in "\n".join(lines)
    # the test questions, written where probe-bench's configs read them, load as its problems
    from specprobe.infer.bench import load_problems
    from specprobe.inputs.records import BenchSourceConfig

    path = tmp_path / "test_questions.jsonl"
    assert f"test questions: {len(split['test'])} -> {path}" in "\n".join(lines)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted(r["id"] for r in records) == sorted(split["test"])
    ctx = open_dataset(cfg.data_dir).contexts.to_pylist()
    asked = {c["question_id"]: (c["question"], c["answer"]) for c in ctx}
    assert all((r["question"], r["answer"]) == asked[r["id"]] for r in records)
    problems = load_problems(BenchSourceConfig(kind="jsonl", path=str(path)), 100)
    assert sorted(p.id for p in problems) == sorted(split["test"])
    # trained again without a test split: the earlier file (questions now trained on) goes, saying so
    again = synthetic_config(tmp_path, tmp_path, probe={"epochs": 2, "val_fraction": 0.2, "test_fraction": 0.0},
                             verifiers={"train": ["probes"]})
    lines.clear()
    train_all(again, print_fn=lines.append)
    assert not path.exists() and any(line.startswith(f"removed {path}") for line in lines)


def test_each_row_set_is_scored_against_its_own_baselines(run):
    """One constant per set (its mean training label), not the mixture of the sets a probe trained on."""
    from specprobe.train.probes_train import load_row_set

    cfg, result, _ = run
    ds = open_dataset(cfg.data_dir)
    split = QuestionSplit.of_data(ds, cfg.probe)
    per_set = result.probes.set_baselines
    assert set(per_set) == {"target_own", "draft_via_target", "draft_own", "draft_accept"}
    means = {}
    for name, base in per_set.items():
        rows = load_row_set(ds, name, "mean")
        means[name] = float(rows.y[torch.from_numpy(split.sides(rows.questions) == "train")].double().mean())
        assert base.constant.value == pytest.approx(means[name])
    assert abs(means["draft_via_target"] - means["target_own"]) > 0.01  # the two target-view sets sit apart
    scored = result.metrics["probes"]["probe_target"]["val"]
    for set_name in ("draft_via_target", "target_own"):
        assert scored[set_name]["constant"]["mean_pred"] == pytest.approx(means[set_name])
    written = json.loads((cfg.checkpoint_dir / "baselines.json").read_text())["sets"]
    assert written["draft_own"]["constant"]["value"] == pytest.approx(means["draft_own"])
    assert written["target_own"]["logprob_isotonic"]["kind"] == "logprob_isotonic"
    loaded = Checkpoint(cfg.checkpoint_dir)
    assert loaded.set_baselines()["draft_via_target"].constant.value == pytest.approx(means["draft_via_target"])


def test_the_logistic_kind_becomes_the_runtime_probe(tmp_path, embedder):
    """probe.kind: logistic saves the logistic probe as probe_<role> (what the runtime loads) and the MLP beside
    it; its reading is chosen on validation questions."""
    from specprobe.infer.verifiers import load_probe_pair
    from specprobe.probes.logistic import LogisticProbe
    from specprobe.probes.mlp import SemanticProbe

    write_synthetic_data(tmp_path)
    cfg = synthetic_config(tmp_path, tmp_path, probe={"kind": "logistic"}, verifiers={"train": ["probes"]})
    result = train_all(cfg, print_fn=lambda _: None)
    pair = load_probe_pair(cfg.checkpoint_dir)
    assert isinstance(pair.probe_target, LogisticProbe) and isinstance(pair.probe_draft, LogisticProbe)
    assert isinstance(Checkpoint(cfg.checkpoint_dir).probe("probe_target_mlp"), SemanticProbe)
    entry = result.metrics["probes"]["probe_target"]
    assert entry["kind"] == "logistic" and entry["mlp"]["kind"] == "mlp"
    chosen = min(entry["selection"], key=lambda r: r["val_log_loss"])
    assert pair.probe_target.spec.layers == chosen["layers"] and pair.probe_target.l2 == chosen["l2"]
    assert pair.probe_target.spec.pooling == chosen["pooling"]


def test_the_committed_template_overlap_counts_come_from_the_script(tmp_path):
    """benchmarks/split_families.py recomputes the offline experiments' splits (by question id or by family, as made)
    and counts test questions whose template a training or validation question shares."""
    from _scripts import benchmark_script

    root = Path(__file__).resolve().parents[1]
    script = benchmark_script("split_families")
    counts = {}
    for name, config in (("small", "small"), ("offline-evidence_by-question-id", "offline-evidence"),
                         ("offline-evidence", "offline-evidence")):
        folder = root / "benchmarks" / "results" / name
        got = script.main(str(root / "configs" / f"{config}.yaml"), str(folder / "metrics.json"),
                          str(tmp_path / "o.json"))
        counts[name] = committed = json.loads((folder / "split_families.json").read_text())
        keys = [k for k in got if k not in ("config", "report")]
        assert {k: got[k] for k in keys} == {k: committed[k] for k in keys}, name
    # the figures the READMEs quote: the first run leaked templates, the rerun split by template does not
    assert counts["offline-evidence_by-question-id"]["heldout_sharing_a_family_with_train_or_val"] == 51
    rerun = counts["offline-evidence"]
    assert rerun["split_made_by"] == "family" and rerun["heldout_sharing_a_family_with_train_or_val"] == 0
