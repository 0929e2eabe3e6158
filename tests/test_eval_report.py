"""probe-eval end to end on a checkpoint trained by the real probe-train training stage on a synthetic
data folder (tests/_eval_fixtures.py): every part, every figure, errors for one part at a time, the CLI,
--compare and --wandb."""
from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch
from matplotlib.image import imread

from specprobe.data_gen.store import FAMILIES, MANIFEST, open_dataset, write_manifest
from specprobe.train.eval_cli import main
from specprobe.train.report import evaluate_checkpoint
from specprobe.train.report.evaluate import empirical_ratio
from specprobe.train.report.runner import headline

from _eval_fixtures import make_checkpoint, make_data, write_config

QUICK = ["eval.n_boot=30", "eval.layer_sweep=false", "eval.logistic_sweep=false"]
RELIABILITY = ["reliability_probe_target_draft_via_target", "reliability_probe_target_target_own",
               "reliability_probe_draft_draft_own", "reliability_probe_acceptance_draft_accept"]
FIGURES = [f"{name}{kind}.png" for name in RELIABILITY for kind in ("", "_equal_mass")] + [
    "acceptance_scatter.png", "layer_sweep.png", "logistic_sweep.png", "verifiers_roc_pr.png", "training_curves.png"]


def quiet(_):
    pass


@pytest.fixture(scope="module")
def trained(one_thread, tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("eval-ckpt"))


@pytest.fixture(scope="module")
def report(trained, tmp_path_factory):
    _, ckpt = trained
    return evaluate_checkpoint(ckpt, out=tmp_path_factory.mktemp("eval-report"), print_fn=quiet)


def test_report_writes_every_part_and_figure(report):
    m = report.metrics
    # the synthetic steps all have 8 tokens: only the length check of the positive control has nothing to predict
    assert {s["part"] for s in m["skipped"]} == {"positive_control/target_own/length_share",
                                                 "positive_control/draft_own/length_share"}
    assert set(m["parts"]) == {"probes", "acceptance", "layer_sweep", "logistic_sweep", "positive_control",
                               "verifiers", "training"}  # umap off in the fixture
    assert sorted(f["file"] for f in m["figures"]) == sorted(FIGURES)
    markdown = report.markdown.read_text()
    for name in FIGURES:
        image = imread(report.folder / name)
        assert image.shape[0] > 300 and image.shape[1] > 300
        assert image[..., :3].std() > 0.05  # not a blank canvas
        assert f"]({name})" in markdown
    assert json.loads((report.folder / "metrics.json").read_text()) == m
    for heading in ("Probe calibration", "Acceptance ratio", "Per-layer sweep", "Pair verifiers", "Training curves",
                    "Skipped parts"):
        assert heading in markdown


def test_heldout_questions_are_the_checkpoints_test_split_by_default(report, trained):
    _, ckpt = trained
    split = json.loads((ckpt / "metrics.json").read_text())["split"]
    assert split["test"] and split["test_fraction"] > 0  # probe.test_fraction defaults to > 0
    assert report.metrics["heldout"]["questions"] == sorted(split["test"])
    assert report.metrics["heldout"]["split"] == "test" and report.metrics["heldout"]["n_questions"] == len(split["test"])
    assert report.metrics["heldout"]["warning"] is None
    assert report.metrics["data"]["is_training_data"] is True


def test_without_a_test_split_the_first_lines_say_validation_chose_the_epoch(trained, tmp_path):
    _, ckpt = trained
    copy = tmp_path / "checkpoint"
    shutil.copytree(ckpt, copy)
    metrics = json.loads((copy / "metrics.json").read_text())
    metrics["split"]["train"] += metrics["split"]["test"]  # as if trained with probe.test_fraction=0
    metrics["split"]["test"] = []
    (copy / "metrics.json").write_text(json.dumps(metrics))
    again = evaluate_checkpoint(copy, out=tmp_path / "r", overrides=QUICK + ["eval.verifiers=[]"], print_fn=quiet)
    assert again.metrics["heldout"]["questions"] == sorted(metrics["split"]["val"])
    first_lines = again.markdown.read_text().splitlines()[:4]
    assert any("WARNING" in line and "VALIDATION questions" in line and "chose the probes' epoch" in line
               for line in first_lines)
    # the acceptance ratio's empirical side on the probes' scale: the draft's leave-one-out own_prob (on these
    # questions some draft steps' ratios differ from the |C|/N scale's)
    ds = open_dataset(trained[0].data_dir)
    rows = ds.rows("draft", np.isin(ds.column("question_id"), metrics["split"]["val"]))
    put = ds.column("prob_under_target")[rows]
    expected, old_scale = (empirical_ratio(put, ds.column(q)[rows]) for q in ("own_prob", "semantic_prob"))
    assert (expected != old_scale).any()
    mean = again.metrics["parts"]["acceptance"]["probes"]["metrics"]["mean_empirical"]["estimate"]
    assert mean == pytest.approx(expected.mean()) and mean != pytest.approx(old_scale.mean())


def test_probe_trains_caveat_on_its_split_heads_the_report(trained, tmp_path):
    """A checkpoint whose split put one template on both sides (data made before families were recorded): its
    held-out numbers may be optimistic, and probe-eval says so where probe-train did."""
    _, ckpt = trained
    copy = tmp_path / "checkpoint"
    shutil.copytree(ckpt, copy)
    metrics = json.loads((copy / "metrics.json").read_text())
    metrics["split"]["warning"] = "split by id: items of one template on both sides"
    (copy / "metrics.json").write_text(json.dumps(metrics))
    again = evaluate_checkpoint(copy, out=tmp_path / "r", overrides=QUICK + ["eval.verifiers=[]"], print_fn=quiet)
    assert again.metrics["heldout"]["warning"] == "split by id: items of one template on both sides"
    assert any("WARNING: split by id" in line for line in again.markdown.read_text().splitlines()[:4])


def test_small_heldout_set_withholds_intervals_and_says_so(report):
    # (the fixture's data records no families: questions are resampled, and the report says why)
    assert report.metrics["settings"]["resample"] == "question"
    assert "resamples of whole questions (the data records no question families" in report.markdown.read_text()
    # the synthetic run holds out 2 test questions: far below the 20-question guard
    block = report.metrics["parts"]["probes"]["by_probe"]["probe_target"]["draft_via_target"]["probe"]
    assert block["n_questions"] == 2 and "2 held-out question(s) < 20" in block["too_small"]
    auroc = block["metrics"]["auroc"]
    assert auroc["low"] is None and auroc["high"] is None and auroc["withheld"]
    assert report.metrics["parts"]["verifiers"]["by_verifier"]["embedding"]["metrics"]["auroc"]["low"] is None
    markdown = report.markdown.read_text()
    assert "THE HELD-OUT SET IS TOO SMALL" in "\n".join(markdown.splitlines()[:5])
    assert "(no CI)" in markdown and "cannot be compared (set too small)" in markdown


@pytest.mark.parametrize("probe, set_name", [("probe_target", "draft_via_target"), ("probe_target", "target_own"),
                                             ("probe_draft", "draft_own")])
def test_numbers_match_probe_trains_own_test_scores(report, trained, probe, set_name):
    """The report recomputes every predictor on the held-out (test) rows; probe-train scored the same rows."""
    _, ckpt = trained
    theirs = json.loads((ckpt / "metrics.json").read_text())["probes"][probe]["test"][set_name]
    theirs = {("target_own_only" if k == "variant" else k): v for k, v in theirs.items()}  # probe-train's name
    ours = report.metrics["parts"]["probes"]["by_probe"][probe][set_name]
    assert set(ours) == set(theirs)  # probe, target_own_only (target), last_layer, logprob, constant
    for predictor, block in ours.items():
        assert block["n"] == theirs[predictor]["n"]
        for metric in ("ece_uniform", "ece_quantile", "brier", "mae", "auroc"):
            assert block["metrics"][metric]["estimate"] == pytest.approx(theirs[predictor][metric], abs=1e-6), \
                (predictor, metric)
        assert block["metrics"]["mce"]["estimate"] == pytest.approx(theirs[predictor]["mce_uniform"], abs=1e-6)
    table = report.metrics["parts"]["probes"]["table"]
    assert {r["predictor"] for r in table if r["probe"] == probe and r["set"] == set_name} == set(ours)


def test_acceptance_uses_the_empirical_ratio_of_heldout_draft_steps(report, trained):
    cfg, _ = trained
    ds = open_dataset(cfg.data_dir)
    held = set(report.metrics["heldout"]["questions"])
    rows = ds.rows("draft", np.isin(ds.column("question_id"), list(held)))
    # on the scale the probes learn: the draft's leave-one-out own_prob, not |C|/N (semantic_prob)
    expected = empirical_ratio(ds.column("prob_under_target")[rows], ds.column("own_prob")[rows])
    part = report.metrics["parts"]["acceptance"]
    assert part["probes"]["n"] == len(rows)
    assert part["probes"]["metrics"]["mean_empirical"]["estimate"] == pytest.approx(expected.mean())
    assert set(part) == {"probes", "logistic", "last_layer", "logprob", "constant"}  # logistic: the classic pair
    # on this data the probes track the ratio far better than a constant p/q, and the words say so per baseline
    assert part["probes"]["metrics"]["mae"]["estimate"] < part["constant"]["metrics"]["mae"]["estimate"]
    versus = part["probes"]["versus"]
    assert set(versus) == {"logistic", "last_layer", "logprob", "constant"}
    assert part["logistic"]["n"] == part["probes"]["n"]  # the same draft steps
    assert versus["constant"]["brier_delta"]["estimate"] < 0  # probes' squared error minus the constant's
    text = report.markdown.read_text()
    assert "In words (squared error of the ratio, paired bootstrap)" in text
    assert "- `probes` " in text and "**constant** on `the acceptance ratio`" in text


def test_layer_sweep_covers_every_stored_layer(report):
    sweep = report.metrics["parts"]["layer_sweep"]
    for role in ("target", "draft"):
        entries = sweep[role]["entries"]
        assert [e["layer"] for e in entries] == [0, 1, 2, 3, 4]
        assert [e["depth"] for e in entries] == pytest.approx([0, 0.25, 0.5, 0.75, 1.0])
        assert sweep[role]["n_val"] > 0 and sweep[role]["n_train"] > 0 and sweep[role]["n_test"] > 0
    assert sweep["target"]["sets"] == ["target_own", "draft_via_target"]  # what probe_target was trained on
    # the synthetic signal grows with depth: the last layer beats the embeddings and the constant
    target = sweep["target"]["entries"]
    assert target[-1]["val_brier"] < target[0]["val_brier"]
    assert sweep["target"]["best"]["test_brier"] < sweep["target"]["constant_test_brier"]


def test_layer_sweep_chooses_on_validation_and_reports_on_test(report, trained):
    cfg, ckpt = trained
    split = json.loads((ckpt / "metrics.json").read_text())["split"]
    ds = open_dataset(cfg.data_dir)
    questions, models = ds.column("question_id"), ds.column("model")
    sweep = report.metrics["parts"]["layer_sweep"]["draft"]  # draft_own rows: one per draft sample
    assert sweep["n_val"] == int(((models == "draft") & np.isin(questions, split["val"])).sum())
    assert sweep["n_test"] == int(((models == "draft") & np.isin(questions, split["test"])).sum())
    assert sweep["independent"] and "chosen on validation" in sweep["how"]
    entries = sweep["entries"]
    assert sweep["best"]["layer"] == min(entries, key=lambda e: (e["val_brier"], e["layer"]))["layer"]
    assert all(e["test_brier"] is not None for e in entries)
    # the target sweep pools two row sets: its constant is each set's own mean training label, not one mean
    target = report.metrics["parts"]["layer_sweep"]["target"]
    train_q = np.isin(questions, split["train"])
    own = ds.column("own_prob")[(models == "target") & train_q]
    via = ds.column("prob_under_target")[(models == "draft") & train_q]
    assert target["constant_by_set"] == {"target_own": pytest.approx(np.mean(own)),
                                         "draft_via_target": pytest.approx(np.mean(via))}
    test_q = np.isin(questions, split["test"])
    errors = np.r_[(ds.column("own_prob")[(models == "target") & test_q] - np.mean(own)) ** 2,
                   (ds.column("prob_under_target")[(models == "draft") & test_q] - np.mean(via)) ** 2]
    assert target["constant_test_brier"] == pytest.approx(errors.mean())
    versus = target["best"]["versus_constant"]
    assert versus["verdict"] in ("better", "worse", "no clear difference", "too small to tell")
    assert versus["brier_delta"]["estimate"] == pytest.approx(target["best"]["test_brier"]
                                                              - target["constant_test_brier"])
    assert "- target: the chosen layer " in report.markdown.read_text()


def test_layer_sweep_keeps_the_layers_that_fit_when_one_fails(trained, tmp_path, monkeypatch):
    from specprobe.train.report import sections

    real = sections.fit_probe

    def fails_on_layer_2(x, y, xv, yv, spec, cfg):  # say, a layer whose activations overflowed
        if spec.layers == [2]:
            raise ValueError("train features contain NaN/inf in 3 of 40 rows")
        return real(x, y, xv, yv, spec, cfg)

    monkeypatch.setattr(sections, "fit_probe", fails_on_layer_2)
    _, ckpt = trained
    report = evaluate_checkpoint(ckpt, out=tmp_path / "r", print_fn=quiet,
                                 overrides=["eval.n_boot=30", "eval.logistic_sweep=false"])
    sweep = report.metrics["parts"]["layer_sweep"]
    for role in ("target", "draft"):
        assert [e["layer"] for e in sweep[role]["entries"]] == [0, 1, 3, 4]
        assert sweep[role]["failed"] == [{"layer": 2, "error": "train features contain NaN/inf in 3 of 40 rows"}]
        assert sweep[role]["best"]["layer"] != 2
    assert "no probe could be fitted on layer(s) 2" in report.markdown.read_text()
    assert (report.folder / "layer_sweep.png").exists()


def test_pair_verifier_metrics(report, trained):
    _, ckpt = trained
    part = report.metrics["parts"]["verifiers"]
    emb = part["by_verifier"]["embedding"]
    fit = json.loads((ckpt / "embedding_threshold.json").read_text())["fit"]
    assert emb["info"]["met_target"] == fit["met_target"] and emb["info"]["target_precision"] == 0.8
    assert "training-question pairs" in emb["info"]["fit_on"] and emb["info"]["fit_error"] is None
    assert emb["thresholds"]["f1_optimal"] == pytest.approx(fit["f1_optimal"]["threshold"])
    assert emb["n"] == part["pairs"]["n"] > 0
    assert emb["thresholds"]["chosen"] == pytest.approx(emb["at_threshold"]["threshold"])
    assert 0 < emb["at_threshold"]["acceptance_rate"] <= 1
    assert emb["metrics"]["auroc"]["estimate"] > 0.8  # meanings come from separate sentence pools
    assert set(emb["by_source"]) == {"cluster", "draft_vs_target"}
    [agree] = part["agreement"]
    assert (agree["first"], agree["second"], agree["n"]) == ("label", "embedding", emb["n"])
    # baselines on the same pairs: accepting every pair (precision = the share of equivalent pairs), the cosine at
    # the config's fixed thresholds; and the words say whether the chosen threshold is more precise than accept-all
    base = emb["baselines"]
    assert set(base) == {"accept all", "cosine>=0.85", "cosine>=0.95"}
    assert base["accept all"]["acceptance_rate"] == 1.0 and base["accept all"]["recall"] == 1.0
    assert base["accept all"]["precision"] == pytest.approx(emb["n_positive"] / emb["n"])
    assert base["cosine>=0.95"]["acceptance_rate"] <= base["cosine>=0.85"]["acceptance_rate"]
    assert emb["versus_accept_all"]["verdict"] == "too small to tell"  # 2 test questions
    gap = emb["versus_accept_all"]["precision_minus_positive_rate"]["estimate"]
    assert gap == pytest.approx(emb["at_threshold"]["precision"] - base["accept all"]["precision"])
    text = report.markdown.read_text()
    assert "| embedding | accept all |" in text and "| embedding | cosine>=0.85 |" in text
    assert "- `embedding` at its threshold cannot be compared (set too small) with accepting every pair" in text


def test_missing_probe_skips_its_parts_and_reports_the_rest(trained, tmp_path):
    _, ckpt = trained
    partial = tmp_path / "checkpoint"
    shutil.copytree(ckpt, partial)
    for suffix in (".json", ".safetensors"):
        (partial / f"probe_draft{suffix}").unlink()
    report = evaluate_checkpoint(partial, out=tmp_path / "report", overrides=QUICK, print_fn=quiet)
    reasons = {s["part"]: s["reason"] for s in report.skipped}
    assert "no probe 'probe_draft'" in reasons["probe_draft"]
    assert "no probe 'probe_draft'" in reasons["acceptance"]
    parts = report.metrics["parts"]
    assert list(parts["probes"]["by_probe"]) == ["probe_target", "probe_acceptance"]
    assert "embedding" in parts["verifiers"]["by_verifier"]
    files = {f["file"] for f in report.metrics["figures"]}
    assert "reliability_probe_target_draft_via_target.png" in files and "acceptance_scatter.png" not in files
    markdown = report.markdown.read_text()
    assert "`probe_draft`" in markdown and "no probe 'probe_draft'" in markdown


@pytest.mark.parametrize("damage, message", [
    ("truncate", r"probe_draft\.safetensors cannot be read as safetensors"),
    ("nan", r"probe_draft\.safetensors .* has NaN/inf weights"),
])
def test_a_damaged_probe_is_named_and_skipped_the_report_goes_on(trained, tmp_path, damage, message):
    from safetensors.torch import load_file, save_file

    _, ckpt = trained
    copy = tmp_path / "checkpoint"
    shutil.copytree(ckpt, copy)
    weights = copy / "probe_draft.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:50])
    else:
        tensors = load_file(str(weights))
        first = sorted(tensors)[0]
        tensors[first] = torch.full_like(tensors[first], float("nan"))
        save_file(tensors, str(weights))
    report = evaluate_checkpoint(copy, out=tmp_path / "report", overrides=QUICK, print_fn=quiet)
    reasons = {s["part"]: s["reason"] for s in report.skipped}
    assert re.search(message, reasons["probe_draft"]), reasons
    assert "probe_target" in report.metrics["parts"]["probes"]["by_probe"]  # the rest was reported


def test_a_judge_adapter_without_weights_is_named(tmp_path):
    """PEFT reads a missing adapter file as a hub repo id ('Repo id must be in the form...'); the checkpoint
    reader names the file instead."""
    from specprobe.infer.checkpoint_format import CheckpointError, read_judge, write_judge_meta

    folder = tmp_path / "judge_lora"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}")
    write_judge_meta(folder, base_model="offline:smollm2-135m-instruct", threshold=0.5, prompt_version=1,
                     answer_tokens={"yes": 1, "no": 2})
    with pytest.raises(CheckpointError, match=r"judge_lora has no adapter_model\.safetensors .*re-run `probe-train`"):
        read_judge(folder)
    (folder / "adapter_model.safetensors").write_bytes(b"")
    assert read_judge(folder).base_model == "offline:smollm2-135m-instruct"


@pytest.mark.parametrize("engine_change, message", [
    ({"model_id": "someone/other-model"}, "different model"),
    ({"num_layers": 6}, "6 layers"),
])
def test_data_from_another_model_skips_the_probes_but_not_the_verifiers(trained, tmp_path, engine_change, message):
    _, ckpt = trained
    _, other_cfg = write_config(tmp_path, tmp_path / "other")
    engines = {role: {"model_id": f"synthetic/{role}-4l", "revision": None, "num_layers": 4, "hidden_size": 16,
                      "vocab_size": 100, "name": "x"} for role in ("target", "draft")}
    engines["target"].update(engine_change)
    engines["draft"].update(engine_change)
    data = make_data(other_cfg, n_questions=12, seed=9, engines=engines)  # its test questions are held out
    report = evaluate_checkpoint(ckpt, data=data, out=tmp_path / "report", overrides=QUICK, print_fn=quiet)
    reasons = {s["part"]: s["reason"] for s in report.skipped}
    assert message in reasons["probe_target"] and "another target model" in reasons["probe_target"]
    assert "another draft model" in reasons["probe_draft"]
    assert "probes" in reasons and "acceptance" in reasons
    assert report.metrics["data"]["is_training_data"] is False
    assert "embedding" in report.metrics["parts"]["verifiers"]["by_verifier"]
    assert (report.folder / "verifiers_roc_pr.png").is_file()
    assert "another target model" in report.markdown.read_text()


def test_a_data_folder_made_again_with_other_settings_is_not_the_training_data(trained, tmp_path):
    """The checkpoint's data folder, found where it was, but generated again with other settings since (here: the
    checkpoint's record edited): other data, whose trained questions are not held out."""
    _, ckpt = trained
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)  # the recorded relative path breaks; found by the config's output_dir
    meta = json.loads((copy / "checkpoint.json").read_text())
    assert evaluate_checkpoint(copy, out=tmp_path / "same", overrides=QUICK, print_fn=quiet
                               ).metrics["data"]["is_training_data"] is True
    meta["data"]["fingerprint"] = {**meta["data"]["fingerprint"], "data": {"num_samples": 99}}
    (copy / "checkpoint.json").write_text(json.dumps(meta))
    report = evaluate_checkpoint(copy, out=tmp_path / "other", overrides=QUICK, print_fn=quiet)
    assert report.metrics["data"]["is_training_data"] is False


def test_classic_sweep_reads_only_the_poolings_the_data_stores(trained, tmp_path, monkeypatch):
    from specprobe.train.report import classic

    threads, real = set(), classic.select_logistic

    def counting(*args, **kwargs):
        threads.add(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(classic, "select_logistic", counting)
    cfg, ckpt = trained
    data = tmp_path / "data"
    shutil.copytree(cfg.data_dir, data)
    manifest = json.loads((data / MANIFEST).read_text())
    write_manifest(data, {**manifest, "store_last_token": False})  # as made with data.store_last_token=false
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        report = evaluate_checkpoint(ckpt, data=data, out=tmp_path / "r", print_fn=quiet,
                                     overrides=["eval.n_boot=30", "eval.layer_sweep=false"])
    finally:
        torch.set_num_threads(before)
    part = report.metrics["parts"]["logistic_sweep"]
    assert part["settings"]["poolings"] == ["mean"]
    assert threads == {1}  # eval.num_threads holds in the logistic sweep and the positive control
    assert part["sets"] and {e["pooling"] for s in part["sets"].values() for e in s["entries"]} == {"mean"}
    # (the synthetic steps all have 8 tokens: the control's length check has nothing to predict; the checkpoint's
    # probes that read last-token features are skipped on this data, by name)
    skipped = {s["part"] for s in report.skipped if s["part"].startswith(("logistic_sweep", "positive_control"))}
    assert skipped <= {f"positive_control/{n}/length_share" for n in ("target_own", "draft_own")}


def test_foreign_data_holds_out_every_question_not_trained_on(trained, tmp_path):
    cfg, ckpt = trained
    _, other_cfg = write_config(tmp_path, tmp_path / "other")
    data = make_data(other_cfg, n_questions=12, seed=3, engines=open_dataset(cfg.data_dir).manifest["engines"])
    # same settings and models: it counts as the training data, so ask for both held-out sides explicitly
    sweep = [o for o in QUICK if not o.startswith("eval.logistic_sweep")]  # its words are checked below
    report = evaluate_checkpoint(ckpt, data=data, out=tmp_path / "report", overrides=sweep + ["eval.split=val+test"],
                                 print_fn=quiet)
    train_q = set(json.loads((ckpt / "metrics.json").read_text())["split"]["train"])
    held = report.metrics["heldout"]["questions"]
    assert "VALIDATION" in report.metrics["heldout"]["warning"]
    # the synthetic folders share question ids q000..q011: the checkpoint's training questions are left out
    assert set(held) == {f"q{i:03d}" for i in range(12)} - train_q
    assert {s["part"] for s in report.skipped} <= {f"positive_control/{n}/length_share" for n in ("target_own", "draft_own")}
    # no validation questions apart: the classic probe's reading was chosen on the questions it is scored on,
    # and the words say so instead of a clean validation / test verdict
    assert not any(s["independent"] for s in report.metrics["parts"]["logistic_sweep"]["sets"].values())
    text = report.markdown.read_text()
    assert "the reading chosen and scored on the same questions" in text
    assert "the reading chosen on validation" not in text and "Here the reading was chosen on the questions" in text
    assert "so a pass is optimistic" in text


def test_data_from_other_settings_holds_out_neither_training_nor_validation_questions(trained, tmp_path):
    cfg, ckpt = trained
    _, other_cfg = write_config(tmp_path, tmp_path / "other")
    data = make_data(other_cfg, n_questions=14, seed=3, engines=open_dataset(cfg.data_dir).manifest["engines"])
    split = json.loads((ckpt / "metrics.json").read_text())["split"]
    renamed = split["test"][0]  # in the other folder: a question of a template the checkpoint trained on
    manifest = json.loads((data / MANIFEST).read_text())
    manifest["fingerprint"] = "generated with other settings"  # so it is not the training data
    duplicate = "q013"  # a renamed duplicate record of a question trained on (which had no family)
    kept = "q012"  # a template named like a trained question id that is not in this folder: a template, not seen
    manifest[FAMILIES] = {renamed: "template-9", duplicate: split["train"][0], kept: "q099"}
    write_manifest(data, manifest)
    copy = tmp_path / "checkpoint"
    shutil.copytree(ckpt, copy)
    metrics = json.loads((copy / "metrics.json").read_text())
    copied = split["test"][1]  # in the other folder a question of its own, whose renamed copy was trained on
    metrics["split"]["families"] = {"train": ["template-9", copied], "val": [], "test": []}
    metrics["split"]["train"] = metrics["split"]["train"] + ["q099"]  # (trained on, not in the other folder)
    (copy / "metrics.json").write_text(json.dumps(metrics))
    report = evaluate_checkpoint(copy, data=data, out=tmp_path / "report", overrides=QUICK, print_fn=quiet)
    assert report.metrics["data"]["is_training_data"] is False
    # the validation questions chose the epoch, layer and threshold: they are not held out either, nor is a
    # question of a family trained on
    held = report.metrics["heldout"]
    expected = {f"q{i:03d}" for i in range(14)} - set(split["train"]) - set(split["val"]) - {renamed, copied, duplicate}
    assert set(held["questions"]) == expected and "q012" in expected
    assert held["n_val_questions"] == len(split["val"]) and held["warning"] is None
    assert "nor of a question family" in held["how"]
    # the intervals resample whole families (here each question is its own but q012, of "q099")
    assert report.metrics["settings"]["resample"] == "family" and held["n_families"] == len(expected)
    assert f"resamples of whole question families (templates; a question without one is its own: {len(expected)} " \
        "families among the held-out questions)" in report.markdown.read_text()


def test_a_training_question_under_another_id_is_not_held_out(trained, tmp_path):
    """Records without ids are numbered by file, so another data folder can hold a trained question under another
    id: probe-train records the trained and validated questions' text digests, and probe-eval leaves it out."""
    cfg, ckpt = trained
    _, other_cfg = write_config(tmp_path, tmp_path / "other")
    data = make_data(other_cfg, n_questions=14, seed=3, engines=open_dataset(cfg.data_dir).manifest["engines"])
    manifest = json.loads((data / MANIFEST).read_text())
    manifest["fingerprint"] = "generated with other settings"  # so it is not the training data
    write_manifest(data, manifest)
    copy = tmp_path / "checkpoint"
    shutil.copytree(ckpt, copy)
    metrics = json.loads((copy / "metrics.json").read_text())
    split = metrics["split"]
    assert len(split["question_digests"]["train"]) == len(split["train"])  # one text each (the fixture's differ)
    moved = split["train"][0]  # trained on as "renamed-..." (its text the same): in the other folder, `moved`
    split["train"] = [f"renamed-{q}" if q == moved else q for q in split["train"]]
    (copy / "metrics.json").write_text(json.dumps(metrics))
    held = evaluate_checkpoint(copy, data=data, out=tmp_path / "report", overrides=QUICK + ["eval.verifiers=[]"],
                               print_fn=quiet).metrics["heldout"]
    assert moved not in held["questions"] and "q012" in held["questions"]
    assert "nor 1 whose text a training or validation question had (under another id)" in held["how"]


def test_intervals_resample_the_families_in_every_part(trained, tmp_path):
    """Held-out questions of 2 templates: every part's intervals are withheld for too few families (each part
    resamples families, not questions); with eval.resample=question none says so."""
    cfg, ckpt = trained
    _, other_cfg = write_config(tmp_path, tmp_path / "other")
    data = make_data(other_cfg, n_questions=14, seed=3, engines=open_dataset(cfg.data_dir).manifest["engines"])
    manifest = json.loads((data / MANIFEST).read_text())
    manifest["fingerprint"] = "generated with other settings"  # so it is not the training data
    manifest[FAMILIES] = {f"q{i:03d}": f"new-template-{i % 2}" for i in range(14)}
    write_manifest(data, manifest)

    def guards(tree, path=""):
        if isinstance(tree, dict):
            if "too_small" in tree:
                yield path, tree["too_small"]
            for key, value in tree.items():
                yield from guards(value, f"{path}/{key}")

    report = evaluate_checkpoint(ckpt, data=data, out=tmp_path / "family", overrides=QUICK, print_fn=quiet)
    assert report.metrics["heldout"]["n_families"] == 2
    found = dict(guards(report.metrics["parts"]))
    parts = {path.split("/")[1] for path in found}
    assert {"probes", "acceptance", "verifiers"} <= parts, parts
    assert all("2 question families (templates) < 5" in (reason or "") for reason in found.values()), found
    by_question = evaluate_checkpoint(ckpt, data=data, out=tmp_path / "question", overrides=QUICK + ["eval.resample=question"],
                                      print_fn=quiet)
    assert not any("families" in (reason or "") for _, reason in guards(by_question.metrics["parts"]))
    assert "resamples of whole questions" in by_question.markdown.read_text()


def test_the_sweeps_show_progress_bars_unless_told_not_to(trained, tmp_path, capsys):
    """The layer and logistic sweeps (a full-size model's every layer: many fits) run under bars with an ETA."""
    _, ckpt = trained
    sweeps = ["eval.n_boot=10", "eval.umap=false", "eval.verifiers=[]", "eval.sweep_epochs=2"]
    assert main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "bars"), *sweeps]) == 0
    err = capsys.readouterr().err
    assert "layer sweep (target)" in err and "logistic sweep (draft_via_target)" in err and "fit" in err
    assert main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "quiet"), *sweeps, "--no-progress"]) == 0
    assert "sweep (" not in capsys.readouterr().err


def test_cli_report_and_errors(trained, tmp_path, capsys):
    _, ckpt = trained
    out = tmp_path / "cli"
    assert main(["--checkpoint", str(ckpt), "--out", str(out), *QUICK, "eval.n_bins=5"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["settings"]["n_boot"] == 30 and metrics["settings"]["n_bins"] == 5
    assert not (out / "layer_sweep.png").exists()
    assert main(["--checkpoint", str(tmp_path / "nope")]) == 1
    assert "checkpoint folder not found" in capsys.readouterr().err
    assert main(["--checkpoint", str(tmp_path), "--out", str(tmp_path / "x")]) == 1
    assert "no checkpoint.json" in capsys.readouterr().err
    assert main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "y"), "eval.alpha=3"]) == 1
    assert "eval.alpha must be in (0, 1)" in capsys.readouterr().err
    # a --data that is not there, or not a data folder: an error, not a report with every data part skipped
    assert main(["--checkpoint", str(ckpt), "--data", str(tmp_path / "nosuch"), "--out", str(tmp_path / "z")]) == 1
    assert "--data " in capsys.readouterr().err and not (tmp_path / "z").exists()
    (tmp_path / "not-data").mkdir()
    assert main(["--checkpoint", str(ckpt), "--data", str(tmp_path / "not-data"), "--out", str(tmp_path / "w"),
                 *QUICK]) == 1
    err = capsys.readouterr().err
    assert "skipped data" in err and "could not be read" in err
    # the same folder for a comparison: an error too, and no comparison that holds only the data-free parts
    assert main(["--compare", str(ckpt), str(ckpt), "--data", str(tmp_path / "not-data"), "--out",
                 str(tmp_path / "v"), *QUICK]) == 1
    assert "could not be read" in capsys.readouterr().err and not (tmp_path / "v" / "comparison.md").exists()


def test_a_checkpoint_whose_embedder_moved_is_evaluated_with_embedding_model(trained, tmp_path, capsys):
    """The embedding verifier's JSON names a local path this machine lacks: its part is skipped, saying so, until
    --embedding-model names where the same embedder is (--judge-base is the judge's alone)."""
    import shutil

    cfg, ckpt = trained
    moved = tmp_path / "checkpoint"
    shutil.copytree(ckpt, moved)
    entry = json.loads((moved / "embedding_threshold.json").read_text())
    (moved / "embedding_threshold.json").write_text(json.dumps({**entry, "embedding_model": str(tmp_path / "gone")}))
    args = ["--checkpoint", str(moved), "--data", str(cfg.data_dir), *QUICK, "eval.umap=false"]
    assert main([*args, "--out", str(tmp_path / "r1"), "--judge-base", "offline:minilm"]) == 0
    assert "skipped verifiers/embedding" in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "r2"), "--embedding-model", "offline:minilm"]) == 0
    metrics = json.loads((tmp_path / "r2" / "metrics.json").read_text())
    assert "embedding" in metrics["parts"]["verifiers"]["by_verifier"]


def test_compare_two_reports(report, trained, tmp_path):
    _, ckpt = trained
    other = evaluate_checkpoint(ckpt, out=tmp_path / "b", overrides=QUICK + ["eval.n_bins=5"], print_fn=quiet)
    assert main(["--compare", str(report.folder), str(other.folder), "--out", str(tmp_path / "ab")]) == 0
    result = json.loads((tmp_path / "ab" / "comparison.json").read_text())
    rows = {r["metric"]: r for r in result["rows"]}
    # same probes, same rows: Brier does not depend on the bins, ECE does
    assert rows["probe_target/draft_via_target/brier"]["delta"] == pytest.approx(0.0)
    ece = rows["probe_target/draft_via_target/ece_uniform"]
    assert ece["delta"] == pytest.approx(ece["b"] - ece["a"]) and ece["a"] != ece["b"]
    assert "layer_sweep/target/val_brier" not in rows  # B has no sweep
    markdown = (tmp_path / "ab" / "comparison.md").read_text()
    assert "Δ (B − A)" in markdown and "`probe_target/draft_via_target/ece_uniform`" in markdown
    # evaluated with other settings (bins, resamples): the deltas stay, no side is called better
    assert "different settings (n_boot " in result["warning"] and "; n_bins 10 and 5)" in result["warning"]
    # a report made before eval.resample resampled whole questions: compared with one that resamples families, or
    # with one that resamples questions
    older, by_question, by_family = tmp_path / "older", tmp_path / "by_question", tmp_path / "by_family"
    for folder, resample in ((older, None), (by_question, "question"), (by_family, "family")):
        shutil.copytree(report.folder, folder)
        saved = json.loads((folder / "metrics.json").read_text())
        saved["settings"].pop("resample") if resample is None else saved["settings"].update(resample=resample)
        (folder / "metrics.json").write_text(json.dumps(saved))
    assert main(["--compare", str(by_family), str(older), "--out", str(tmp_path / "ab2")]) == 0
    warning = json.loads((tmp_path / "ab2" / "comparison.json").read_text())["warning"]
    assert "different settings (resample family and question)" in warning
    assert main(["--compare", str(older), str(by_question), "--out", str(tmp_path / "ab3")]) == 0
    assert json.loads((tmp_path / "ab3" / "comparison.json").read_text())["warning"] is None
    assert all(r["better"] is None for r in result["rows"])
    # a verifier whose ranking the report does not quote (too few pairs of a class) is not compared on it
    verifiers = other.metrics["parts"]["verifiers"]["by_verifier"]
    verifiers["embedding"].pop("ranking_not_evaluable", None)  # (the fixture's few pairs: withheld already)
    assert "verifiers/embedding/auroc" in headline(other.metrics)
    verifiers["embedding"]["ranking_not_evaluable"] = "3 equivalent pairs"
    ranked = headline(other.metrics)
    assert "verifiers/embedding/auroc" not in ranked and "verifiers/embedding/precision" in ranked
    # acceptance rows against different empirical ratios (a report from before the probes' scale): none better
    for name, older in (("same", False), ("older", True)):
        copies = [tmp_path / f"{name}-a", tmp_path / f"{name}-b"]
        for folder, mae in zip(copies, (0.5, 0.01)):  # intervals far apart (the fixture's are withheld)
            shutil.copytree(other.folder, folder)
            metrics = json.loads((folder / "metrics.json").read_text())
            block = metrics["parts"]["acceptance"]["probes"]
            block["metrics"]["mae"] = {"estimate": mae, "low": mae * 0.9, "high": mae * 1.1}
            if older and folder == copies[1]:
                del block["empirical_q"]
            (folder / "metrics.json").write_text(json.dumps(metrics))
        assert main(["--compare", *map(str, copies), "--out", str(tmp_path / f"c-{name}")]) == 0
        result = json.loads((tmp_path / f"c-{name}" / "comparison.json").read_text())
        mae = next(r for r in result["rows"] if r["metric"] == "acceptance/mae")
        assert mae["better"] == (None if older else "b")
        assert (result["warning"] is not None and "divides by own_prob and B's by semantic_prob" in result["warning"]) \
            == older
    # scored on other held-out questions (another split): the deltas stay, no side is called better
    shifted = tmp_path / "shifted"
    shutil.copytree(other.folder, shifted)
    metrics = json.loads((shifted / "metrics.json").read_text())
    metrics["heldout"]["questions"] = metrics["heldout"]["questions"][1:]
    (shifted / "metrics.json").write_text(json.dumps(metrics))
    assert main(["--compare", str(report.folder), str(shifted), "--out", str(tmp_path / "as")]) == 0
    result = json.loads((tmp_path / "as" / "comparison.json").read_text())
    assert "different held-out questions" in result["warning"] and "1 in common" in result["warning"]
    assert all(r["better"] is None for r in result["rows"]) and any(r["delta"] for r in result["rows"])
    assert "**WARNING: A and B were scored on different" in (tmp_path / "as" / "comparison.md").read_text()
    # the same questions of data made with other settings
    metrics = json.loads((other.folder / "metrics.json").read_text())
    metrics["data"]["fingerprint"] = {"data": {"num_samples": 99}}
    metrics["data"]["folder"] = "/elsewhere/data"
    (shifted / "metrics.json").write_text(json.dumps(metrics))
    assert main(["--compare", str(report.folder), str(shifted), "--out", str(tmp_path / "ad")]) == 0
    result = json.loads((tmp_path / "ad" / "comparison.json").read_text())
    assert "/elsewhere/data differ" in result["warning"] and all(r["better"] is None for r in result["rows"])


@pytest.mark.slow
def test_wandb_offline_logs_metrics_and_figures(trained, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    _, ckpt = trained
    out = tmp_path / "w"
    assert main(["--checkpoint", str(ckpt), "--out", str(out), "--wandb", *QUICK]) == 0
    runs = list((out / "wandb").rglob("offline-run-*"))
    assert runs and any(runs[0].rglob("*.wandb"))
    images = list(runs[0].rglob("media/images/**/*.png"))
    assert len(images) == len(FIGURES) - 2  # every figure of the report (no layer sweeps here: QUICK)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["wandb"]["mode"] == "offline"


@pytest.mark.slow
def test_umap_view(trained, tmp_path):
    _, ckpt = trained
    report = evaluate_checkpoint(ckpt, out=tmp_path, overrides=QUICK + ["eval.umap=true", "eval.umap_max_points=60"],
                                 print_fn=quiet)
    part = report.metrics["parts"]["umap"]
    for role in ("target", "draft"):
        assert part[role]["n"] == 60 and part[role]["layer"] == 4 and sum(part[role]["bin_counts"]) == 60
    image = imread(tmp_path / "umap.png")
    assert image.shape[1] > 600 and image[..., :3].std() > 0.05


def test_compare_two_checkpoints_evaluates_both(trained, tmp_path):
    from specprobe.train.report import compare_checkpoints

    _, ckpt = trained
    partial = tmp_path / "no-draft-probe"
    shutil.copytree(ckpt, partial)
    for suffix in (".json", ".safetensors"):
        (partial / f"probe_draft{suffix}").unlink()
    result = compare_checkpoints(ckpt, partial, out=tmp_path / "cmp", overrides=QUICK, print_fn=quiet)
    assert (tmp_path / "cmp" / "A" / "report.md").is_file() and (tmp_path / "cmp" / "B" / "report.md").is_file()
    metrics = {r["metric"] for r in result["rows"]}
    assert "probe_target/draft_via_target/auroc" in metrics
    assert not any(m.startswith(("probe_draft/", "acceptance/")) for m in metrics)  # B has neither
    assert all(r["delta"] == pytest.approx(0.0) for r in result["rows"] if r["delta"] is not None)


def test_compare_checks_both_sides_before_evaluating_either(report, trained, tmp_path, monkeypatch, capsys):
    """A misspelt B, or a report whose metrics.json was cut short: an error naming it before A is evaluated."""
    from specprobe.train.report import runner

    _, ckpt = trained
    monkeypatch.setattr(runner, "evaluate_checkpoint", lambda *a, **k: pytest.fail("A was evaluated"))
    assert main(["--compare", str(ckpt), str(tmp_path / "nope"), "--out", str(tmp_path / "ab")]) == 1
    assert re.search(r"checkpoint folder not found: .*nope", capsys.readouterr().err)
    cut = tmp_path / "cut"
    shutil.copytree(report.folder, cut)
    (cut / "metrics.json").write_text((report.folder / "metrics.json").read_text()[:200])
    assert main(["--compare", str(ckpt), str(cut), "--out", str(tmp_path / "ab")]) == 1
    assert re.search(r"cut/metrics.json is not valid JSON .*run probe-eval on the checkpoint again",
                     capsys.readouterr().err)


def test_default_report_folder():
    from pathlib import Path

    from specprobe.train.report.runner import default_out

    assert default_out(Path("runs/tiny/checkpoint")) == Path("runs/tiny/report")
    assert default_out(Path("checkpoints/r1-7b")) == Path("checkpoints/r1-7b-report")


def test_split_is_recomputed_when_the_checkpoint_did_not_record_it(trained, report, tmp_path):
    _, ckpt = trained
    copy = tmp_path / "checkpoint"
    shutil.copytree(ckpt, copy)
    metrics = json.loads((copy / "metrics.json").read_text())
    del metrics["split"]
    (copy / "metrics.json").write_text(json.dumps(metrics))
    again = evaluate_checkpoint(copy, out=tmp_path / "r", overrides=QUICK + ["eval.verifiers=[]"], print_fn=quiet)
    assert "recomputed" in again.metrics["heldout"]["how"]
    assert again.metrics["heldout"]["questions"] == report.metrics["heldout"]["questions"]
    assert again.skipped == [] and "verifiers" not in again.metrics["parts"]  # eval.verifiers=[]: not asked for


def test_missing_data_folder_still_writes_a_report_saying_so(trained, tmp_path):
    _, ckpt = trained
    copy = tmp_path / "moved" / "checkpoint"
    shutil.copytree(ckpt, copy)
    meta = json.loads((copy / "checkpoint.json").read_text())
    meta["data"]["folder"] = str(tmp_path / "gone" / "data")
    meta["config"]["output_dir"] = str(tmp_path / "gone")
    (copy / "checkpoint.json").write_text(json.dumps(meta))
    report = evaluate_checkpoint(copy, print_fn=quiet)
    assert report.folder == tmp_path / "moved" / "report"
    assert [s["part"] for s in report.skipped] == ["data"] and "pass --data" in report.skipped[0]["reason"]
    # what the checkpoint alone holds is still reported: its training curves
    assert list(report.metrics["parts"]) == ["training"]
    assert [f["file"] for f in report.metrics["figures"]] == ["training_curves.png"]
    text = report.markdown.read_text()
    assert "pass --data" in text and "Training curves" in text


def test_logistic_sweep_covers_every_layer_and_pooling_of_every_set(report, trained):
    """Each row set swept on its own, against its own constant, with intervals; the reading it calls best is the
    one with the lowest validation log-loss; the planted signal beats the constant."""
    cfg, _ = trained
    ds = open_dataset(cfg.data_dir)
    part = report.metrics["parts"]["logistic_sweep"]
    assert set(part["sets"]) == {"target_own", "draft_via_target", "draft_own", "draft_accept"}
    constants = set()
    for name, sweep in part["sets"].items():
        role = "draft" if name in ("draft_own", "draft_accept") else "target"
        readings = {(e["pooling"], e["layer"]) for e in sweep["entries"]}
        assert readings == {(p, r) for p in ("mean", "last") for r in ds.layers(role)}
        assert sweep["best"] == min(sweep["entries"], key=lambda e: (e["val_log_loss"], e["layer"]))
        delta = sweep["best"]["versus_constant"]["brier_delta"]
        assert delta["withheld"]  # 2 test questions: no interval, and it says why
        if name != "draft_accept":  # the synthetic draft features carry the draft's own label, not the target's
            assert delta["estimate"] < 0
        constants.add(round(sweep["constant"], 6))
    assert len(constants) == 3  # draft_accept shares draft_via_target's labels (and so its constant)
    assert "logistic_sweep.png" in {f["file"] for f in report.metrics["figures"]}
    text = report.markdown.read_text()
    assert "Logistic probe per layer, per row set" in text and "the reading chosen on validation" in text
    assert "chosen and scored on the same questions" not in text and "a pass is optimistic" not in text
    assert "Here the reading was chosen on the questions" not in text


def test_positive_control_recovers_the_token_probability(report):
    """The synthetic steps' log-probs follow their cluster sizes, which the features carry: the control recovers
    them (the fixture's 2 test questions are too few for an interval, so the check says so instead of passing);
    the length is constant there (8 tokens), so that check is skipped and says why."""
    from specprobe.train.report.classic import control_check

    part = report.metrics["parts"]["positive_control"]
    for set_name in ("target_own", "draft_own"):
        token = part["sets"][set_name]["targets"]["token_prob"]
        assert token["versus_constant"]["brier_skill"]["estimate"] > 0.3
        assert token["check"] == "too small to tell"
        assert "length_share" not in part["sets"][set_name]["targets"]
    assert any(s["part"] == "positive_control/target_own/length_share" for s in report.metrics["skipped"])
    assert part["verdict"].startswith("too small to tell")
    assert control_check({"estimate": 0.2, "low": 0.05, "high": 0.3}) == "passed"
    assert control_check({"estimate": 0.02, "low": -0.01, "high": 0.05}) == "FAILED"


def test_a_positive_control_with_nothing_to_check_says_not_tested(trained, tmp_path, monkeypatch):
    """Every known quantity constant on the training rows: nothing was checked, and the verdict says so (it said
    FAILED, as if the pipeline had missed them)."""
    from specprobe.train.report import classic

    _, ckpt = trained
    monkeypatch.setattr(classic, "control_targets", lambda ctx, rows: {"token_prob": np.full(len(rows.sample_ids), 0.5)})
    report = evaluate_checkpoint(ckpt, out=tmp_path / "r", overrides=["eval.n_boot=30", "eval.layer_sweep=false"],
                                 print_fn=lambda _: None)
    part = report.metrics["parts"]["positive_control"]
    assert not any(s["targets"] for s in part["sets"].values())
    assert part["verdict"].startswith("not tested") and "FAILED" not in part["verdict"]
    assert "**Verdict:** not tested" in (tmp_path / "r" / "report.md").read_text()


def test_a_bad_held_out_label_is_named_by_sample_and_field(trained, tmp_path, monkeypatch):
    """A held-out label that is not a probability: the parts that read it are skipped with the sample and the field
    named (as probe-train's checks name them), not 'pred and label must be finite'; the others go on."""
    import dataclasses

    from specprobe.train.report import sections

    _, ckpt = trained
    real = sections.EvalContext.rows

    def rows(self, set_name, pooling="mean"):
        got = real(self, set_name, pooling)
        if set_name != "target_own":
            return got
        y = got.y.clone()
        y[int(np.flatnonzero(self.heldout.mask(got.questions))[0])] = float("nan")
        return dataclasses.replace(got, y=y)

    monkeypatch.setattr(sections.EvalContext, "rows", rows)
    report = evaluate_checkpoint(ckpt, out=tmp_path / "r", overrides=QUICK, print_fn=quiet)
    reasons = [s["reason"] for s in report.skipped]
    assert any("held-out rows of target_own: field 'own_prob' must be a probability" in r and "first sample_id" in r
               for r in reasons), reasons
    assert not any("must be finite" in r for r in reasons)
    assert "draft_via_target" in report.metrics["parts"]["probes"]["by_probe"]["probe_target"]  # the rest goes on


def test_the_training_curves_are_the_checkpoints_recorded_ones(report, trained):
    """Section 6 draws what probe-train recorded (each MLP probe's losses per epoch, its kept epoch), not a new fit."""
    _, ckpt = trained
    recorded = json.loads((ckpt / "metrics.json").read_text())["probes"]
    (fig,) = [f for f in report.metrics["figures"] if f["file"] == "training_curves.png"]
    assert fig["section"] == "training"
    part = report.metrics["parts"]["training"]
    with_history = {n for n, e in recorded.items() if (e.get("history") or {}).get("train_loss")}
    assert with_history and set(part["probes"]) == with_history
    for name in with_history:
        assert part["probes"][name]["best_epoch"] == recorded[name]["history"]["best_epoch"]
    assert "## 6. Training curves" in report.markdown.read_text()
