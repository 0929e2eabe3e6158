"""evaluate_checkpoint: checkpoint (+ data) -> report folder (metrics.json, report.md, PNG figures).

    from specprobe.train.report import evaluate_checkpoint
    report = evaluate_checkpoint("runs/tiny/checkpoint")            # held-out questions of its own data
    report.metrics["parts"]["probes"]["table"]                       # every probe next to its baselines
    report.skipped                                                    # parts that could not be evaluated

Parts are evaluated one by one; a part that cannot be (no such probe, data from another model, no
pairs) is recorded in metrics.json / report.md under "skipped" with the reason, and the rest go on.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specprobe.infer.checkpoint_format import CHECKPOINT_JSON
from specprobe.inputs.config import build, parse_override, to_dict
from specprobe.inputs.versions import utc_now
from specprobe.probes.io import clean_json, read_json, write_text
from specprobe.train.config import EvalConfig, WandbConfig
from specprobe.train.report import evaluate as ev
from specprobe.train.report import plots, render
from specprobe.train.report.classic import logistic_sweep_part, positive_control_part
from specprobe.train.report.inputs import (
    CheckpointFolder,
    HeldOut,
    heldout_questions,
    made_alike,
    open_checkpoint,
    open_data,
    step_summary,
)
from specprobe.train.report.sections import (
    EvalContext,
    PartResult,
    acceptance_part,
    guarded,
    layer_sweep_part,
    probes_part,
    training_part,
    umap_part,
)
from specprobe.train.report.verifiers import verifiers_part
from specprobe.train.tracking import Tracker

REPORT_FORMAT = "specprobe-eval-report"
REPORT_VERSION = 1
REPORT_METRICS = "metrics.json"  # a report folder's numbers (a checkpoint's own: checkpoint_format.METRICS_JSON)
PARTS: dict[str, Callable[[EvalContext], PartResult]] = {
    "probes": probes_part, "acceptance": acceptance_part, "layer_sweep": layer_sweep_part, "umap": umap_part,
    "logistic_sweep": logistic_sweep_part, "positive_control": positive_control_part, "verifiers": verifiers_part,
    "training": training_part,
}
CHECKPOINT_ONLY = ("training",)  # parts that read only the checkpoint: drawn even where the data folder is missing


@dataclass
class Report:
    """What evaluate_checkpoint wrote."""

    folder: Path
    metrics: dict[str, Any]
    figures: list[Path] = field(default_factory=list)

    @property
    def skipped(self) -> list[dict[str, str]]:
        return self.metrics.get("skipped", [])

    @property
    def markdown(self) -> Path:
        return self.folder / "report.md"


# ----------------------------------------------------------------------------- settings
def eval_settings(ckpt: CheckpointFolder, eval_cfg: Any = None, overrides: Sequence[str] = ()):
    """The EvalConfig: `eval_cfg` if given, else the checkpoint's own `eval` section; then `overrides`
    (``eval.n_boot=200`` or ``n_boot=200``)."""

    if eval_cfg is None:
        known = {f.name for f in dataclasses.fields(EvalConfig)}
        base = {k: v for k, v in ckpt.section("eval").items() if k in known}
    elif isinstance(eval_cfg, EvalConfig):
        base = to_dict(eval_cfg)
    else:
        base = dict(eval_cfg)

    for text in overrides:
        keys, value = parse_override(text)
        keys = keys[1:] if keys[0] == "eval" else keys
        if len(keys) != 1:
            raise ValueError(f"override {text!r}: probe-eval takes eval.<key>=<value> overrides only")
        base[keys[0]] = value
    return build(EvalConfig, base, "eval settings", prefix="eval.")


def default_out(checkpoint: Path) -> Path:
    """<output_dir>/report for <output_dir>/checkpoint, else <checkpoint>-report next to it."""
    checkpoint = Path(checkpoint)
    if checkpoint.name == "checkpoint":
        return checkpoint.parent / "report"
    return checkpoint.parent / f"{checkpoint.name}-report"


# ----------------------------------------------------------------------------- evaluation
def _context(ckpt: CheckpointFolder, data, cfg, device, skipped: list, judge_base: str | None = None,
             embedding_model: str | None = None, progress: bool = False) -> tuple[EvalContext | None, dict]:
    """Open the data and pick the held-out questions; None (and a skip) when that is impossible."""
    holder = EvalContext(ckpt, None, HeldOut([], [], "none"), cfg, device, skipped)
    opened = guarded(holder, "data", lambda: open_data(ckpt, data))
    if opened is None:
        return None, {}
    ds, same = opened
    info = {"folder": str(ds.folder), "fingerprint": ds.manifest.get("fingerprint"), "is_training_data": same,
            "engines": ds.manifest.get("engines"),
            "models": ds.manifest.get("models"), "steps": guarded(holder, "data/steps", lambda: step_summary(ds))}
    held = guarded(holder, "heldout", lambda: heldout_questions(ckpt, ds, same, cfg.split))
    if held is None:
        return None, info
    units = _families(ds) if cfg.resample == "family" else None
    return EvalContext(ckpt, ds, held, cfg, device, skipped, judge_base=judge_base,
                       embedding_model=embedding_model, units=units, progress=progress), info


def _run_parts(ctx: EvalContext, cfg, print_fn, only: Sequence[str] | None = None,
               ) -> tuple[dict[str, Any], list, dict[str, float]]:
    enabled = {"layer_sweep": cfg.layer_sweep, "umap": cfg.umap, "verifiers": bool(cfg.verifiers),
               "logistic_sweep": cfg.logistic_sweep, "positive_control": cfg.logistic_sweep}
    results, figures, seconds = {}, [], {}
    for name, fn in PARTS.items():
        if not enabled.get(name, True) or (only is not None and name not in only):
            continue
        start = time.perf_counter()
        print_fn(f"probe-eval: {name} ...")
        result = guarded(ctx, name, lambda f=fn: f(ctx))
        seconds[name] = round(time.perf_counter() - start, 2)
        if result is not None:
            results[name] = result.metrics
            figures.extend(result.figures)
    return results, figures, seconds


def _draw(figures: list, out: Path, skipped: list) -> list[dict[str, Any]]:
    drawn = []
    for fig in figures:
        try:
            plots.draw(fig.plot, out / fig.file, fig.args)
        except (ValueError, RuntimeError, KeyError, TypeError) as err:
            skipped.append({"part": f"figure/{fig.file}", "reason": f"{type(err).__name__}: {err}"})
            continue
        drawn.append({"file": fig.file, "title": fig.title, "section": fig.section})
    return drawn


def evaluate_checkpoint(checkpoint: str | os.PathLike, data: str | os.PathLike | None = None,
                        out: str | os.PathLike | None = None, *, eval_cfg: Any = None, overrides: Sequence[str] = (),
                        wandb: bool = False, device: str | None = None, judge_base: str | None = None,
                        embedding_model: str | None = None, progress: bool = False,
                        print_fn: Callable[[str], None] = print) -> Report:
    """Evaluate a probe-train checkpoint and write the report folder; returns the Report.

    data: a data folder (default: the checkpoint's training data, evaluated on its held-out questions);
    out: the report folder (default: see `default_out`); eval_cfg: an EvalConfig or dict (default: the
    checkpoint's `eval` section); overrides: ``eval.key=value`` strings; wandb: also log to Weights &
    Biases (offline unless the checkpoint's wandb section says online), files under <out>/wandb;
    judge_base / embedding_model: the model the judge (its base) / the embedding verifier loads instead of the one
    its file names (as runtime.checkpoint_judge_base / checkpoint_embedding_model in probe-bench); progress:
    progress bars with ETA over the layer and logistic sweeps' fits and the judge LoRA's scoring.
    """
    start = time.perf_counter()
    ckpt = open_checkpoint(checkpoint)
    cfg = eval_settings(ckpt, eval_cfg, overrides)
    out = Path(out) if out is not None else default_out(ckpt.path)
    out.mkdir(parents=True, exist_ok=True)
    skipped: list[dict[str, str]] = []
    ctx, data_info = _context(ckpt, data, cfg, device, skipped, judge_base, embedding_model, progress)
    if ctx is not None:
        results, figures, seconds = _run_parts(ctx, cfg, print_fn)
    else:  # no data to evaluate on: what the checkpoint alone holds is still reported
        alone = EvalContext(ckpt, None, HeldOut([], [], "none"), cfg, device, skipped)
        results, figures, seconds = _run_parts(alone, cfg, print_fn, only=CHECKPOINT_ONLY)
    metrics = {
        "format": REPORT_FORMAT, "format_version": REPORT_VERSION,
        "created": utc_now(),
        "checkpoint": {"path": str(ckpt.path), "name": ckpt.name, "components": ckpt.meta.get("components")},
        "data": data_info, "heldout": _heldout_record(ctx),
        "settings": _settings_used(cfg, ctx), "parts": results, "skipped": skipped,
    }
    metrics["figures"] = _draw(figures, out, skipped)
    metrics["seconds"] = {**seconds, "total": round(time.perf_counter() - start, 2)}
    report = write_report(out, metrics)
    if wandb:
        log_to_wandb(report, ckpt)
    print_fn(f"probe-eval: report in {out} ({len(report.figures)} figures, {len(skipped)} skipped)")
    return report


def _families(ds) -> dict[str, str] | None:
    """Each question's family, or None when every question is its own (the draws are then the questions')."""
    families = ds.question_families()
    return families if any(f != q for q, f in families.items()) else None


def _settings_used(cfg, ctx: EvalContext | None) -> dict[str, Any]:
    """The eval settings, `resample` as it was done: whole questions where the data records no families."""
    settings = dataclasses.asdict(cfg)
    if ctx is not None and ctx.units is None:
        settings["resample"] = "question"
    return settings


def _heldout_record(ctx: EvalContext | None) -> dict[str, Any] | None:
    """The held-out questions, and how many families (templates) they span when those are resampled whole."""
    if ctx is None:
        return None
    record = ctx.heldout.to_dict()
    if ctx.units is not None:
        record["n_families"] = len({ctx.units.get(q, q) for q in ctx.heldout.questions})
    elif ctx.cfg.resample == "family":
        record["resample_note"] = "the data records no question families (templates), so each question is its own"
    return record


def write_report(out: Path, metrics: dict[str, Any]) -> Report:
    metrics = clean_json(metrics)  # (atomic writes: a report cut short is not read back as one by --compare)
    write_text(out / REPORT_METRICS, json.dumps(metrics, indent=2, allow_nan=False) + "\n")
    write_text(out / "report.md", render.render_report(metrics))
    return Report(out, metrics, [out / f["file"] for f in metrics["figures"]])


# ----------------------------------------------------------------------------- wandb
BOOKKEEPING = {"alpha", "n_boot", "n_valid", "reliability_uniform", "reliability_quantile", "roc", "pr", "edges"}


def without_bookkeeping(tree: Any) -> Any:
    """The metrics without CI settings and curve points (what a run summary should hold)."""
    if isinstance(tree, dict):
        return {k: without_bookkeeping(v) for k, v in tree.items() if k not in BOOKKEEPING}
    return tree


def log_to_wandb(report: Report, ckpt: CheckpointFolder) -> None:
    """Metrics into the run summary, figures as images; files under <report>/wandb (offline by default)."""

    known = {f.name for f in dataclasses.fields(WandbConfig)}
    section = {k: v for k, v in ckpt.section("wandb").items() if k in known}
    section.update(enabled=True, dir=str(report.folder / "wandb"),
                   run_name=f"{section.get('run_name') or ckpt.name}-eval")
    section["mode"] = os.environ.get("WANDB_MODE", section.get("mode", "offline"))
    if section["mode"] not in ("offline", "online"):
        section["mode"] = "offline"
    cfg = build(WandbConfig, section, "wandb settings", prefix="wandb.")
    import wandb

    with Tracker(cfg, run_name=cfg.run_name, output_dir=report.folder, config=report.metrics["settings"],
                 print_fn=lambda _: None) as tracker:
        tracker.final({"eval": without_bookkeeping(report.metrics["parts"]), "skipped_parts": len(report.skipped)})
        tracker.run.log({f"figures/{p.stem}": wandb.Image(str(p)) for p in report.figures})
        report.metrics["wandb"] = {"dir": tracker.wandb_dir, "mode": cfg.mode}
    write_report(report.folder, report.metrics)


# ----------------------------------------------------------------------------- comparison
def headline(metrics: dict[str, Any], intervals: bool = False) -> dict[str, Any]:
    """The metrics two reports are compared on, as flat 'part/.../metric' -> point estimate; intervals=True:
    -> (low, high) of its bootstrap interval instead, None where the report has none (withheld, or a figure
    without one such as the sweep's chosen layer)."""
    parts = metrics.get("parts", {})
    out: dict[str, Any] = {}
    read = ev.interval if intervals else ev.estimate
    for name, per_set in (parts.get("probes") or {}).get("by_probe", {}).items():
        for set_name, blocks in per_set.items():
            for metric in ev.CALIBRATION_METRICS:
                out[f"{name}/{set_name}/{metric}"] = read(blocks["probe"], metric)
    for metric in ("mean_predicted", "mean_empirical", "mae", "rmse", "spearman", "ece_uniform"):
        if "probes" in (parts.get("acceptance") or {}):
            out[f"acceptance/{metric}"] = read(parts["acceptance"]["probes"], metric)
    for role, sweep in (parts.get("layer_sweep") or {}).items():
        if role != "settings" and sweep.get("best"):
            out[f"layer_sweep/{role}/best_layer"] = None if intervals else sweep["best"]["layer"]
            out[f"layer_sweep/{role}/val_brier"] = None if intervals else sweep["best"]["val_brier"]
    for name, block in (parts.get("verifiers") or {}).get("by_verifier", {}).items():
        ranks = () if block.get("ranking_not_evaluable") else ("auroc", "auprc")  # too few of a class: not quoted
        for metric in (*ranks, "acceptance_rate", "precision"):
            out[f"verifiers/{name}/{metric}"] = read(block, metric)
    return out


def read_report(path: Path) -> dict[str, Any] | None:
    """The metrics of report folder `path`, or None when it is not one (a checkpoint, then: opened and checked
    here, so that --compare fails on either side before the other is evaluated). A damaged metrics.json is an
    error naming it."""
    metrics_file = path / REPORT_METRICS
    if metrics_file.is_file() and not (path / CHECKPOINT_JSON).is_file():  # (a checkpoint has a metrics.json too)
        metrics = read_json(metrics_file, "run probe-eval on the checkpoint again, or compare the checkpoint itself")
        if isinstance(metrics, dict) and metrics.get("format") == REPORT_FORMAT:
            return metrics
    open_checkpoint(path)
    return None


def load_or_evaluate(path: str | os.PathLike, data, out: Path, **kw) -> tuple[str, dict[str, Any]]:
    """(name, metrics) of a report folder, or of a checkpoint evaluated into `out` (on `data`: an error when that
    folder cannot be read, the report in `out` kept; a report folder is read as it is, `data` unused)."""
    path = Path(path)
    metrics = read_report(path)
    if metrics is not None:
        return metrics["checkpoint"]["name"], metrics
    report = evaluate_checkpoint(path, data, out, **kw)
    _check_data_read(report.metrics, data, out)
    return report.metrics["checkpoint"]["name"], report.metrics


def compare_checkpoints(a: str | os.PathLike, b: str | os.PathLike, data: str | os.PathLike | None = None,
                        out: str | os.PathLike | None = None, **kw) -> dict[str, Any]:
    """Two checkpoints (or report folders) side by side: comparison.json and comparison.md in `out`.

    Checkpoints are evaluated into <out>/A and <out>/B on the same data, each with its own eval section plus the
    overrides; when the two differ in a setting the intervals depend on (`COMPARED_SETTINGS`) no side is called
    better.
    """
    out = Path(out) if out is not None else Path("probe-eval-comparison")
    for side in (a, b):  # a misspelt B fails now, not after A's whole evaluation
        read_report(Path(side))
    out.mkdir(parents=True, exist_ok=True)
    name_a, ma = load_or_evaluate(a, data, out / "A", **kw)
    name_b, mb = load_or_evaluate(b, data, out / "B", **kw)
    rows = ev.compare_metrics(headline(ma), headline(mb), headline(ma, intervals=True), headline(mb, intervals=True))
    warning = _different_questions(ma, mb) or _different_settings(ma, mb)
    if warning:  # a difference would mix the probes with the questions or settings: no side is called better
        rows = [{**r, "better": None} for r in rows]
    scales = _acceptance_scales(ma, mb)
    if scales:  # the acceptance rows measure against different empirical ratios
        rows = [{**r, "better": None} if r["metric"].startswith("acceptance/") else r for r in rows]
        warning = f"{warning} {scales}" if warning else scales
    result = clean_json({"format": "specprobe-eval-comparison", "a": {"name": name_a, "path": str(a)},
                       "b": {"name": name_b, "path": str(b)}, "warning": warning, "rows": rows})
    (out / "comparison.json").write_text(json.dumps(result, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    (out / "comparison.md").write_text(render.render_comparison(f"{name_a} ({a})", f"{name_b} ({b})", rows,
                                                                warning), encoding="utf-8")
    return result


def data_unread(metrics: dict[str, Any]) -> str | None:
    """Why a report could not read its data folder (its skipped "data" part), or None."""
    return next((s.get("reason") or "" for s in metrics.get("skipped", []) if s.get("part") == "data"), None)


def _check_data_read(metrics: dict[str, Any], data, out: Path) -> None:
    """A comparison on a data folder that could not be read would compare only what needs no data: an error
    (the side's report stays in `out`)."""
    reason = None if data is None else data_unread(metrics)
    if reason is not None:
        raise ValueError(f"the data folder given (--data {data}) could not be read ({reason}); "
                         f"no comparison written (the report in {out} holds only what needs no data)")


def _acceptance_scales(ma: dict[str, Any], mb: dict[str, Any]) -> str | None:
    """Why the two reports' acceptance rows are not comparable (their empirical ratios divide by different draft
    labels: a report without the record predates it and used semantic_prob), or None."""
    def scale(m: dict[str, Any]) -> str | None:
        block = ((m.get("parts") or {}).get("acceptance") or {}).get("probes")
        return None if block is None else block.get("empirical_q", "semantic_prob")

    a, b = scale(ma), scale(mb)
    if a is None or b is None or a == b:
        return None
    return (f"A's acceptance ratio divides by {a} and B's by {b} (an older probe-eval): the acceptance/* rows "
            "measure against different empirical ratios, so neither is called better there.")


# what the intervals, the calibration numbers, the verifiers' pair subsets and the sweeps depend on
COMPARED_SETTINGS = ("alpha", "n_boot", "resample", "n_bins", "seed", "max_pairs", "judge_max_pairs",
                     "sweep_hidden_dim", "sweep_epochs", "sweep_max_layers", "sweep_l2")

def _different_settings(ma: dict[str, Any], mb: dict[str, Any]) -> str | None:
    """Why two reports' intervals are not comparable (other eval settings: each checkpoint's own eval section, or a
    report folder made with other overrides), or None."""
    sa, sb = ma.get("settings") or {}, mb.get("settings") or {}
    def get(s: dict[str, Any], k: str) -> Any:
        return s.get(k, render.SETTINGS_BEFORE.get(k))

    differ = [f"{k} {get(sa, k)} and {get(sb, k)}" for k in COMPARED_SETTINGS if get(sa, k) != get(sb, k)]
    if not differ:
        return None
    return (f"A and B were evaluated with different settings ({'; '.join(differ)}): their numbers are not of one "
            "kind, so neither is called better. Compare the checkpoints themselves with the same values on the "
            "command line (eval.alpha=... eval.n_boot=...) to evaluate both alike; a report folder is read as it is.")


def _different_questions(ma: dict[str, Any], mb: dict[str, Any]) -> str | None:
    """Why two reports' numbers are not comparable (other held-out questions or data), or None."""
    qa = set((ma.get("heldout") or {}).get("questions") or [])
    qb = set((mb.get("heldout") or {}).get("questions") or [])
    da, db = (m.get("data") or {} for m in (ma, mb))
    same_data = (made_alike(da, db) if da.get("fingerprint") and db.get("fingerprint")
                 else da.get("folder") == db.get("folder"))
    if qa == qb and same_data:
        return None
    where = "" if same_data else f"; data {da.get('folder')} and {db.get('folder')} differ"
    return (f"A and B were scored on different held-out questions or data ({len(qa)} and {len(qb)} questions, "
            f"{len(qa & qb)} in common{where}): their differences mix the probes with the questions, so neither is "
            "called better. Checkpoints split with the same probe.seed and fractions on the same data are scored on "
            "the same questions.")
