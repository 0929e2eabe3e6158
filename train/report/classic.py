"""Report parts built on the classic probe (`probes.logistic`), each fitted per row set so no set is scored
against another set's level:

- `logistic_sweep_part`: every stored layer x pooling of every row set, the L2 strength chosen on validation
  questions, the test Brier beside the set's own constant with paired intervals (whole questions or families).
- `positive_control_part`: the same pipeline asked for quantities known to be in the hidden states (the step's
  geometric-mean token probability exp(mean log-prob), and its length as a share of the token cap). If it cannot
  predict those on test questions, the pipeline is broken, whatever it says about semantic probabilities.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from specprobe.probes.features import FeatureSpec
from specprobe.probes.io import clean_json
from specprobe.probes.logistic import Candidate, select_logistic
from specprobe.probes.metrics import brier, log_loss
from specprobe.train.probes_train import ROW_SETS, RowSet, engine_spec, torch_threads
from specprobe.train.report import evaluate as ev
from specprobe.train.report.inputs import PartError
from specprobe.train.report.sections import EvalContext, Figure, PartResult, guarded, sweep_split


def _spec(ctx: EvalContext, role: str, row: int, pooling: str) -> FeatureSpec:
    return engine_spec(ctx.ds.manifest["engines"][role], [row], pooling=pooling)


def _sets(ctx: EvalContext) -> list[str]:
    models = ctx.ds.manifest.get("models", [])
    return [name for name, d in ROW_SETS.items() if d.model in models and d.view in models]


def _masks(ctx: EvalContext, rows: RowSet) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, str, bool]:
    split = sweep_split(ctx, rows.questions)
    return (torch.from_numpy(split.train), torch.from_numpy(split.select), split.report, split.how,
            split.independent)


def _compare(ctx: EvalContext, pred: np.ndarray, constant: float, y: np.ndarray, groups: np.ndarray) -> dict[str, Any]:
    return ev.paired_comparison(pred, np.full(len(y), constant), y, groups, **ctx.bootstrap())


def _set_inputs(ctx: EvalContext, set_name: str):
    """(role, stored rows, the set's rows by pooling, train / validation / report masks, how, independent)."""
    role = ROW_SETS[set_name].view
    by_pooling = {p: ctx.rows(set_name, p) for p in ctx.ds.poolings}  # "last" only where the data stores it
    return (role, list(ctx.ds.layers(role)), by_pooling) + _masks(ctx, by_pooling["mean"])


def sweep_set(ctx: EvalContext, set_name: str) -> dict[str, Any]:
    """One logistic probe per (stored row, pooling) on one row set."""
    role, kept, by_pooling, tr, va, te, how, independent = _set_inputs(ctx, set_name)
    base = by_pooling["mean"]
    y = base.y
    if float(y[tr].max()) == float(y[tr].min()):
        raise PartError(f"{set_name}: every training label is equal; nothing to learn")
    y_val, y_test, g_test = y[va].double().numpy(), y[te].double().numpy(), base.questions[te]
    constant = float(y[tr].double().mean())
    entries = []
    readings = [(pooling, col, row) for pooling in by_pooling for col, row in enumerate(kept)]
    for pooling, col, row in ctx.fits(readings, f"logistic sweep ({set_name})"):
        x = by_pooling[pooling].x[:, col:col + 1]
        only = {row: Candidate(_spec(ctx, role, row, pooling), x[tr], x[va])}
        probe = select_logistic(only, y[tr], y[va], ctx.cfg.sweep_l2).probe  # its penalty, on validation
        val_pred = probe.predict_proba(x[va]).double().numpy()
        test_pred = probe.predict_proba(x[torch.from_numpy(te)]).double().numpy()
        entries.append(clean_json({
            "layer": row, "pooling": pooling, "depth": row / int(ctx.ds.manifest["engines"][role]["num_layers"]),
            "l2": probe.l2, "val_brier": brier(val_pred, y_val), "val_log_loss": log_loss(val_pred, y_val),
            "test_brier": brier(test_pred, y_test), "versus_constant": _compare(ctx, test_pred, constant, y_test, g_test)}))
    best = min(entries, key=lambda e: (e["val_log_loss"], e["layer"]))
    return {"set": set_name, "label": ROW_SETS[set_name].label, "role": role, "how": how, "independent": independent,
            "n_train": int(tr.sum()), "n_val": int(va.sum()), "n_test": int(te.sum()),
            "n_test_questions": int(np.unique(g_test).size), "constant": constant,
            "constant_val_brier": brier(np.full(len(y_val), constant), y_val),
            "constant_test_brier": brier(np.full(len(y_test), constant), y_test),
            "entries": entries, "best": best}


def logistic_sweep_part(ctx: EvalContext) -> PartResult:
    out = {}
    with torch_threads(ctx.cfg.num_threads):
        for set_name in _sets(ctx):
            result = guarded(ctx, f"logistic_sweep/{set_name}", lambda s=set_name: sweep_set(ctx, s))
            if result is not None:
                out[set_name] = result
    if not out:
        raise PartError("no row set could be swept (see the skipped parts)")
    return PartResult({"settings": {"l2": list(ctx.cfg.sweep_l2), "poolings": list(ctx.ds.poolings),
                                    "confidence": 1 - ctx.cfg.alpha}, "sets": out},
                      [Figure("logistic_sweep.png", "Logistic probe per layer and pooling: test Brier minus the set's "
                              "constant, with paired intervals", "logistic_sweep", "logistic_sweep_plot",
                              {"sweeps": out, "confidence": 1 - ctx.cfg.alpha})])


# ----------------------------------------------------------------------------- positive control
def control_targets(ctx: EvalContext, rows: RowSet) -> dict[str, np.ndarray]:
    """Quantities of each step the hidden states must carry, mapped into [0, 1]."""
    ids = rows.sample_ids
    index = {s: i for i, s in enumerate(ctx.ds.column("sample_id"))}
    where = np.array([index[s] for s in ids])
    mean_lp = np.asarray(ctx.ds.column("mean_logprob"), dtype=np.float64)[where]
    tokens = np.asarray(ctx.ds.column("num_tokens"), dtype=np.float64)[where]
    cap = ((ctx.ds.manifest.get("config") or {}).get("sampling") or {}).get("max_step_tokens") or tokens.max()
    return {"token_prob": np.exp(np.minimum(mean_lp, 0.0)), "length_share": np.clip(tokens / float(cap), 0.0, 1.0)}


def control_check(skill: dict[str, Any]) -> str:
    """passed: the Brier skill's whole interval is above 0; FAILED: it is not; too small to tell: no interval."""
    if skill.get("low") is None:
        return "too small to tell"
    return "passed" if skill["low"] > 0 else "FAILED"


def control_set(ctx: EvalContext, set_name: str) -> dict[str, Any]:
    role, kept, rows_by, tr, va, te, how, independent = _set_inputs(ctx, set_name)
    base = rows_by["mean"]
    te_t = torch.from_numpy(te)
    stride = max(1, len(kept) // 8)  # a handful of depths is enough to show the signal is there
    out = {"set": set_name, "how": how, "independent": independent, "n_test": int(te.sum()), "targets": {}}
    for target, values in control_targets(ctx, base).items():
        y = torch.from_numpy(values).float()
        if float(y[tr].max()) == float(y[tr].min()):
            ctx.skip(f"positive_control/{set_name}/{target}", "the quantity is constant on the training rows")
            continue
        options = {(p, row): Candidate(_spec(ctx, role, row, p), rows_by[p].x[tr][:, c:c + 1], rows_by[p].x[va][:, c:c + 1])
                   for p in ctx.ds.poolings for c, row in list(enumerate(kept))[::stride]}
        chosen = select_logistic(options, y[tr], y[va], ctx.cfg.sweep_l2)
        pooling, row = chosen.key
        col = kept.index(row)
        pred = chosen.probe.predict_proba(rows_by[pooling].x[te_t][:, col:col + 1]).double().numpy()
        y_test = values[te]
        versus = _compare(ctx, pred, float(values[tr.numpy()].mean()), y_test, base.questions[te])
        out["targets"][target] = {"layer": row, "pooling": pooling, "l2": chosen.probe.l2,
                                  "test_brier": brier(pred, y_test), "versus_constant": versus,
                                  "check": control_check(versus["brier_skill"])}
    return clean_json(out)


def positive_control_part(ctx: EvalContext) -> PartResult:
    out = {}
    with torch_threads(ctx.cfg.num_threads):
        for set_name in ("target_own", "draft_own"):
            if ROW_SETS[set_name].model in ctx.ds.manifest.get("models", []):
                result = guarded(ctx, f"positive_control/{set_name}", lambda s=set_name: control_set(ctx, s))
                if result is not None:
                    out[set_name] = result
    if not out:
        raise PartError("no row set for the positive control (see the skipped parts)")
    checks = [t["check"] for s in out.values() for t in s["targets"].values()]
    if not checks:
        verdict = ("not tested: every known quantity was constant on the training rows (see the skipped parts), "
                   "so the pipeline's recovery of them could not be checked")
    elif "FAILED" in checks:
        verdict = ("FAILED: the probe pipeline cannot recover a quantity known to be in the hidden states; "
                   "its verdict on semantic probabilities cannot be trusted")
    elif all(c == "passed" for c in checks):
        verdict = "passed: the probe pipeline recovers known quantities from the hidden states"
    else:
        verdict = "too small to tell: the held-out set is too small for intervals"
    return PartResult({"sets": out, "verdict": verdict, "confidence": 1 - ctx.cfg.alpha})
