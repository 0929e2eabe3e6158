"""The logistic-regression probe: its fit (against scikit-learn), its save/load beside the MLP, selection on
validation questions only, and the regime the offline experiment sits in (few questions, wide features)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specprobe.probes.base import load_probe
from specprobe.probes.features import FeatureSpec
from specprobe.probes.io import FileFormatError, write_json
from specprobe.probes.logistic import Candidate, LogisticProbe, fit_logistic_path, newton_logistic, select_logistic
from specprobe.probes.metrics import brier
from specprobe.probes.mlp import ProbeMLPConfig, SemanticProbe


def spec_of(hidden: int, layers=(1,), num_layers: int = 4, pooling: str = "mean") -> FeatureSpec:
    return FeatureSpec(model_id="toy/model", num_layers=num_layers, hidden_size=hidden, layers=list(layers),
                       pooling=pooling)


def soft_rows(n: int, d: int, seed: int, strength: float = 2.0) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d))
    w = rng.normal(size=d) / np.sqrt(d)
    pi = 1 / (1 + np.exp(-(strength * x @ w - 1.0)))
    y = rng.binomial(6, pi) / 6
    return torch.from_numpy(x).float().unsqueeze(1), torch.from_numpy(y).float(), pi


def test_newton_matches_scikit_learn_on_rows_entered_twice():
    """Soft-label BCE + l2/2 ||w||^2 is scikit-learn's weighted two-class fit with C = 1 / (l2 n)."""
    from sklearn.linear_model import LogisticRegression

    x, y, _ = soft_rows(300, 6, seed=1)
    z = x.squeeze(1).double()
    w, _ = newton_logistic(z, y.double(), l2=0.05)
    n = len(y)
    design = np.concatenate([z.numpy(), z.numpy()])
    target = np.r_[np.ones(n), np.zeros(n)]
    weight = np.r_[y.numpy(), 1 - y.numpy()]
    ref = LogisticRegression(C=1 / (0.05 * n), tol=1e-10, max_iter=10_000).fit(design, target, sample_weight=weight)
    assert np.allclose(w[:-1].numpy(), ref.coef_[0], atol=1e-4)
    assert np.isclose(float(w[-1]), float(ref.intercept_[0]), atol=1e-4)


def test_a_step_that_raises_the_loss_is_never_taken(monkeypatch):
    """When no halving of the Newton step lowers the loss, the solver keeps its weights (a step that only
    climbs stands for rounding at the optimum); it took the last, worse trial."""
    x, y, _ = soft_rows(200, 4, seed=2)
    z, start = x.squeeze(1).double(), torch.full((5,), 0.3, dtype=torch.float64)
    solve = torch.cholesky_solve
    monkeypatch.setattr(torch, "cholesky_solve", lambda *a: -solve(*a))  # every direction climbs
    w, iterations = newton_logistic(z, y.double(), l2=0.05, init=start)
    assert iterations == 1 and torch.equal(w, start)


def test_path_is_ordered_like_the_grid_and_stronger_penalties_shrink():
    x, y, _ = soft_rows(400, 10, seed=2)
    l2s = [0.01, 1.0, 0.1]
    path = fit_logistic_path(x, y, spec_of(10), l2s)
    assert [p.l2 for p in path] == l2s
    norms = {p.l2: float(p.linear.weight.detach().norm()) for p in path}
    assert norms[1.0] < norms[0.1] < norms[0.01]


def test_save_and_load_either_kind_by_its_format_tag(tmp_path):
    x, y, _ = soft_rows(200, 8, seed=3)
    logistic = fit_logistic_path(x, y, spec_of(8, pooling="last"), [0.1])[0]
    logistic.save(tmp_path, "probe_target", extra={"note": "lr"})
    mlp = SemanticProbe(spec_of(8), ProbeMLPConfig(hidden_dim=4))
    mlp.save(tmp_path, "probe_draft")
    back = load_probe(tmp_path, "probe_target")
    assert isinstance(back, LogisticProbe) and back.l2 == 0.1 and back.spec.pooling == "last"
    assert torch.equal(back.predict_proba(x), logistic.predict_proba(x)) and back.extra == {"note": "lr"}
    assert isinstance(load_probe(tmp_path, "probe_draft"), SemanticProbe)
    write_json(tmp_path / "other.json", {"format": "specprobe.something_else"})
    with pytest.raises(FileFormatError, match="not a probe"):
        load_probe(tmp_path, "other")
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load_probe(tmp_path, "missing")


def test_selection_uses_the_validation_rows():
    """Two readings with the same training rows (a tie on training loss); only the second keeps its signal on
    the validation rows, so a choice made on validation picks it (a choice on training rows would keep the first)."""
    x, y, _ = soft_rows(300, 6, seed=4, strength=3.0)
    vx, vy, _ = soft_rows(300, 6, seed=4, strength=3.0)
    noise = torch.from_numpy(np.random.default_rng(9).normal(size=tuple(vx.shape))).float()
    options = {"noise_on_val": Candidate(spec_of(6, layers=(1,)), x, noise), "signal": Candidate(spec_of(6, layers=(2,)), x, vx)}
    done: list[int] = []  # a progress bar's updates: one per reading, after its L2 path
    chosen = select_logistic(options, y, vy, l2s=[0.1, 1.0], on_candidate=lambda: done.append(len(done)))
    assert chosen.key == "signal" and chosen.probe.spec.layers == [2]
    assert len(chosen.table) == 4 and chosen.best["candidate"] == "signal"
    assert done == [0, 1]


def planted(n_questions: int, rows_per_question: int, seed: int, level: float, draws: int, direction: np.ndarray):
    """Rows of one label set: 4 stored layers x 576 dims (2304 values), the signal in layer 2 only, a question
    effect shared by a question's rows, labels = share of `draws` samples."""
    rng = np.random.default_rng(seed)
    n = n_questions * rows_per_question
    questions = np.repeat(np.arange(n_questions), rows_per_question)
    x = rng.normal(size=(n, 4, 576))
    x += rng.normal(size=(n_questions, 1, 576))[questions] * 0.5
    score = x[:, 2] @ direction
    pi = 1 / (1 + np.exp(-(level + 1.6 * score)))
    y = rng.binomial(draws, pi) / draws
    return torch.from_numpy(x).float(), torch.from_numpy(y).float(), questions


@pytest.mark.parametrize("seed", [0, 1])
def test_logistic_probe_beats_the_per_set_constant_in_the_hard_regime(seed):
    """~200 rows in 16 questions, 2304 stored values per row, 6-sample labels, two label sets at different levels
    (an own-step set and a draft-under-target set): the probe, its layer and penalty chosen on 4 validation
    questions, must beat each set's own constant on fresh questions. The regime the MLP lost in."""
    rng = np.random.default_rng(100 + seed)
    direction = rng.normal(size=576)
    direction /= np.linalg.norm(direction)
    for set_seed, level, draws in ((1, -0.8, 5), (2, -2.5, 6)):  # own_prob: N - 1 draws; prob_under_target: N
        x, y, q = planted(16, 12, 1000 * seed + set_seed, level, draws, direction)
        tx, ty, _ = planted(60, 12, 1000 * seed + set_seed + 500, level, draws, direction)
        train, val = torch.from_numpy(q < 12), torch.from_numpy(q >= 12)
        options = {row: Candidate(spec_of(576, layers=(row,)), x[train][:, row:row + 1], x[val][:, row:row + 1])
                   for row in range(4)}
        chosen = select_logistic(options, y[train], y[val], l2s=(0.1, 0.3, 1.0, 3.0, 10.0))
        pred = chosen.probe.predict_proba(tx[:, chosen.key:chosen.key + 1]).double().numpy()
        constant = np.full(len(ty), float(y.double().mean()))
        truth = ty.double().numpy()
        assert chosen.key == 2
        assert brier(pred, truth) < brier(constant, truth), (level, brier(pred, truth), brier(constant, truth))
