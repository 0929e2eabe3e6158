"""What probe-eval reads: a checkpoint folder, its data folder, the held-out questions, probe inputs.

Errors that concern one part of the report (a probe missing from the checkpoint, data from another
model) are raised as `PartError`, so the report can skip that part, say why, and go on with the rest.
A folder that is not a checkpoint at all is a `CheckpointError` and stops the run.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specprobe.data_gen.store import MANIFEST, fingerprint_diff, open_dataset
from specprobe.infer import checkpoint_format as fmt
from specprobe.infer.checkpoint_format import CheckpointError
from specprobe.infer.verifiers import check_probe_model
from specprobe.probes.base import HiddenStateProbe
from specprobe.train.pipeline import SIDES, QuestionSplit, question_digests, unrecorded_families

__all__ = ["CheckpointError", "PartError", "CheckpointFolder", "open_checkpoint"]


class PartError(RuntimeError):
    """One part of the report cannot be evaluated (the others can)."""


# ----------------------------------------------------------------------------- checkpoint
class CheckpointFolder(fmt.Checkpoint):
    """The report's view of a checkpoint (`infer.checkpoint_format.Checkpoint`): a missing or unreadable
    component is a PartError, so that part is skipped and the others are still evaluated."""

    @property
    def path(self) -> Path:
        return self.folder

    def probe(self, name: str, map_location: Any = "cpu") -> HiddenStateProbe:
        return self.part(super().probe, name, map_location)

    def part(self, read, *args):
        """read(*args), a CheckpointError turned into a PartError."""
        try:
            return read(*args)
        except CheckpointError as err:
            raise PartError(str(err)) from None


def open_checkpoint(path: str | os.PathLike) -> CheckpointFolder:
    """The checkpoint for the report, its checkpoint.json read and checked by `infer.checkpoint_format` (a
    CheckpointError, with a hint when `path` is the run folder that holds it)."""
    if not Path(path).is_dir():
        raise CheckpointError(f"checkpoint folder not found: {path} (write one with `probe-train`)")
    return CheckpointFolder(path)


# ----------------------------------------------------------------------------- data
def training_data_folder(ckpt: CheckpointFolder) -> Path | None:
    """The data folder the checkpoint was trained on (recorded path, else <output_dir>/data), if it exists."""
    candidates = []
    data_entry = ckpt.meta.get("data")
    recorded = ckpt.meta.get("data_dir") or (data_entry.get("folder") if isinstance(data_entry, dict) else None)
    if recorded:  # relative to the checkpoint folder (older checkpoints: absolute)
        candidates.append(Path(recorded) if Path(recorded).is_absolute() else ckpt.path / recorded)
    output_dir = ckpt.config.get("output_dir")
    if output_dir:
        candidates.append(Path(output_dir) / "data")
    candidates.append(ckpt.path.parent / "data")  # <output_dir>/checkpoint next to <output_dir>/data
    for folder in candidates:
        if (folder / MANIFEST).is_file():
            return folder
    return None


def open_data(ckpt: CheckpointFolder, data: str | os.PathLike | None):
    """(dataset, is_training_data): the --data folder, or the checkpoint's own data folder.

    Either counts as the training data when it was generated with the same settings (fingerprint) and models
    (engines) as the checkpoint records, i.e. holds the same questions (a checkpoint that records none: when it is
    the checkpoint's own folder).
    """

    trained_on = training_data_folder(ckpt)
    recorded = ckpt.meta.get("data") or {}
    if data is None:
        if trained_on is None:
            raise PartError(f"no data folder: the checkpoint's training data ({ckpt.config.get('output_dir')}/data) "
                            "is not here; pass --data <folder>")
        ds = open_dataset(trained_on)
        # found where the training data was (or would be): it is that data only if made alike (a folder generated
        # again there with other settings is other data, its questions held out unless trained on)
        return ds, recorded.get("fingerprint") is None or made_alike(recorded, ds.manifest)
    ds = open_dataset(data)
    same = trained_on is not None and Path(trained_on).resolve() == Path(ds.folder).resolve()
    if recorded.get("fingerprint") is not None:
        same = made_alike(recorded, ds.manifest)
    return ds, same


def made_alike(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two data records (manifests, or what a checkpoint or report kept of one) made with the same settings
    (fingerprint) and models (engines): the same data, wherever it lies."""
    fa, fb = a.get("fingerprint"), b.get("fingerprint")
    same = not fingerprint_diff(fa, fb) if isinstance(fa, dict) and isinstance(fb, dict) else fa == fb
    return same and a.get("engines") == b.get("engines")


# ----------------------------------------------------------------------------- held-out questions
@dataclass
class HeldOut:
    """Which questions the report evaluates on, and how that was decided."""

    questions: list[str]
    train_questions: list[str]
    how: str
    sides: dict[str, int] = field(default_factory=dict)
    val_questions: list[str] = field(default_factory=list)  # chose the epoch / layer / threshold
    warning: str | None = None  # said in the report's first lines (e.g. evaluating on validation questions)
    split: str = "heldout"  # test, val, val+test, or heldout (another data folder)

    def mask(self, question_ids: Any) -> np.ndarray:
        return np.isin(np.asarray(question_ids, dtype=object), np.asarray(self.questions, dtype=object))

    def to_dict(self) -> dict[str, Any]:
        return {"split": self.split, "how": self.how, "n_questions": len(self.questions), "n_train_questions": len(self.train_questions),
                "n_val_questions": len(self.val_questions), "sides": self.sides, "warning": self.warning,
                "questions": list(self.questions)}


def recorded_split(ckpt: CheckpointFolder) -> dict[str, Any] | None:
    """Question ids per side as probe-train recorded them (metrics.json "split"), when it did, and the
    families per side where the questions had any."""
    entry = ckpt.metrics.get("split")
    if isinstance(entry, dict) and isinstance(entry.get("train"), list):
        split: dict[str, Any] = {s: [str(q) for q in (entry.get(s) or [])] for s in SIDES}
        if isinstance(entry.get("families"), dict):
            split["families"] = {s: [str(f) for f in (entry["families"].get(s) or [])] for s in SIDES}
        if isinstance(entry.get("warning"), str):  # e.g. split by id: a template on both sides
            split["warning"] = entry["warning"]
        if isinstance(entry.get("question_digests"), dict):
            split["question_digests"] = {s: [str(d) for d in (entry["question_digests"].get(s) or [])]
                                         for s in ("train", "val")}
        return split
    return None


def split_questions(ds, probe_section: dict[str, Any]) -> dict[str, Any]:
    """Recompute probe-train's question split of data folder `ds` with the checkpoint's probe settings."""
    return QuestionSplit.of_data(ds, QuestionSplit.recorded_settings(probe_section)).to_dict()


def heldout_questions(ckpt: CheckpointFolder, ds, is_training_data: bool, which: str = "auto") -> HeldOut:
    """The questions to evaluate on.

    On the training data: the checkpoint's validation / test questions (`which`: auto = test when the run
    held out a test split, else validation; or val, test, val+test). On another data folder: every
    question the checkpoint was neither trained nor validated on, nor one of a family (template) it was.
    """
    questions = ds.question_ids()
    split = recorded_split(ckpt)
    how = "as recorded in the checkpoint's metrics.json"
    if split is None:
        trained_on = training_data_folder(ckpt)
        if is_training_data or trained_on is not None:
            trained = ds if is_training_data else open_dataset(trained_on)
            split = {**split_questions(trained, ckpt.section("probe")), "warning": unrecorded_families(trained)}
            how = "recomputed with probe-train's question split and the checkpoint's probe settings"
    if not is_training_data:
        return _heldout_elsewhere(ds, questions, split)
    present = set(questions)
    sides = {s: [q for q in split[s] if q in present] for s in SIDES}
    if which == "auto":
        which = "test" if sides["test"] else "val"
    chosen = sorted({q for s in which.split("+") for q in sides[s]})
    if not chosen:
        raise PartError(f"the checkpoint's {which} split holds no question of {ds.folder}")
    # probe-train's own caveat on its split (a template on both sides) stays with every number drawn from it
    warning = "; ".join(w for w in (VAL_WARNING if "val" in which.split("+") else None, split.get("warning")) if w) or None
    return HeldOut(chosen, sides["train"], f"{which} questions ({how})", {s: len(v) for s, v in sides.items()},
                   val_questions=sides["val"], warning=warning, split=which)


def _heldout_elsewhere(ds, questions: list[str], split: dict[str, Any] | None) -> HeldOut:
    """Another data folder: validation questions chose the epoch, the layer and the threshold, and a question
    of a family (template) the checkpoint saw is a renamed one, so neither counts as held out."""
    if split is None:
        return HeldOut(questions, [], "all questions of the data folder (the checkpoint's training questions "
                       "are unknown)", {"heldout": len(questions)})
    train, val = set(split["train"]), set(split["val"])
    seen = set(split.get("families", {}).get("train", [])) | set(split.get("families", {}).get("val", []))
    family = ds.question_families()  # (a question without a family is its own: out when a copy of it was seen)
    present = set(questions)

    def seen_family(f: str) -> bool:
        # split_groups' reading: a family naming a question of this folder that has none of its own is a renamed
        # duplicate's link to that question (out when it was trained or validated on); any other is a template
        if f in present and family.get(f, f) == f:
            return f in train or f in val
        return f in seen

    # a question trained on under another id (records without ids are numbered by file): known by its text
    seen_text = {d for side in ("train", "val") for d in (split.get("question_digests") or {}).get(side, [])}
    text_of = question_digests(ds) if seen_text else {}
    # q in seen: a renamed copy of q was trained on (the split recorded q as that copy's family)
    chosen = [q for q in questions if q not in train and q not in val and q not in seen
              and not (family[q] != q and seen_family(family[q])) and text_of.get(q) not in seen_text]
    note = "all questions of the data folder not used in training or validation"
    if seen:
        note += ", nor of a question family (template) used there"
    by_text = sum(1 for q in questions if q not in train and q not in val and text_of.get(q) in seen_text)
    if by_text:
        note += f", nor {by_text} whose text a training or validation question had (under another id)"
    return HeldOut(chosen, sorted(train), note, {"heldout": len(chosen)},
                   val_questions=sorted(val & set(questions)), warning=split.get("warning"))


VAL_WARNING = ("evaluated on VALIDATION questions: these chose the probes' epoch (early stopping), the layer sweep's "
               "layer and the judge's threshold, so every number here is optimistic. Train with "
               "probe.test_fraction > 0 for a report on questions nothing was tuned on.")


# ----------------------------------------------------------------------------- probe inputs
def check_probe_fits_data(probe: HiddenStateProbe, ds, role: str, name: str) -> list[int]:
    """The columns of the data's stored layers the probe reads; PartError when the data cannot feed it."""
    engines = ds.manifest.get("engines", {})
    if role not in engines:
        raise PartError(f"{name}: the data folder {ds.folder} has no {role} model (models sampled: "
                        f"{sorted(engines)})")
    engine = engines[role]

    try:
        probe.spec.check_compatible(int(engine["num_layers"]), int(engine["hidden_size"]), engine["model_id"])
        check_probe_model(probe.spec, engine["model_id"], engine.get("revision"), name)
    except ValueError as err:
        raise PartError(f"{name}: the data in {ds.folder} comes from another {role} model: {err}") from None
    kept = list(ds.layers(role))
    missing = [r for r in probe.spec.layers if r not in kept]
    if missing:
        raise PartError(f"{name} reads hidden-state rows {probe.spec.layers}, but {ds.folder} stored only rows "
                        f"{kept} of the {role} (rows {missing} missing)")
    return [kept.index(r) for r in probe.spec.layers]


def predict(probe: HiddenStateProbe, x: torch.Tensor, cols: list[int]) -> np.ndarray:
    """Probe probabilities for stored-layer features x [n, L_kept, H]."""
    if x.shape[0] == 0:
        return np.empty(0)
    return probe.predict_proba(x[:, cols]).double().numpy()


def step_summary(ds) -> dict[str, Any]:
    """Per model: stored steps, the share cut by the token cap (stop_reason "length") or ended by EOS, mean
    tokens, the mean own-step label and the share of steps no other sample agreed with (own_prob 0)."""
    model = np.asarray(ds.column("model"), dtype=object)
    stop = np.asarray(ds.column("stop_reason"), dtype=object)
    tokens = np.asarray(ds.column("num_tokens"), dtype=np.float64)
    own = np.asarray(ds.column("own_prob"), dtype=np.float64)
    out = {}
    for m in sorted(set(model.tolist())):
        mask = model == m
        out[m] = {"steps": int(mask.sum()), "capped_share": float((stop[mask] == "length").mean()),
                  "eos_share": float((stop[mask] == "eos").mean()), "mean_tokens": float(tokens[mask].mean()),
                  "mean_own_prob": float(np.nanmean(own[mask])), "own_prob_zero_share": float((own[mask] == 0).mean())}
    return out

