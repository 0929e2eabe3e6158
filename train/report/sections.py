"""The parts of a probe-eval report. Each takes the evaluation context and returns metrics (a JSON-ready
dict) plus the figures to draw (a plot function name and its arrays), so no part touches matplotlib.

A part raises `PartError` when it cannot be evaluated at all; a sub-part that fails (one baseline, one
verifier) is recorded with `ctx.skip` and the part goes on.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from specprobe.infer import checkpoint_format as fmt
from specprobe.probes.acceptance import semantic_accept_prob
from specprobe.probes.metrics import brier
from specprobe.probes.mlp import ProbeMLPConfig as MLPConfig
from specprobe.probes.mlp import fit_probe
from specprobe.probes.splits import group_split
from specprobe.train.config import ProbeConfig
from specprobe.train.pipeline import split_groups
from specprobe.train.probes_train import ROW_SETS, RowSet, check_row_set, engine_spec, load_row_set, torch_threads
from specprobe.train.report import evaluate as ev
from specprobe.train.report.inputs import CheckpointFolder, HeldOut, PartError, check_probe_fits_data, predict

log = logging.getLogger(__name__)

# main probe -> (role, the row sets it is evaluated on; the first is its run-time use)
MAIN_PROBES = {"probe_target": ("target", ["draft_via_target", "target_own"]),
               "probe_draft": ("draft", ["draft_own"]), "probe_acceptance": ("draft", ["draft_accept"])}
# extra probes shown next to a main probe: checkpoint file -> label in the tables
PROBE_COMPARATORS = {"target": {"probe_target_logistic": "logistic", "probe_target_mlp": "mlp",
                                "probe_target_own": "target_own_only", "baseline_last_layer_target": "last_layer"},
                     "draft": {"probe_draft_logistic": "logistic", "probe_draft_mlp": "mlp",
                               "baseline_last_layer_draft": "last_layer"}}
OWN_SET = {"target": "target_own", "draft": "draft_own"}
LABEL_NAMES = {"target_own": "own_prob (target)", "draft_own": "own_prob (draft)",
               "draft_via_target": "prob_under_target", "draft_accept": "prob_under_target (from draft features)"}


@dataclass
class Figure:
    file: str
    title: str
    section: str
    plot: str  # name of a function in train.report.plots
    args: dict[str, Any]


@dataclass
class PartResult:
    metrics: dict[str, Any]
    figures: list[Figure] = field(default_factory=list)


@dataclass
class EvalContext:
    """Everything the parts share: checkpoint, data, held-out questions, settings, cached predictions."""

    ckpt: CheckpointFolder
    ds: Any  # data_gen.store.ProbeDataset
    heldout: HeldOut
    cfg: Any  # infer.config.EvalConfig
    device: str | None = None  # for the embedding model and the judge (None: their default)
    skipped: list[dict[str, str]] = field(default_factory=list)
    judge_base: str | None = None  # loaded by the judge instead of the base judge.json names
    embedding_model: str | None = None  # loaded by the embedding verifier instead of the one its file names
    units: dict[str, str] | None = None  # question -> family the bootstrap resamples whole (None: questions)
    progress: bool = False  # progress bars (with ETA) over the sweeps' fits and the judge's scoring
    _rows: dict[tuple[str, str], RowSet] = field(default_factory=dict)
    predictions: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)

    def bootstrap(self) -> dict[str, Any]:
        """The interval settings every block takes: resamples, level, seed and what is resampled."""
        return {"n_boot": self.cfg.n_boot, "alpha": self.cfg.alpha, "seed": self.cfg.seed, "units": self.units}

    def fits(self, items: Sequence[Any], desc: str) -> Iterable[Any]:
        """`items`, one fit each, under a progress bar with ETA (shown with `progress`; gone when done)."""
        return tqdm(items, desc=desc, unit="fit", leave=False, disable=not self.progress)

    def skip(self, part: str, reason: str) -> None:
        log.info("probe-eval: skipped %s: %s", part, reason)
        self.skipped.append({"part": part, "reason": reason})

    def rows(self, set_name: str, pooling: str = "mean") -> RowSet:
        key = (set_name, pooling)
        if key not in self._rows:
            model = ROW_SETS[set_name].model
            if model not in self.ds.manifest.get("models", []) or self.ds.rows(model).size == 0:
                raise PartError(f"the data folder {self.ds.folder} holds no {model} samples (needed for {set_name})")
            self._rows[key] = load_row_set(self.ds, set_name, pooling)
        return self._rows[key]

    def heldout_rows(self, set_name: str, pooling: str = "mean") -> RowSet:
        rows = self.rows(set_name, pooling)
        held = rows.take(self.heldout.mask(rows.questions))
        if len(held) == 0:
            raise PartError(f"no held-out rows in {set_name} ({len(self.heldout.questions)} held-out questions)")
        check_row_set(held, "held-out")  # a bad label or feature is named by sample and field, as in training
        return held


def guarded(ctx: EvalContext, part: str, fn: Callable[[], Any]) -> Any:
    """Run fn; on a PartError (or a data/value error) record the skip and return None."""
    try:
        return fn()
    except (PartError, ValueError, RuntimeError, OSError, KeyError) as err:
        ctx.skip(part, f"{type(err).__name__}: {err}" if not isinstance(err, PartError) else str(err))
        return None


def _block(ctx: EvalContext, pred: np.ndarray, rows: RowSet) -> dict[str, Any]:
    c = ctx.cfg
    return ev.calibration_block(np.clip(pred, 0.0, 1.0), rows.y.double().numpy(), rows.questions,
                                n_bins=c.n_bins, **ctx.bootstrap(),
                                num_samples=_label_draws(ctx, rows),
                                label_includes_self=ROW_SETS[rows.name].label_includes_self)


def _label_draws(ctx: EvalContext, rows: RowSet) -> int | None:
    n = ctx.ds.manifest.get("num_samples")
    return ROW_SETS[rows.name].label_draws(n) if n else None


def _comparisons(ctx: EvalContext, preds: dict[str, np.ndarray], rows: RowSet) -> dict[str, Any]:
    """The probe against each other predictor on the same rows (paired Brier difference and skill)."""
    y = rows.y.double().numpy()
    probe = np.clip(preds["probe"], 0.0, 1.0)
    return {label: ev.paired_comparison(probe, np.clip(other, 0.0, 1.0), y, rows.questions, **ctx.bootstrap())
            for label, other in preds.items() if label != "probe"}


# ----------------------------------------------------------------------------- probe calibration
def probe_predictions(ctx: EvalContext, name: str, role: str, set_name: str) -> np.ndarray:
    """Held-out predictions of checkpoint probe `name` on `set_name` (cached)."""
    key = (name, set_name)
    if key not in ctx.predictions:
        probe = ctx.ckpt.probe(name)
        cols = check_probe_fits_data(probe, ctx.ds, role, name)
        rows = ctx.heldout_rows(set_name, probe.spec.pooling)
        ctx.predictions[key] = predict(probe, rows.x, cols)
    return ctx.predictions[key]


def baseline_predictions(ctx: EvalContext, role: str, rows: RowSet) -> dict[str, np.ndarray]:
    """The baselines of `rows`' own set from baselines.json: its constant and its calibrated log-prob (logistic
    and isotonic). A checkpoint written before per-set baselines falls back to the role's, and says so."""

    entry = ctx.ckpt.part(ctx.ckpt.set_baselines).get(rows.name)
    if entry is None:
        roles = ctx.ckpt.part(ctx.ckpt.baselines)
        if role not in roles:
            raise PartError(f"{fmt.BASELINES_JSON} has no entry for {rows.name} or the {role} "
                            f"(roles: {sorted(roles)})")
        entry = roles[role]
        ctx.skip(f"baselines/{rows.name}", f"{fmt.BASELINES_JSON} has no per-set baselines (an older checkpoint): "
                                           f"the {role}'s baselines over its training sets stand in")
    out = {"logprob": entry.logprob.predict(rows.logprob), "constant": entry.constant.predict(len(rows))}
    if entry.logprob_isotonic is not None:
        out["logprob_isotonic"] = entry.logprob_isotonic.predict(rows.logprob)
    return out


def probe_set_blocks(ctx: EvalContext, name: str, role: str, set_name: str) -> tuple[dict, dict, list[Figure]]:
    """Calibration of a main probe and its comparators on one held-out row set, the probe's paired
    comparison with each of them, and its reliability figures (equal width and equal mass)."""
    pred = probe_predictions(ctx, name, role, set_name)
    probe = ctx.ckpt.probe(name)
    rows = ctx.heldout_rows(set_name, probe.spec.pooling)
    preds = {"probe": pred}
    comparators = PROBE_COMPARATORS[role] if name in ("probe_target", "probe_draft") else {}  # same labels only
    for file, label in comparators.items():
        if not ctx.ckpt.has_probe(file):
            if label not in ("logistic", "mlp") or not any(ctx.ckpt.has_probe(f"{name}_{k}") for k in ("logistic", "mlp")):
                ctx.skip(f"{name}/{set_name}/{label}", f"the checkpoint has no {file}")
            continue  # (the other kind beside a main probe is one of the two files, never both)
        other = guarded(ctx, f"{name}/{set_name}/{label}", lambda f=file: probe_predictions(ctx, f, role, set_name))
        if other is not None:
            preds[label] = other
    base = guarded(ctx, f"{name}/{set_name}/baselines", lambda: baseline_predictions(ctx, role, rows))
    preds.update(base or {})
    blocks = {label: _block(ctx, values, rows) for label, values in preds.items()}
    figures = [Figure(f"reliability_{name}_{set_name}{suffix}.png",
                      f"Reliability of {name} on held-out {set_name} ({ROW_SETS[set_name].description}), "
                      f"{kind} bins", "calibration", "reliability_diagram",
                      {"pred": pred, "label": rows.y.double().numpy(), "n_bins": ctx.cfg.n_bins, "strategy": strategy,
                       "title": f"{name} on {set_name} (held-out, n={len(rows)})",
                       "ece": ev.estimate(blocks["probe"], f"ece_{strategy}"), "label_name": LABEL_NAMES[set_name]})
               for suffix, strategy, kind in (("", "uniform", "equal-width"), ("_equal_mass", "quantile", "equal-mass"))]
    return blocks, _comparisons(ctx, preds, rows), figures


def probes_part(ctx: EvalContext) -> PartResult:
    """Calibration of the target and draft probes next to their baselines."""
    metrics: dict[str, Any] = {}
    versus: dict[str, Any] = {}
    figures: list[Figure] = []
    for name, (role, sets) in MAIN_PROBES.items():
        if guarded(ctx, name, lambda n=name, r=role: check_probe_fits_data(ctx.ckpt.probe(n), ctx.ds, r, n)) is None:
            continue
        for set_name in sets:
            out = guarded(ctx, f"{name}/{set_name}", lambda n=name, r=role, s=set_name: probe_set_blocks(ctx, n, r, s))
            if out is not None:
                metrics.setdefault(name, {})[set_name] = out[0]
                versus.setdefault(name, {})[set_name] = out[1]
                figures.extend(out[2])
    if not metrics:
        raise PartError("no probe could be evaluated (see the skipped parts)")
    return PartResult({"by_probe": metrics, "versus": versus, "table": comparison_table(metrics)}, figures)


def training_part(ctx: EvalContext) -> PartResult:
    """The training curves probe-train recorded in the checkpoint's metrics (not recomputed): each MLP probe's
    training and validation loss per epoch, with the epoch early stopping kept, and the judge LoRA's loss per step."""
    recorded = ctx.ckpt.metrics
    curves: dict[str, dict[str, Any]] = {}
    summary: dict[str, Any] = {"probes": {}}
    for name, entry in sorted((recorded.get("probes") or {}).items()):
        history = entry.get("history") or {}
        if history.get("train_loss"):
            curves[name] = {"train": history["train_loss"], "val": history.get("val_loss") or [],
                            "best": history.get("best_epoch"), "x": "epoch"}
            summary["probes"][name] = {k: history.get(k) for k in ("epochs_run", "best_epoch", "best_val_loss",
                                                                    "stopped_early")}
    losses = (recorded.get("judge") or {}).get("losses")
    if losses:
        curves["judge LoRA"] = {"train": losses, "val": [], "best": None, "x": "step"}
        summary["judge"] = {"steps": len(losses), "resumed": (recorded.get("judge") or {}).get("resumed")}
    if not curves:
        raise PartError("the checkpoint's metrics hold no training curve (no MLP probe history, no judge losses)")
    figure = Figure("training_curves.png", "Training curves: loss per epoch of each MLP probe (training rows, "
                    "validation questions; the kept epoch marked) and the judge LoRA's loss per step",
                    "training", "training_curves", {"curves": curves})
    return PartResult(summary, [figure])


def comparison_table(metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (probe, row set, predictor) with every metric's point estimate and CI."""
    rows = []
    for name, per_set in metrics.items():
        for set_name, blocks in per_set.items():
            for predictor, block in blocks.items():
                row = {"probe": name, "set": set_name, "predictor": predictor, "n": block["n"],
                       "n_questions": block["n_questions"]}
                row.update({m: block["metrics"][m] for m in ev.CALIBRATION_METRICS})
                rows.append(row)
    return rows


# ----------------------------------------------------------------------------- acceptance ratio
def acceptance_part(ctx: EvalContext) -> PartResult:
    """min(1, p/q) from the probes (and from each baseline pair) against the empirical ratio on draft steps."""
    p = probe_predictions(ctx, "probe_target", "target", "draft_via_target")
    q = probe_predictions(ctx, "probe_draft", "draft", "draft_own")
    via = ctx.heldout_rows("draft_via_target", ctx.ckpt.probe("probe_target").spec.pooling)
    own = ctx.heldout_rows("draft_own", ctx.ckpt.probe("probe_draft").spec.pooling)
    if not np.array_equal(via.sample_ids, own.sample_ids):
        raise PartError("draft rows of the target and draft views are not aligned (sample ids differ)")
    # the empirical ratio reads the labels the probes learn (one scale, see data_gen.labels): q is the draft's
    # leave-one-out own_prob, not |C_k|/N, which counts the step itself and so would bias the ratio down
    put, own_q = via.y.double().numpy(), own.y.double().numpy()
    c = ctx.cfg
    pairs = {"probes": (p, q), **acceptance_baselines(ctx, via, own)}
    blocks = {label: ev.acceptance_block(pb, qb, put, own_q, via.questions, n_bins=c.n_bins, **ctx.bootstrap())
              for label, (pb, qb) in pairs.items()}
    empirical = ev.empirical_ratio(put, own_q)
    predicted = np.asarray(semantic_accept_prob(p, q))
    # in words: do the probes' ratios beat each baseline pair's (squared error, paired bootstrap)?
    blocks["probes"]["versus"] = {
        label: ev.paired_comparison(predicted, np.asarray(semantic_accept_prob(pb, qb)), empirical, via.questions,
                                    **ctx.bootstrap())
        for label, (pb, qb) in pairs.items() if label != "probes"}
    figure = Figure("acceptance_scatter.png", "Acceptance ratio min(1, p/q) on held-out draft steps: probes vs "
                    "empirical labels", "acceptance", "acceptance_scatter",
                    {"predicted": predicted, "empirical": empirical,
                     "title": f"min(1, p/q) on held-out draft steps (n={len(via)})"})
    return PartResult(blocks, [figure])


def acceptance_baselines(ctx: EvalContext, via: RowSet, own: RowSet) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(p, q) pairs of the baselines on the same draft steps: the other kind of probe beside the main pair (the
    classic logistic one beside MLPs, the MLPs beside logistic ones), last-layer probes, log-prob, constant."""
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for kind in ("logistic", "mlp"):
        target, draft = f"probe_target_{kind}", f"probe_draft_{kind}"
        if ctx.ckpt.has_probe(target) and ctx.ckpt.has_probe(draft):
            pair = guarded(ctx, f"acceptance/{kind}", lambda t=target, d=draft: (
                probe_predictions(ctx, t, "target", "draft_via_target"), probe_predictions(ctx, d, "draft", "draft_own")))
            if pair is not None:
                out[kind] = pair
    if ctx.ckpt.has_probe("baseline_last_layer_target") and ctx.ckpt.has_probe("baseline_last_layer_draft"):
        pair = guarded(ctx, "acceptance/last_layer", lambda: (
            probe_predictions(ctx, "baseline_last_layer_target", "target", "draft_via_target"),
            probe_predictions(ctx, "baseline_last_layer_draft", "draft", "draft_own")))
        if pair is not None:
            out["last_layer"] = pair
    bt = guarded(ctx, "acceptance/baselines", lambda: (baseline_predictions(ctx, "target", via),
                                                        baseline_predictions(ctx, "draft", own)))
    if bt is not None:
        for label in ("logprob", "constant"):
            out[label] = (np.clip(bt[0][label], 0, 1), np.clip(bt[1][label], 0, 1))
    return out


# ----------------------------------------------------------------------------- layer sweep
def sweep_sets(ctx: EvalContext, role: str) -> list[str]:
    """The row sets the role's main probe was trained on (its recorded `trained_on`), else its own samples."""
    name = "probe_target" if role == "target" else "probe_draft"
    if ctx.ckpt.has_probe(name):
        trained_on = ctx.ckpt.probe(name).extra.get("trained_on")
        if trained_on and all(s in ROW_SETS for s in trained_on):
            return list(trained_on)
    return [OWN_SET[role]]


@dataclass
class SweepSplit:
    """Row masks of the layer sweep: fit on `train`, early-stop and choose the layer on `select`, report on
    `report`; `how` says which questions those are (and whether choosing and reporting share questions)."""

    train: np.ndarray
    select: np.ndarray
    report: np.ndarray
    how: str

    @property
    def independent(self) -> bool:
        return not (self.select & self.report).any()


def sweep_split(ctx: EvalContext, questions: np.ndarray) -> SweepSplit:
    """Training questions fit; validation questions choose; held-out (test) questions report. Without a
    separate validation split the held-out questions do both, and `how` says so."""
    def mask(qs) -> np.ndarray:
        return np.isin(questions, np.asarray(sorted(qs), dtype=object))

    held = ctx.heldout.mask(questions)
    train, val = mask(ctx.heldout.train_questions), mask(ctx.heldout.val_questions) & ~held
    if train.any() and val.any() and held.any():
        return SweepSplit(train, val, held, "fit on training questions, epoch and layer chosen on validation "
                                            "questions, reported on the held-out (test) questions")
    if train.any() and held.any():
        return SweepSplit(train, held, held, "fit on training questions; chosen AND reported on the same held-out "
                                             "questions (no separate validation split): the best layer is optimistic")
    held_q = sorted(set(questions[held].tolist()))
    groups = split_groups(held_q, ctx.ds.question_families())  # the two halves share no template
    if len(set(groups)) < 2:
        raise PartError("the layer sweep needs training questions or held-out questions of at least two "
                        "families (templates)")
    _, va, _ = group_split(groups, 0.5, 0.0, ctx.cfg.seed)
    half = np.isin(questions, np.asarray([held_q[i] for i in va], dtype=object))
    return SweepSplit(held & ~half, half, half, "no training questions in this data: held-out questions split in "
                                                "half; chosen and reported on the same half (optimistic)")


def sweep_config(ctx: EvalContext, n_train: int) -> MLPConfig:
    """Quick per-layer probes: the checkpoint's loss and lr, eval.sweep_* width and epochs, no dropout, and
    batches small enough for at least ~8 optimiser steps per epoch on tiny data."""
    probe, default = ctx.ckpt.section("probe"), ProbeConfig()  # keys an older checkpoint lacks: today's defaults
    c = ctx.cfg
    batch = min(int(probe.get("batch_size", default.batch_size)), max(16, n_train // 8))
    return MLPConfig(hidden_dim=c.sweep_hidden_dim, dropout=0.0, loss=probe.get("loss", default.loss),
                     lr=float(probe.get("lr", default.lr)), epochs=c.sweep_epochs,
                     patience=max(2, c.sweep_epochs // 3), batch_size=batch, seed=c.seed)


def sweep_role(ctx: EvalContext, role: str) -> dict[str, Any]:
    """One small probe per stored layer of `role`: Brier/MAE against layer depth on the selection
    (validation) questions, which choose the best layer, and on the held-out (test) questions it is reported on."""
    sets = [ctx.rows(s) for s in sweep_sets(ctx, role)]
    x, y = torch.cat([s.x for s in sets]), torch.cat([s.y for s in sets])
    questions = np.concatenate([s.questions for s in sets])
    which = np.concatenate([np.full(len(s), i) for i, s in enumerate(sets)])  # each row's set
    split = sweep_split(ctx, questions)
    tr, va, te = (torch.from_numpy(np.flatnonzero(m)) for m in (split.train, split.select, split.report))
    if float(y[tr].max()) == float(y[tr].min()):
        raise PartError(f"{role}: every training label is equal; nothing to learn per layer")
    engine = ctx.ds.manifest["engines"][role]
    num_layers = int(engine["num_layers"])
    kept = list(ctx.ds.layers(role))
    cfg = sweep_config(ctx, len(tr))
    y_val, y_test = y[va].double().numpy(), y[te].double().numpy()
    entries, test_preds, failed = [], {}, []
    for row in ctx.fits(ev.sweep_rows(kept, ctx.cfg.sweep_max_layers), f"layer sweep ({role})"):
        col = slice(kept.index(row), kept.index(row) + 1)
        spec = engine_spec(engine, [row])
        try:
            probe, history = fit_probe(x[tr][:, col], y[tr], x[va][:, col], y[va], spec, cfg)
        except ValueError as err:  # one layer that diverges (say, huge activations) leaves the others' points
            failed.append({"layer": row, "error": str(err)})
            continue
        entry = ev.sweep_entry(row, num_layers, probe.predict_proba(x[va][:, col]).double().numpy(), y_val,
                               history.epochs_run)
        test_preds[row] = probe.predict_proba(x[te][:, col]).double().numpy()
        entry["test_brier"] = brier(test_preds[row], y_test)
        entries.append(entry)
    if not entries:
        raise PartError(f"{role}: no layer's probe could be fitted; first error (layer {failed[0]['layer']}): "
                        f"{failed[0]['error']}")
    # the constant is each set's own mean training label: over pooled sets, one mean would let a probe that only
    # tells the sets apart look better than the baseline
    y_np, train_mask = y.double().numpy(), split.train
    means = [float(y_np[train_mask & (which == i)].mean()) if (train_mask & (which == i)).any()
             else float(y_np[train_mask].mean()) for i in range(len(sets))]
    constant = np.asarray(means)[which]
    best = ev.best_layer(entries)
    if best is not None:
        best = {**best, "versus_constant": ev.paired_comparison(
            test_preds[best["layer"]], constant[split.report], y_test, questions[split.report], **ctx.bootstrap())}
    return {"sets": [s.name for s in sets], "how": split.how, "independent": split.independent,
            "num_layers": num_layers, "n_train": len(tr), "n_val": len(va), "n_test": len(te),
            "constant_by_set": dict(zip([s.name for s in sets], means)),
            "constant_val_brier": brier(constant[split.select], y_val),
            "constant_test_brier": brier(constant[split.report], y_test),
            "entries": entries, "failed": failed, "best": best}


def layer_sweep_part(ctx: EvalContext) -> PartResult:

    out: dict[str, Any] = {}
    with torch_threads(ctx.cfg.num_threads):
        for role in ("target", "draft"):
            if role in ctx.ds.manifest.get("models", []):
                result = guarded(ctx, f"layer_sweep/{role}", lambda r=role: sweep_role(ctx, r))
                if result is not None:
                    out[role] = result
    if not out:
        raise PartError("no model could be swept (see the skipped parts)")
    c = ctx.cfg
    return PartResult({"settings": {"hidden_dim": c.sweep_hidden_dim, "epochs": c.sweep_epochs,
                                    "max_layers": c.sweep_max_layers}, **out},
                      [Figure("layer_sweep.png", "Per-layer probes: held-out Brier score against layer depth",
                              "layer_sweep", "layer_sweep_plot", {"sweeps": out})])


# ----------------------------------------------------------------------------- UMAP
def umap_coordinates(x: np.ndarray, n_neighbors: int, seed: int) -> np.ndarray:
    """Standardise, PCA to at most 50 dims, then 2-D UMAP (umap-learn on CPU)."""
    import warnings

    from sklearn.decomposition import PCA

    z = (x - x.mean(axis=0)) / np.maximum(x.std(axis=0), 1e-6)
    dims = min(50, z.shape[0] - 1, z.shape[1])
    z = PCA(n_components=dims, random_state=seed).fit_transform(z)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "n_jobs overridden by random_state" and numba chatter
        import umap

        reducer = umap.UMAP(n_neighbors=ev.umap_neighbors(len(z), n_neighbors), min_dist=0.1, n_components=2,
                            random_state=seed, init="spectral" if len(z) > n_neighbors + 2 else "random")
        return reducer.fit_transform(z)


def umap_layer(ctx: EvalContext, role: str) -> int:
    kept = list(ctx.ds.layers(role))
    option = str(ctx.cfg.umap_layer).strip().lower()
    if option == "last":
        return kept[-1]
    row = int(option)
    if row not in kept:
        raise PartError(f"eval.umap_layer {row} is not a stored {role} row (stored: {kept})")
    return row


def umap_role(ctx: EvalContext, role: str) -> dict[str, Any]:
    rows = ctx.rows(OWN_SET[role])
    idx = ev.subsample(len(rows), ctx.cfg.umap_max_points, ctx.cfg.seed)
    row = umap_layer(ctx, role)
    x = rows.x[torch.from_numpy(idx), list(ctx.ds.layers(role)).index(row)].double().numpy()
    coords = umap_coordinates(x, ctx.cfg.umap_neighbors, ctx.cfg.seed)
    labels = rows.y.double().numpy()[idx]
    return {"layer": row, "n": len(idx), "coords": coords, "bins": ev.probability_bins(labels), "labels": labels}


def umap_part(ctx: EvalContext) -> PartResult:
    panels = {}
    for role in ("target", "draft"):
        if role in ctx.ds.manifest.get("models", []):
            result = guarded(ctx, f"umap/{role}", lambda r=role: umap_role(ctx, r))
            if result is not None:
                panels[role] = result
    if not panels:
        raise PartError("no hidden states to show (see the skipped parts)")
    metrics = {role: {"layer": p["layer"], "n": p["n"], "bin_counts": np.bincount(p["bins"], minlength=10).tolist()}
               for role, p in panels.items()}
    return PartResult(metrics, [Figure("umap.png", "UMAP of pooled hidden states coloured by semantic-probability "
                                       "bin (all questions)", "umap", "umap_plot", {"panels": panels})])
