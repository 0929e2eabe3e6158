"""probe-eval on a tiny REAL checkpoint: SmolLM2-135M samples steps as target and draft, MiniLM clusters
them, probe-train trains probes, baselines, the embedding threshold and a judge-LoRA (a few steps), and
the report is written with every part, UMAP and the judge included. Slow (a few minutes on 2 cores)."""
from __future__ import annotations

import json

import pytest
import torch
import yaml
from matplotlib.image import imread

from specprobe.train.config import load_config
from specprobe.train.report import evaluate_checkpoint

pytestmark = pytest.mark.slow

SMOL = "offline:smollm2-135m-instruct"
CONFIG = {
    "name": "eval-real-tiny",
    "models": {"target": SMOL, "draft": SMOL, "device": "cpu", "dtype": "float32"},
    "source": {"kind": "reasoning_gym", "task": "gsm_symbolic", "size": 5, "seed": 0},
    # cool sampling and short steps so that samples repeat meanings: the judge needs equivalent pairs
    "sampling": {"temperature": 0.3, "top_p": 0.9, "max_step_tokens": 10, "draft_temperature": 0.8, "seed": 0},
    "data": {"contexts_per_trace": 1, "num_samples": 6, "judge": "embedding", "embedding_model": "offline:minilm",
             "layers": "range:26-30", "contexts_per_shard": 5},
    "probe": {"features": "range:26-30", "hidden_dim": 16, "epochs": 30, "patience": 10, "batch_size": 16,
              "val_fraction": 0.4},
    "verifiers": {"train": ["probes", "embedding", "judge"], "embedding_model": "offline:minilm",
                  "target_precision": 0.8, "judge_base": SMOL, "judge_steps": 2, "judge_batch_size": 2,
                  "judge_max_pairs": 8, "judge_eval_pairs": 16, "judge_lora_r": 4, "judge_lora_alpha": 8},
    "eval": {"n_boot": 50, "umap_max_points": 200, "judge_max_pairs": 30, "sweep_epochs": 5},
}
RELIABILITY = ("reliability_probe_target_draft_via_target", "reliability_probe_target_target_own",
               "reliability_probe_draft_draft_own", "reliability_probe_acceptance_draft_accept")
FIGURES = ({f"{name}.png" for name in RELIABILITY} | {f"{name}_equal_mass.png" for name in RELIABILITY}
           | {"acceptance_scatter.png", "layer_sweep.png", "logistic_sweep.png", "umap.png", "verifiers_roc_pr.png",
              "training_curves.png"})


@pytest.fixture(scope="module")
def real_checkpoint(tmp_path_factory):
    from specprobe.data_gen.pipeline import generate_dataset
    from specprobe.train.pipeline import train_all

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp("eval-real")
    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump({**CONFIG, "output_dir": str(root / "run")}, sort_keys=False))
    cfg = load_config(path)
    generate_dataset(cfg.data_job(), progress=False)
    train_all(cfg, print_fn=lambda _: None)
    yield cfg
    torch.set_num_threads(before)  # later modules keep their own thread count


def test_real_tiny_checkpoint_report_has_every_part(real_checkpoint, tmp_path, monkeypatch):
    from specprobe.train.report import verifiers as report_verifiers

    cfg = real_checkpoint
    bars, score = [], report_verifiers.judge_probability
    monkeypatch.setattr(report_verifiers, "judge_probability",
                        lambda *a, **k: bars.append(k.get("progress")) or score(*a, **k))
    report = evaluate_checkpoint(cfg.checkpoint_dir, out=tmp_path / "report", print_fn=lambda _: None, progress=True)
    assert bars == ["judge LoRA pairs"]  # the judge's scoring (minutes on a CPU) shows its bar
    # a positive-control quantity that does not vary on the training rows is skipped (and says so); nothing else is
    assert all(s["part"].startswith("positive_control/") and "constant" in s["reason"] for s in report.skipped)
    assert {f["file"] for f in report.metrics["figures"]} == FIGURES
    for name in FIGURES:
        assert imread(tmp_path / "report" / name)[..., :3].std() > 0.05
    parts = report.metrics["parts"]
    assert set(parts) == {"probes", "acceptance", "layer_sweep", "logistic_sweep", "positive_control", "umap",
                          "verifiers", "training"}
    assert parts["training"]["judge"]["steps"] == 2  # the judge LoRA's recorded curve, beside the probes'
    assert set(parts["training"]["probes"]) >= {"probe_target", "probe_draft"}
    assert parts["positive_control"]["sets"]["target_own"]["targets"]  # at least one quantity was checked
    assert [e["layer"] for e in parts["layer_sweep"]["target"]["entries"]] == [26, 27, 28, 29, 30]
    assert set(parts["verifiers"]["by_verifier"]) == {"embedding", "judge"}
    pairs = {(a["first"], a["second"]) for a in parts["verifiers"]["agreement"]}
    assert pairs == {("label", "embedding"), ("label", "judge"), ("embedding", "judge")}
    judge = parts["verifiers"]["by_verifier"]["judge"]
    assert judge["n"] <= 30 and judge["n_positive"] >= 1  # stratified: the curves are defined
    assert judge["metrics"]["auroc"]["estimate"] is not None
    split = json.loads((cfg.checkpoint_dir / "metrics.json").read_text())["split"]
    assert split["test"], "the default config holds out test questions"
    assert report.metrics["heldout"]["questions"] == sorted(split["test"])  # the report scores the test split
