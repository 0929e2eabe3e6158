"""Experiment tracking: loss curves and final metrics to the console and, when enabled, to wandb.

``Tracker`` is what the training code talks to. Console output is always on (epoch lines are thinned
to every ``console_every``-th epoch plus the last); wandb is used only when ``wandb.enabled`` is set
in the config. Offline mode (the default) needs no account: runs are written under
``<output_dir>/wandb`` and can be uploaded later with ``wandb sync``.

Each curve has its own step key (``<component>/epoch`` or ``<component>/step``) declared with
``define_metric``, so curves of components trained one after another do not share an x axis.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

PrintFn = Callable[[str], None]


def flatten(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Nested metric dicts -> {"a/b/c": number}; non-numbers and non-finite values are dropped."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, dict):
            out.update(flatten(value, name))
        elif isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, (int, float)) and math.isfinite(float(value)):
            out[name] = float(value)
    return out


class Tracker:
    """Console + optional wandb logging for one probe-train run. Use as a context manager."""

    def __init__(self, wandb_cfg=None, *, run_name: str = "run", output_dir: str | os.PathLike = ".",
                 config: dict | None = None, print_fn: PrintFn = print, console_every: int = 10):
        self.print = print_fn
        self.console_every = max(1, int(console_every))
        self.run = None
        self._defined: set[str] = set()
        if wandb_cfg is not None and wandb_cfg.enabled:
            self.run = _start_wandb(wandb_cfg, run_name, Path(output_dir), config or {})

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc) -> None:
        self.finish()

    @property
    def wandb_dir(self) -> str | None:
        return None if self.run is None else str(self.run.dir)

    def message(self, text: str) -> None:
        self.print(text)

    def curve(self, component: str, step_key: str = "epoch") -> Callable[[dict[str, Any]], None]:
        """A log_fn for one component's training loop (e.g. fit_probe's per-epoch dicts)."""
        def log(entry: dict[str, Any]) -> None:
            self.log_point(component, entry, step_key)
        return log

    def log_point(self, component: str, entry: dict[str, Any], step_key: str = "epoch") -> None:
        step = int(entry.get(step_key, 0))
        if step % self.console_every == 0 or entry.get("last"):
            values = " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                              for k, v in entry.items() if k not in (step_key, "last"))
            self.print(f"  [{component}] {step_key} {step}: {values}")
        if self.run is not None:
            axis = f"{component}/{step_key}"
            if axis not in self._defined:
                self.run.define_metric(axis)
                self.run.define_metric(f"{component}/*", step_metric=axis)
                self._defined.add(axis)
            self.run.log({axis: step, **{f"{component}/{k}": v for k, v in flatten(entry).items()
                                          if k not in (step_key, "last")}})

    def final(self, metrics: dict[str, Any]) -> None:
        """Final metrics: into the wandb run summary (the console table is printed by the caller)."""
        if self.run is not None:
            self.run.summary.update(flatten(metrics))

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def _start_wandb(wandb_cfg, run_name: str, output_dir: Path, config: dict):
    try:
        import wandb
    except ImportError:
        raise RuntimeError("wandb.enabled is true but the wandb package is not installed; "
                           "pip install wandb, or set wandb.enabled=false") from None
    folder = Path(wandb_cfg.dir) if wandb_cfg.dir else output_dir / "wandb"
    folder.mkdir(parents=True, exist_ok=True)
    return wandb.init(project=wandb_cfg.project, entity=wandb_cfg.entity, name=wandb_cfg.run_name or run_name,
                      tags=list(wandb_cfg.tags) or None, mode=wandb_cfg.mode, dir=str(folder), config=config,
                      reinit="create_new")


# ----------------------------------------------------------------------------- console table
_PROBE_ROWS = (("probe", "probe"), ("logistic", "logistic probe (same sets)"), ("mlp", "MLP probe (same sets)"),
               ("variant", "variant: target steps only"), ("last_layer", "last-layer probe"),
               ("logprob", "log-prob, logistic fit on this set"), ("logprob_isotonic", "log-prob, isotonic on this set"),
               ("constant", "constant (this set's mean label)"))


def _num(value: Any, width: int = 9) -> str:
    return f"{value:>{width}.3f}" if isinstance(value, (int, float)) and math.isfinite(float(value)) else f"{'-':>{width}}"


_LABEL_W = 46


def _probe_lines(name: str, entry: dict, split: str) -> list[str]:
    spec = entry["features"]
    layers = spec["layers"]
    what = (f"{len(layers)} layers {spec['combine']}" if len(layers) > 1 else f"layer {layers[0]}") + \
        f", {spec['pooling']} pooling"
    kind = entry.get("kind", "mlp")
    lines = [f"{name} ({kind} {entry['role']} probe; trained on {' + '.join(entry['trained_on'])}, "
             f"n={entry['n_train']}; {what})"]
    for set_name, scores in entry.get(split, {}).items():
        first = next(iter(scores.values()))
        title = f"on {set_name} (n={first['n']}, majority rate {first['positive_rate']:.2f})"
        lines.append(f"  {title:<{_LABEL_W + 2}}{'MAE':>9}{'Spearman':>10}{'AUROC':>9}{'ECE':>9}")
        for key, label in _PROBE_ROWS:
            if key in scores:
                r = scores[key]
                lines.append(f"    {label:<{_LABEL_W}}{_num(r['mae'])}{_num(r['spearman'], 10)}{_num(r['auroc'])}"
                             f"{_num(r['ece_uniform'])}")
    return lines


def _pair_lines(title: str, block: dict, rows: list[tuple[str, str, str]]) -> list[str]:
    lines = [f"{title}", f"    {'':<{_LABEL_W}}{'AUROC':>8}{'thresh':>9}{'precision':>11}{'recall':>9}{'accept':>9}"]
    for group, point, label in rows:
        report = block.get(group)
        if not report or point not in report:
            continue
        p = report[point]
        lines.append(f"    {label:<{_LABEL_W}}{_num(report.get('auroc'), 8)}{_num(p['threshold'])}{_num(p['precision'], 11)}"
                     f"{_num(p['recall'])}{_num(p['acceptance_rate'])}")
    return lines


def format_metrics(metrics: dict[str, Any], split: str = "val") -> str:
    """The end-of-run table: every verifier's validation metrics next to its baselines."""
    lines = [f"==== {'validation' if split == 'val' else split} metrics ===="]
    for name, entry in metrics.get("probes", {}).items():
        lines += _probe_lines(name, entry, split)
    emb = metrics.get("embedding", {}).get(split)
    if emb:
        n = emb["verifier"]["chosen"]
        fit = metrics["embedding"].get("threshold_fit", {})
        met = fit.get("met_target", fit.get("fit_error") is None)
        rows = [("verifier", "chosen", "threshold at target precision" + ("" if met else " (not reached*)")),
                ("verifier", "f1_optimal", "F1-optimal threshold")]
        rows += [("fixed", key, key) for key in emb.get("fixed", {}) if key != "auroc"]
        rows += [("accept_all", "chosen", "accept all")]
        lines += _pair_lines(f"embedding threshold verifier (pairs n={n['n']}, equivalent {n['n_positive']})", emb, rows)
    judge = metrics.get("judge", {}).get(split)
    if judge:
        n = judge["verifier"]["chosen"]
        fit = metrics["judge"].get("threshold_fit", {})
        met = fit.get("met_target", fit.get("fit_error") is None)
        rows = [("verifier", "chosen", "judge LoRA, threshold at target precision" + ("" if met else " (not reached*)")),
                ("verifier", "p>=0.5", "judge LoRA, p >= 0.5"), ("base", "p>=0.5", "base model (untrained), p >= 0.5"),
                ("accept_all", "chosen", "accept all")]
        lines += _pair_lines(f"judge-LoRA verifier (pairs n={n['n']}, equivalent {n['n_positive']})", judge, rows)
    if any("(not reached*)" in line for line in lines):
        lines.append("  * no threshold reached verifiers.target_precision on the pairs it was fitted on (embedding: "
                     "training pairs, judge: validation pairs), or none could be fitted (too few pairs)")
    return "\n".join(lines)
