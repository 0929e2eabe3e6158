"""SemanticProbe + FeatureSpec: learning a planted relation, combine modes, save/load, input checks."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from specprobe.probes.features import FeatureSpec, layers_from_option
from specprobe.probes.mlp import PROB_EPS, ProbeMLPConfig, SemanticProbe, fit_probe

NUM_LAYERS, HIDDEN = 4, 16
SIGNAL_ROW = 3  # the planted relation lives in hidden-state row 3

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny MLPs: one thread is fastest


def planted_data(n: int = 1200, seed: int = 1):
    """y = sigmoid(w . x[:, 3, :3]) on random [n, L+1, H] features; other rows and dims are noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, NUM_LAYERS + 1, HIDDEN, generator=g)
    w = torch.zeros(HIDDEN)
    w[:3] = torch.tensor([2.0, -1.5, 1.0])
    y = torch.sigmoid(x[:, SIGNAL_ROW, :] @ w)
    return x[:1000], y[:1000], x[1000:], y[1000:]


def make_spec(layers="all", combine="concat") -> FeatureSpec:
    return FeatureSpec(model_id="toy/model", num_layers=NUM_LAYERS, hidden_size=HIDDEN, layers=layers,
                       combine=combine)


FAST = ProbeMLPConfig(hidden_dim=64, epochs=30, batch_size=64, patience=5)


@pytest.fixture(scope="module")
def data():
    return planted_data()


@pytest.fixture(scope="module")
def concat_probe(data):
    tx, ty, vx, vy = data
    return fit_probe(tx, ty, vx, vy, make_spec(), FAST)


# ---- FeatureSpec ----------------------------------------------------------------------------------
def test_layers_from_option_forms():
    assert layers_from_option("all", 4) == [0, 1, 2, 3, 4]
    assert layers_from_option("last", 4) == [4]
    assert layers_from_option("range:1-3", 4) == [1, 2, 3]
    assert layers_from_option("3,1,3", 4) == [1, 3]
    for bad in ["range:3-1", "range:a-b", "1,9", "middle", ""]:
        with pytest.raises(ValueError):
            layers_from_option(bad, 4)


def test_feature_spec_json_round_trip_and_validation():
    spec = FeatureSpec(model_id="org/m", revision="abc", num_layers=4, hidden_size=16, layers=[1, 4],
                       combine="weighted", pooling="last")
    again = FeatureSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec
    with pytest.raises(ValueError, match="combine"):
        make_spec(combine="sum")
    with pytest.raises(ValueError, match="out of range"):
        make_spec(layers=[0, 5])
    with pytest.raises(ValueError, match="sorted"):
        make_spec(layers=[3, 1])
    with pytest.raises(ValueError, match="unknown keys"):
        FeatureSpec.from_dict({**spec.to_dict(), "extra": 1})


def test_check_compatible_messages():
    spec = make_spec()
    spec.check_compatible(NUM_LAYERS, HIDDEN, "toy/model")
    spec.check_compatible(NUM_LAYERS, HIDDEN, "/local/copies/model")  # same basename: accepted
    with pytest.raises(ValueError) as err:
        spec.check_compatible(28, 1536, "other/big")
    msg = str(err.value)
    assert "'toy/model'" in msg and "4 layers" in msg and "28 layers" in msg and "1536" in msg
    assert "retrain" in msg
    with pytest.raises(ValueError, match="different model"):
        spec.check_compatible(NUM_LAYERS, HIDDEN, "other/model2")
    with pytest.raises(ValueError, match="different model"):  # another organisation's model of the same name
        spec.check_compatible(NUM_LAYERS, HIDDEN, "other/model")
    spec.check_compatible(NUM_LAYERS, HIDDEN, "other/model2", allow_model_mismatch=True)


def test_one_rule_names_the_same_model(tmp_path, monkeypatch):
    """Equal ids (case, a trailing slash aside), or a local folder and a name with its last path component; two
    organisations' models of one name are different weights."""
    from specprobe.probes.features import same_model_name

    assert same_model_name("Qwen/Qwen2-7B", "qwen/qwen2-7b/")
    assert same_model_name("/models/Qwen2-7B", "Qwen/Qwen2-7B") and same_model_name("Qwen/Qwen2-7B", "./Qwen2-7B")
    assert not same_model_name("org-a/Qwen2-7B", "org-b/Qwen2-7B")
    assert not same_model_name("/models/Qwen2-7B", "Qwen/Qwen2-1.5B") and not same_model_name(None, "Qwen/Qwen2-7B")
    # a relative path of three parts or more is a local copy (a hub id has two); one of two parts reads as a hub id
    # whatever folders exist here (./Qwen/Qwen2-7B is no copy of org-b's model)
    assert same_model_name("weights/models/Qwen2-7B", "Qwen/Qwen2-7B")
    assert not same_model_name("weights/models/Qwen2-7B", "Qwen/Qwen2-1.5B")
    (tmp_path / "Qwen" / "Qwen2-7B").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not same_model_name("Qwen/Qwen2-7B", "org-b/Qwen2-7B") and not same_model_name("models/Qwen2-7B", "Qwen/Qwen2-7B")
    assert same_model_name("./models/Qwen2-7B", "Qwen/Qwen2-7B")  # written as a path
    # a hub cache snapshot names its organisation: hf download's folder is the hub id's, not another org's
    snap = "/hf/hub/models--Qwen--Qwen2-7B/snapshots/0123abcd"
    assert same_model_name(snap, "Qwen/Qwen2-7B") and same_model_name("qwen/qwen2-7b", snap + "/")
    assert not same_model_name(snap, "org-b/Qwen2-7B") and same_model_name(snap, "/models/Qwen2-7B")


def test_select_rows_and_shape_checks():
    spec = make_spec(layers=[1, 3])
    x = torch.randn(2, NUM_LAYERS + 1, HIDDEN)
    out = spec.select(x)
    assert out.shape == (2, 2, HIDDEN)
    assert torch.equal(out[:, 1], x[:, 3])
    with pytest.raises(ValueError, match=r"\[B, 5, 16\]"):
        spec.select(torch.randn(2, NUM_LAYERS, HIDDEN))


# ---- config ----------------------------------------------------------------------------------------
def test_probe_config_defaults_help_and_validation():
    cfg = ProbeMLPConfig()
    assert (cfg.hidden_dim, cfg.lr, cfg.betas, cfg.loss) == (256, 1e-3, (0.9, 0.95), "bce")
    assert all(f.metadata.get("help") for f in ProbeMLPConfig.__dataclass_fields__.values())
    assert ProbeMLPConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    for bad in [dict(dropout=1.0), dict(loss="hinge"), dict(lr=0), dict(epochs=0), dict(betas=(0.9, 1.0))]:
        with pytest.raises(ValueError):
            ProbeMLPConfig(**bad)


# ---- learning --------------------------------------------------------------------------------------
def test_learns_planted_relation_far_better_than_constant(data, concat_probe):
    _, ty, vx, vy = data
    probe, history = concat_probe
    pred = probe.predict_proba(vx)
    mae = (pred - vy).abs().mean().item()
    baseline = (vy - ty.mean()).abs().mean().item()
    assert mae < 0.25 * baseline, (mae, baseline)
    assert history.best_val_loss == min(history.val_loss)
    assert history.val_loss[-1] < history.val_loss[0]


def test_predictions_are_strict_probabilities(concat_probe):
    probe, _ = concat_probe
    extreme = torch.randn(8, NUM_LAYERS + 1, HIDDEN) * 1e4  # saturates the sigmoid
    pred = probe.predict_proba(extreme)
    assert ((pred > 0) & (pred < 1)).all() and pred.min() >= PROB_EPS


def test_training_is_deterministic_and_keeps_global_rng(data):
    tx, ty, vx, vy = data
    cfg = ProbeMLPConfig(hidden_dim=16, epochs=3, batch_size=128)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, _ = fit_probe(tx, ty, vx, vy, make_spec(), cfg)
    after = torch.rand(1)
    b, _ = fit_probe(tx, ty, vx, vy, make_spec(), cfg)
    assert torch.equal(a.predict_proba(vx), b.predict_proba(vx))
    assert torch.equal(before, after)  # fit_probe forks the RNG instead of consuming it
    c, _ = fit_probe(tx, ty, vx, vy, make_spec(), ProbeMLPConfig(hidden_dim=16, epochs=3, batch_size=128, seed=1))
    assert not torch.equal(a.predict_proba(vx), c.predict_proba(vx))


def test_early_stopping_restores_best_weights(data):
    tx, ty, vx, vy = data
    # a large lr on a small net overfits/oscillates, so the last epoch is rarely the best one
    cfg = ProbeMLPConfig(hidden_dim=32, epochs=40, batch_size=32, lr=3e-2, patience=2, dropout=0.0)
    probe, history = fit_probe(tx[:200], ty[:200], vx, vy, make_spec(), cfg)
    assert history.stopped_early and history.epochs_run < 40
    assert history.epochs_run == history.best_epoch + 1 + cfg.patience
    from specprobe.probes.mlp import eval_loss
    restored = eval_loss(probe, make_spec().select(vx), vy, "bce", 1024)
    assert restored == pytest.approx(history.best_val_loss, rel=1e-5)


def test_a_probe_whose_validation_loss_is_never_finite_is_an_error(data, monkeypatch):
    """Diverged training (NaN validation loss every epoch) never improves on the start: the initial weights would
    come back as a trained probe, so fitting fails and says what to change."""
    from specprobe.probes import mlp

    tx, ty, vx, vy = data
    monkeypatch.setattr(mlp, "eval_loss", lambda *a: float("nan"))
    with pytest.raises(ValueError, match=r"never finite in 3 epochs .* lower probe.lr"):
        fit_probe(tx[:64], ty[:64], vx[:32], vy[:32], make_spec(), ProbeMLPConfig(hidden_dim=8, epochs=3))


def test_mean_combine_learns_a_layer_average_relation(data):
    tx, _, vx, _ = data
    w = torch.zeros(HIDDEN)
    w[:3] = torch.tensor([2.0, -1.5, 1.0])
    target = lambda x: torch.sigmoid(2.0 * x.mean(dim=1) @ w)  # noqa: E731  (what averaging layers can see)
    ty, vy = target(tx), target(vx)
    probe, _ = fit_probe(tx, ty, vx, vy, make_spec(combine="mean"), FAST)
    mae = (probe.predict_proba(vx) - vy).abs().mean().item()
    assert mae < 0.3 * (vy - ty.mean()).abs().mean().item()
    weights = probe.layer_weights()
    assert torch.allclose(weights, torch.full_like(weights, 0.2))


def test_weighted_combine_finds_the_signal_layer(data):
    tx, ty, vx, vy = data
    cfg = ProbeMLPConfig(hidden_dim=64, epochs=30, batch_size=64, lr=3e-3)  # few steps: the layer logits must move
    probe, _ = fit_probe(tx, ty, vx, vy, make_spec(combine="weighted"), cfg)
    mae = (probe.predict_proba(vx) - vy).abs().mean().item()
    assert mae < 0.3 * (vy - ty.mean()).abs().mean().item()
    weights = probe.layer_weights().detach()
    assert weights.sum().item() == pytest.approx(1.0)
    assert int(weights.argmax()) == SIGNAL_ROW
    assert weights[SIGNAL_ROW] > 5 * weights[[0, 1, 2, 4]].max()


def test_mse_loss_and_selected_inputs(data):
    tx, ty, vx, vy = data
    spec = make_spec(layers=[SIGNAL_ROW])
    cfg = ProbeMLPConfig(hidden_dim=32, epochs=15, batch_size=64, loss="mse")
    probe, _ = fit_probe(spec.select(tx), ty, spec.select(vx), vy, spec, cfg)  # pre-selected rows work too
    mae = (probe.predict_proba(vx) - vy).abs().mean().item()
    assert mae < 0.35 * (vy - ty.mean()).abs().mean().item()
    assert torch.equal(probe.predict_proba(vx), probe.predict_proba(spec.select(vx)))


def test_standardizer_uses_training_statistics(concat_probe, data):
    probe, _ = concat_probe
    tx = data[0]
    assert torch.allclose(probe.feature_mean, tx.mean(0), atol=1e-5)
    assert torch.allclose(probe.feature_std, tx.std(0, unbiased=False).clamp_min(1e-3), atol=1e-5)


def test_constant_feature_does_not_explode():
    spec = make_spec(layers=[0])
    probe = SemanticProbe(spec, ProbeMLPConfig(hidden_dim=8))
    x = torch.ones(10, 1, HIDDEN)
    probe.fit_standardizer(x)
    assert torch.all(probe.feature_std == probe.cfg.std_floor)
    assert torch.isfinite(probe(x + 1e-2)).all()


# ---- save / load -----------------------------------------------------------------------------------
def test_save_load_identical_predictions_no_pickle(tmp_path, data):
    tx, ty, vx, vy = data
    probe, _ = fit_probe(tx, ty, vx, vy, make_spec(layers=[1, 3], combine="weighted"),
                         ProbeMLPConfig(hidden_dim=16, epochs=2))
    paths = probe.save(tmp_path, "draft_probe", extra={"note": "unit test"})
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["draft_probe.json", "draft_probe.safetensors"]
    with safe_open(str(tmp_path / "draft_probe.safetensors"), framework="pt") as f:  # plain safetensors
        assert {"feature_mean", "feature_std", "layer_logits"} <= set(f.keys())
    assert not (tmp_path / "draft_probe.safetensors").read_bytes().startswith(b"PK")  # not torch.save's zip
    meta = json.loads(paths[1].read_text())
    assert meta["format_version"] == 1 and meta["feature_spec"]["layers"] == [1, 3]
    loaded = SemanticProbe.load(tmp_path, "draft_probe")
    assert torch.equal(loaded.predict_proba(vx), probe.predict_proba(vx))
    assert torch.equal(loaded.feature_mean, probe.feature_mean)
    assert loaded.extra == {"note": "unit test"} and not loaded.training


def test_load_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="probe.safetensors"):
        SemanticProbe.load(tmp_path, "probe")
    probe = SemanticProbe(make_spec(), ProbeMLPConfig(hidden_dim=8))
    _, json_path = probe.save(tmp_path, "probe")
    meta = json.loads(json_path.read_text())
    json_path.write_text(json.dumps({**meta, "format_version": 99}))
    with pytest.raises(ValueError, match="format_version 99"):
        SemanticProbe.load(tmp_path, "probe")
    meta["probe_config"]["hidden_dim"] = 16  # JSON no longer matches the weights
    json_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="does not match its JSON config"):
        SemanticProbe.load(tmp_path, "probe")


# ---- input checks ----------------------------------------------------------------------------------
def test_bad_inputs_rejected_before_training(data):
    tx, ty, vx, vy = data
    spec, cfg = make_spec(), ProbeMLPConfig(hidden_dim=8, epochs=1)
    with pytest.raises(ValueError, match="empty training set"):
        fit_probe(tx[:0], ty[:0], vx, vy, spec, cfg)
    with pytest.raises(ValueError, match="empty validation set"):
        fit_probe(tx, ty, vx[:0], vy[:0], spec, cfg)
    nan_x = tx.clone()
    nan_x[[3, 7], 2, 0] = float("nan")
    nan_x[9, 0, 1] = float("inf")
    with pytest.raises(ValueError, match="3 of 1000 rows"):
        fit_probe(nan_x, ty, vx, vy, spec, cfg)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        fit_probe(tx, ty * 2, vx, vy, spec, cfg)
    with pytest.raises(ValueError, match="single-class training set"):
        fit_probe(tx, torch.full_like(ty, 0.35), vx, vy, spec, cfg)
    with pytest.raises(ValueError, match="shape"):
        fit_probe(tx[:, :3], ty, vx, vy, spec, cfg)
    with pytest.raises(ValueError, match="length 1000"):
        fit_probe(tx, ty[:10], vx, vy, spec, cfg)


def test_forward_shape_check():
    probe = SemanticProbe(make_spec(layers=[1, 2]), ProbeMLPConfig(hidden_dim=8))
    assert probe(torch.randn(3, 2, HIDDEN)).shape == (3,)
    with pytest.raises(ValueError, match=r"\[B, 2, 16\]"):
        probe(torch.randn(3, 3, HIDDEN))


def _package(module: str) -> str:
    """Top-level package of an import, with specprobe's own namespace removed (specprobe.infer -> infer)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "specprobe" and len(parts) > 1 else parts[0]


def test_probes_package_imports_no_project_or_lm_code():
    """probes/ must stay pure torch/numpy/scipy/sklearn: a static scan of every import statement."""
    import ast
    from pathlib import Path

    import specprobe.probes as probes

    forbidden = {"data_gen", "train", "infer", "transformers", "vllm", "peft", "datasets", "accelerate"}
    for path in Path(probes.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = {_package(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = {_package(node.module or "")}
            else:
                continue
            assert not roots & forbidden, f"{path.name} imports {roots & forbidden}"
