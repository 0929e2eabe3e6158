"""Bad training input is a clear error naming the record/field, raised before any training starts."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from specprobe.train import probes_train
from specprobe.train.pipeline import train_all
from specprobe.train.probes_train import TrainingDataError, feature_spec

from _train_fixtures import ENGINES, synthetic_config, write_synthetic_data


@pytest.fixture(autouse=True)
def no_training(monkeypatch):
    """Any probe training or threshold fitting during these tests is a failure."""
    def boom(*args, **kwargs):
        raise AssertionError("training started although the input is bad")

    monkeypatch.setattr(probes_train, "fit_probe", boom)
    monkeypatch.setattr("specprobe.train.pair_verifiers.fit_threshold", boom)


def _train(tmp_path: Path, **sections):
    cfg = synthetic_config(tmp_path, tmp_path, **sections)
    printed: list[str] = []
    with pytest.raises(TrainingDataError) as info:
        train_all(cfg, print_fn=printed.append)
    assert printed == [], "nothing may be printed (or trained) before the input is checked"
    assert not (tmp_path / "checkpoint").exists()
    return str(info.value)


def test_empty_data_folder(tmp_path):
    write_synthetic_data(tmp_path, questions=0)
    assert "no samples" in _train(tmp_path)


def test_single_class_labels(tmp_path):
    def constant(shard):
        for row in shard.samples:
            row["semantic_prob"] = row["own_prob"] = row["prob_under_target"] = 0.5

    write_synthetic_data(tmp_path, questions=6, edit=constant)
    message = _train(tmp_path)
    assert "single-class training set for probe_target" in message and "0.5" in message


def test_nan_features_name_the_sample(tmp_path):
    def poison(shard):
        if shard.index == 2:
            shard.features["draft.mean"][1, 0, 3] = math.nan

    write_synthetic_data(tmp_path, questions=6, edit=poison)
    message = _train(tmp_path, probe={"val_fraction": 0.2})
    assert "NaN/inf features" in message and "draft_own" in message
    assert "'q2@0/draft/1'" in message


def test_bad_rows_of_a_set_only_scored_stop_the_run_before_training(tmp_path):
    """Without probe.target_with_draft the target probe trains on target steps only; draft steps under the target
    are only scored, after training, and a NaN there must stop the run first."""
    def poison(shard):
        if shard.index == 2:
            draft_row = next(r for r in shard.samples if r["model"] == "draft")
            shard.features["target.mean"][draft_row["target_feature_row"], 0, 3] = math.nan

    write_synthetic_data(tmp_path, questions=6, edit=poison)
    message = _train(tmp_path, probe={"target_with_draft": False})
    assert "NaN/inf features" in message and "draft_via_target" in message and "'q2@0/draft/0'" in message


def test_missing_label_names_field_and_sample(tmp_path):
    def drop(shard):
        if shard.index == 1:
            next(r for r in shard.samples if r["model"] == "draft")["prob_under_target"] = None

    write_synthetic_data(tmp_path, questions=6, edit=drop)
    message = _train(tmp_path)
    assert "'prob_under_target'" in message and "'q1@0/draft/0'" in message


def test_single_class_pairs(tmp_path):
    def all_equivalent(shard):
        for pair in shard.pairs:
            pair["equivalent"] = True

    write_synthetic_data(tmp_path, questions=6, edit=all_equivalent)
    message = _train(tmp_path, verifiers={"train": ["embedding"]})
    assert "single-class training pairs" in message and "equivalent" in message


def test_data_of_another_model(tmp_path):
    write_synthetic_data(tmp_path, questions=6)
    message = _train(tmp_path, models={"target": "offline:smollm2-135m-instruct"})
    assert "target model 'toy/target-model'" in message and "offline:smollm2-135m-instruct" in message


def test_probe_layers_not_in_the_data():
    with pytest.raises(TrainingDataError, match=r"stored only rows \[2, 3\].*data.layers"):
        feature_spec(ENGINES["target"], [2, 3], "all", "concat", "mean", "target")
    spec, cols = feature_spec(ENGINES["target"], [2, 3], "last", "concat", "mean", "target")
    assert (spec.layers, cols) == ([3], [1])


def test_a_training_set_without_rows_names_the_set(tmp_path):
    def no_draft_steps(shard):
        shard.samples[:] = [r for r in shard.samples if r["model"] != "draft"]

    write_synthetic_data(tmp_path, questions=6, edit=no_draft_steps)
    message = _train(tmp_path)
    assert "empty training rows of" in message and "no samples to train on" in message
