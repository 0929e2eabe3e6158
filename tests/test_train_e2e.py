"""End to end: `probe-train --config X` on real (tiny) data from SmolLM2 + MiniLM: data stage, every verifier,
checkpoint loaded by the runtime against the real engine."""
from __future__ import annotations

import json

import pytest

from specprobe.infer.checkpoint_format import Checkpoint, find_pickles

from _data_fixtures import write_config

pytestmark = pytest.mark.slow

VERIFIERS = {"train": ["probes", "embedding", "judge"], "embedding_model": "offline:minilm", "target_precision": 0.8,
             "judge_base": "offline:smollm2-135m-instruct", "judge_lora_r": 2, "judge_lora_alpha": 4,
             "judge_lora_layers": 1, "judge_steps": 2, "judge_batch_size": 2, "judge_eval_pairs": 4}
PROBE = {"features": "range:27-30", "hidden_dim": 16, "epochs": 10, "batch_size": 8, "val_fraction": 0.3,
         "test_fraction": 0.0}  # 4 questions: 3 to train on (a test split is exercised in test_train_pipeline)


def test_probe_train_all_stages(tmp_path, capsys, smol_engine):
    from specprobe.infer.verifiers import load_verifier
    from specprobe.train.cli import main

    path, cfg = write_config(tmp_path, tmp_path / "run", source={"size": 4}, data={"num_samples": 5},
                             # cool enough that some of the N = 5 samples share a meaning: every probe needs
                             # labels that vary (the tiny data fixture's draft at T = 1.0 gives all singletons)
                             sampling={"temperature": 0.3, "draft_temperature": 0.5},
                             probe=PROBE, verifiers=VERIFIERS)
    assert main(["--config", str(path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    for text in ("==== validation metrics ====", "probe_target", "on draft_via_target", "probe_draft",
                 "embedding threshold verifier", "judge-LoRA verifier", "base model (untrained)"):
        assert text in out

    # the judge's training state was kept beside the checkpoint while it trained, and goes once the judge is in it
    steps = cfg.checkpoint_dir.with_name("checkpoint-judge-steps")
    assert f"removed {steps} (the judge LoRA's training state" in out and not steps.exists()
    ckpt = Checkpoint(cfg.checkpoint_dir)
    assert {"probe_target", "probe_draft", "baselines", "embedding_threshold", "judge"} <= set(ckpt.components)
    assert find_pickles(cfg.checkpoint_dir) == []
    spec = ckpt.probe("probe_target").spec
    assert (spec.model_id, spec.num_layers, spec.hidden_size, spec.layers) == (
        "HuggingFaceTB/SmolLM2-135M-Instruct", 30, 576, [27, 28, 29, 30])
    metrics = json.loads((cfg.checkpoint_dir / "metrics.json").read_text())
    for name in ("probe_target", "probe_draft"):
        scores = next(iter(metrics["probes"][name]["val"].values()))
        assert {"probe", "last_layer", "logprob", "constant"} <= set(scores)
        assert 0 <= scores["probe"]["mae"] <= 1
    assert metrics["judge"]["val"]["verifier"]["chosen"]["n"] > 0

    verifier = load_verifier(cfg.checkpoint_dir, kind="probe", target_engine=smol_engine, draft_engine=smol_engine)
    assert verifier.layers("target") == [27, 28, 29, 30]

    # the data stage is reused on a second run, and --stage train trains again from it
    assert main(["--config", str(path), "--stage", "train", "--no-progress", "verifiers.train=[probes]"]) == 0
    assert "==== validation metrics ====" in capsys.readouterr().out
