"""The probe-train checkpoint folder: its file names, format tags, and the functions that write and read it.

This module is the one owner of the layout documented in checkpoints/README.md. `train.checkpoint`
writes through it (it knows what was trained); everything that reads a checkpoint (the runtime's verifier
loaders, the report, the benchmarks, the tests) opens it as a `Checkpoint`, whose accessors return each
component typed and checked; nobody else spells a file name or a JSON key of the format. It lives in `infer`
because the runtime may import `probes` and `infer` only.

A folder is assembled under a temporary name beside its destination and renamed into place
(`assemble`), so an interrupted run leaves the previous checkpoint or the new one, never a mix.
Everything is safetensors + JSON (+ PEFT's safetensors adapter); `find_pickles` enforces that.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specprobe.probes.base import HiddenStateProbe, load_probe
from specprobe.probes.baselines import ConstantBaseline, LogprobBaseline
from specprobe.probes.io import clean_json, model_paths, read_json, write_json

FORMAT = "specprobe-checkpoint"
FORMAT_VERSION = 1
COMPONENT_VERSION = 1  # of baselines.json, embedding_threshold.json and judge.json
CHECKPOINT_JSON = "checkpoint.json"
METRICS_JSON = "metrics.json"
MODEL_CARD = "README.md"
BASELINES_JSON = "baselines.json"
BASELINES_FORMAT = "specprobe.baselines"
EMBEDDING_JSON = "embedding_threshold.json"
EMBEDDING_FORMAT = "specprobe.embedding_threshold"
JUDGE_DIR = "judge_lora"
JUDGE_JSON = "judge.json"
JUDGE_FORMAT = "specprobe.judge_lora"
JUDGE_DTYPES = ("float32", "bfloat16", "float16")  # torch dtype names a judge.json may record
ADAPTER_CONFIG = "adapter_config.json"  # PEFT's file: its presence marks a LoRA adapter folder
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # PEFT's weights file of that folder
# names in checkpoint.json's `components`
BASELINES = "baselines"
EMBEDDING = "embedding_threshold"
JUDGE = "judge"
PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".bin", ".ckpt", ".joblib", ".npy", ".npz")


class CheckpointError(ValueError):
    """A checkpoint is missing a component, is malformed, or does not fit the models it is used with."""


def probe_name(role: str) -> str:
    """File stem of the runtime probe for `role` (target: p, draft: q)."""
    if role not in ("target", "draft"):
        raise ValueError(f"probe role must be 'target' or 'draft', got {role!r}")
    return f"probe_{role}"


def is_probe_component(name: str) -> bool:
    """Components stored as a probe's pair of files (runtime probes, the other kind, variants, last-layer
    baselines)."""
    return name.startswith(("probe_", "baseline_last_layer_"))


def component_files(folder: str | os.PathLike, name: str) -> list[Path]:
    """The files (or folder) that hold component `name` of a checkpoint folder, as `components` names it."""
    folder = Path(folder)
    if is_probe_component(name):
        return list(model_paths(folder, name))
    named = {BASELINES: BASELINES_JSON, EMBEDDING: EMBEDDING_JSON, JUDGE: JUDGE_DIR}
    if name not in named:
        raise CheckpointError(f"unknown checkpoint component {name!r}")
    return [folder / named[name]]


def copy_components(source: str | os.PathLike, folder: str | os.PathLike, names: list[str]) -> None:
    """Copy components `names` of checkpoint folder `source` into `folder` (one being assembled)."""
    for name in names:
        for path in component_files(source, name):
            if path.is_dir():
                shutil.copytree(path, Path(folder) / path.name)
            else:
                shutil.copy2(path, Path(folder) / path.name)


# ----------------------------------------------------------------------------- folder
def checkpoint_folder(path: str | os.PathLike) -> Path:
    """The folder of a checkpoint given as the folder or its checkpoint.json; CheckpointError if absent."""
    folder = Path(path)
    if folder.name == CHECKPOINT_JSON:
        folder = folder.parent
    if not folder.is_dir():
        old = _previous(folder)
        if old is not None:
            raise CheckpointError(f"checkpoint folder {folder} does not exist: a probe-train run stopped while "
                                  f"replacing it, and the previous checkpoint is {old}; rename it back to {folder} "
                                  "(the next probe-train run does so itself)")
        raise CheckpointError(f"checkpoint folder {folder} does not exist; train one with `probe-train` "
                              "or choose a verifier that needs none (exact, bernoulli, llm_judge, ...)")
    if (folder / "manifest.json").is_file() and not (folder / CHECKPOINT_JSON).is_file():
        sibling = folder.parent / "checkpoint"
        raise CheckpointError(f"{folder} is a data folder (probe-train's data stage: manifest.json), not a checkpoint"
                              + (f"; did you mean {sibling}?" if (sibling / CHECKPOINT_JSON).is_file() else
                                 "; train one from it with `probe-train --stage train`"))
    return folder


def _read(path: Path, what: str) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{what}: {path} not found")
    try:
        data = read_json(path, "re-train the checkpoint (probe-train --stage train)")
    except ValueError as err:  # probes.io.FileFormatError
        raise CheckpointError(f"{what}: {err}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{what}: {path} must hold a JSON object, found {type(data).__name__}")
    return data


def _check_format(data: dict, path: Path, expected: str, *, required: bool = False) -> None:
    """A component file's format tag and version. Files written before tags existed carry none and are accepted
    (unless `required`); another tag, or a version this specprobe does not read, is an error."""
    found, version = data.get("format"), data.get("format_version")
    if (found is not None or required) and found != expected:
        raise CheckpointError(f"{path}: format {found!r}, expected {expected!r}")
    if version is not None and version != COMPONENT_VERSION:
        raise CheckpointError(f"{path}: field 'format_version' is {version!r}; this specprobe reads version "
                              f"{COMPONENT_VERSION} of {expected!r}: use the specprobe that wrote it, or re-run "
                              "`probe-train`")


def read_meta(path: str | os.PathLike) -> dict:
    """checkpoint.json, with its format and version checked."""
    folder = checkpoint_folder(path)
    meta_path = folder / CHECKPOINT_JSON
    if not meta_path.is_file():
        raise CheckpointError(f"{folder} is not a probe-train checkpoint: no {CHECKPOINT_JSON} "
                              "(train one with `probe-train --config <file>`)")
    meta = _read(meta_path, "checkpoint")
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{meta_path}: format {meta.get('format')!r} version {meta.get('format_version')!r}; "
                              f"this specprobe reads {FORMAT!r} version {FORMAT_VERSION}: re-run `probe-train`")
    return meta


def read_metrics(path: str | os.PathLike) -> dict:
    file = checkpoint_folder(path) / METRICS_JSON
    return _read(file, "checkpoint metrics") if file.is_file() else {}


def file_list(folder: Path) -> list[dict[str, Any]]:
    return [{"file": str(p.relative_to(folder)), "bytes": p.stat().st_size}
            for p in sorted(folder.rglob("*")) if p.is_file()]


@contextmanager
def assemble(folder: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary folder beside `folder`; on success it replaces `folder` in one rename.

    Refuses to install a folder holding pickle-like files; on any error the temporary folder is removed.
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    old = _previous(folder)
    if old is not None and not folder.exists():  # a run stopped between _swap_in's two renames: undo the first
        os.replace(old, folder)
    tmp = folder.with_name(f".{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        bad = find_pickles(tmp)
        if bad:
            raise RuntimeError(f"refusing to write a checkpoint with pickle files: {bad}")
        _swap_in(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _make_readable(folder: Path) -> None:
    """Files 0644, folders 0755: checkpoints are meant to be shared (temporary files are created 0600)."""
    for path in [folder, *folder.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)


def _previous(folder: Path) -> Path | None:
    """The newest checkpoint `_swap_in` moved aside for `folder` and did not remove (a run stopped between its
    renames), or None."""
    olds = sorted(folder.parent.glob(f".{folder.name}.old*"), key=lambda p: p.stat().st_mtime)
    return olds[-1] if olds else None


def _swap_in(tmp: Path, folder: Path) -> None:
    _make_readable(tmp)
    old = folder.with_name(f".{folder.name}.old{os.getpid()}")
    if folder.exists():
        os.replace(folder, old)
    os.replace(tmp, folder)
    if old.exists():  # renamed before removal: a .old folder is always a whole checkpoint (`_previous` restores it)
        trash = folder.with_name(f".{folder.name}.trash{os.getpid()}")
        os.replace(old, trash)
        shutil.rmtree(trash, ignore_errors=True)


def find_pickles(folder: str | os.PathLike) -> list[str]:
    """Files that are or may be pickles: a pickle-ish suffix, a .safetensors file that safetensors cannot
    open, or any other file starting like a pickle (protocol 2-5 header) or a zip (torch.save)."""
    from safetensors import safe_open

    bad = []
    for path in Path(folder).rglob("*"):
        if not path.is_file():
            continue
        if path.suffix.lower() in PICKLE_SUFFIXES:
            bad.append(str(path))
        elif path.suffix == ".safetensors":
            try:
                with safe_open(str(path), framework="pt") as f:
                    list(f.keys())
            except Exception:  # noqa: BLE001 - anything safetensors cannot read is suspect
                bad.append(str(path))
        else:
            with open(path, "rb") as f:
                head = f.read(2)
            if head == b"PK" or (len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5):
                bad.append(str(path))
    return sorted(bad)


# ----------------------------------------------------------------------------- writing
def write_meta(folder: Path, *, name: str, created: str, components: list[str], data: dict, config: dict,
               versions: dict) -> dict:
    """checkpoint.json, listing every file already in `folder` (write it last)."""
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "name": name, "created": created,
            "components": components, "data": data, "config": config, "versions": versions}
    write_json(folder / CHECKPOINT_JSON, clean_json(meta))
    meta["files"] = file_list(folder)
    write_json(folder / CHECKPOINT_JSON, clean_json(meta))
    return meta


def write_metrics(folder: Path, metrics: dict) -> dict:
    metrics = clean_json(metrics)
    write_json(folder / METRICS_JSON, metrics)
    return metrics


def write_model_card(folder: Path, text: str) -> None:
    (folder / MODEL_CARD).write_text(text, encoding="utf-8")


def write_baselines(folder: Path, per_role: dict[str, dict], per_set: dict[str, dict] | None = None) -> str:
    """baselines.json: per role the constant and log-prob baselines' own dicts plus what they read (fitted on
    the role's main training sets together) and, under "sets", each row set's own (fitted on that set)."""
    payload = {"format": BASELINES_FORMAT, "format_version": COMPONENT_VERSION, **per_role}
    if per_set:
        payload["sets"] = per_set
    write_json(folder / BASELINES_JSON, clean_json(payload))
    return BASELINES


def write_embedding(folder: Path, *, model: str, model_id: str, threshold: float, fit: dict | None,
                    validation: dict | None, score: str, fit_on: str | None = None,
                    fit_error: str | None = None) -> str:
    """embedding_threshold.json. fit_on: the pairs the threshold was fitted on; fit_error: why none could be
    fitted (then `threshold` is the configured default)."""
    payload = {"format": EMBEDDING_FORMAT, "format_version": COMPONENT_VERSION, "kind": "embedding_threshold",
               "embedding_model": model, "embedding_model_id": model_id, "score": score,
               "threshold": threshold, "fit": fit, "fit_on": fit_on, "fit_error": fit_error,
               "validation": validation}
    write_json(folder / EMBEDDING_JSON, clean_json(payload))
    return EMBEDDING


def write_judge_meta(adapter_dir: Path, *, base_model: str, threshold: float, prompt_version: int,
                     answer_tokens: dict[str, int], **details: Any) -> None:
    """judge.json beside a PEFT adapter (the adapter itself is written by PEFT's save_pretrained)."""
    meta = {"format": JUDGE_FORMAT, "format_version": COMPONENT_VERSION, "base_model": base_model, "threshold": threshold,
            "prompt_version": prompt_version, "answer_tokens": dict(answer_tokens), **details}
    write_json(Path(adapter_dir) / JUDGE_JSON, clean_json(meta))


# ----------------------------------------------------------------------------- reading components
def read_baselines(path: str | os.PathLike) -> dict[str, dict]:
    """baselines.json as {role: entry} (entries are the baselines' own dicts; `Checkpoint` rebuilds them)."""
    file = checkpoint_folder(path) / BASELINES_JSON
    data = _read(file, "baselines")
    _check_format(data, file, BASELINES_FORMAT, required=True)
    roles = data.get("roles") if isinstance(data.get("roles"), dict) else {}
    return {role: data.get(role) or roles[role] for role in ("target", "draft") if role in data or role in roles}


def read_set_baselines(path: str | os.PathLike) -> dict[str, dict]:
    """The per-row-set baselines of baselines.json ({} for a checkpoint written before they existed)."""
    file = checkpoint_folder(path) / BASELINES_JSON
    data = _read(file, "baselines")
    _check_format(data, file, BASELINES_FORMAT, required=True)
    sets = data.get("sets") or {}
    if not isinstance(sets, dict):
        raise CheckpointError(f"{file}: field 'sets' must be an object of row sets, got {type(sets).__name__}")
    return sets


@dataclass(frozen=True)
class EmbeddingEntry:
    model: str  # config name of the sentence embedder
    threshold: float  # cosine threshold
    raw: dict  # the whole file (fit, validation, ...)


def read_embedding(path: str | os.PathLike) -> EmbeddingEntry:
    file = checkpoint_folder(path) / EMBEDDING_JSON
    data = _read(file, "embedding verifier")
    _check_format(data, file, EMBEDDING_FORMAT)
    model, threshold = data.get("embedding_model"), data.get("threshold")
    if not isinstance(model, str) or not isinstance(threshold, (int, float)):
        raise CheckpointError(f"{file} must name the embedding model ('embedding_model') and a numeric "
                              f"'threshold'; found keys {sorted(data)}. Re-run `probe-train` with 'embedding' "
                              "in verifiers.train to rewrite it")
    return EmbeddingEntry(model, float(threshold), data)


@dataclass(frozen=True)
class JudgeEntry:
    adapter_dir: Path  # PEFT adapter folder
    base_model: str  # config name of the base causal LM
    threshold: float  # decision threshold on P(aligned)
    prompt_version: int | None
    answer_tokens: tuple[int, int] | None  # (yes, no) token ids the adapter was trained with
    raw: dict
    dtype: str | None = None  # the base model's dtype when the threshold was fitted (None: not recorded)


def judge_dir(path: str | os.PathLike) -> Path:
    """The adapter folder of a checkpoint (`<folder>/judge_lora`), or `path` itself when it is one."""
    folder = checkpoint_folder(path)
    return folder / JUDGE_DIR if (folder / JUDGE_DIR).is_dir() else folder


def read_judge(path: str | os.PathLike) -> JudgeEntry:
    """judge.json of a checkpoint (or of an adapter folder), checked for what the runtime needs."""
    adapter = judge_dir(path)
    file = adapter / JUDGE_JSON
    meta = _read(file, "judge-LoRA verifier")
    _check_format(meta, file, JUDGE_FORMAT)
    for needed in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):  # PEFT would read a missing file as a hub repo id
        if not (adapter / needed).is_file():
            raise CheckpointError(f"{adapter} has no {needed} (the PEFT LoRA adapter); re-run `probe-train` "
                                  "with 'judge' in verifiers.train")
    base = meta.get("base_model")
    if not isinstance(base, str) or not base:
        raise CheckpointError(f"{file} does not name its base model ('base_model'); re-run `probe-train` with "
                              "'judge' in verifiers.train")
    version = meta.get("prompt_version")
    tokens = meta.get("answer_tokens")
    if tokens is not None:
        if not isinstance(tokens, dict) or not {"yes", "no"} <= set(tokens):
            raise CheckpointError(f"{file}: 'answer_tokens' must be {{\"yes\": id, \"no\": id}}, got {tokens!r}")
        tokens = (int(tokens["yes"]), int(tokens["no"]))
    threshold = meta.get("threshold", 0.5)
    if not isinstance(threshold, (int, float)):
        raise CheckpointError(f"{file}: 'threshold' must be a number, got {threshold!r}")
    dtype = meta.get("dtype")
    if dtype is not None and dtype not in JUDGE_DTYPES:
        raise CheckpointError(f"{file}: 'dtype' must be one of {list(JUDGE_DTYPES)}, got {dtype!r}")
    return JudgeEntry(adapter, base, float(threshold), None if version is None else int(version), tokens, meta, dtype)


def has_probe(path: str | os.PathLike, name: str) -> bool:
    return all(p.is_file() for p in model_paths(checkpoint_folder(path), name))


# ----------------------------------------------------------------------------- the reader
@dataclass(frozen=True)
class Baselines:
    """The baselines of one role or row set, rebuilt: constant, logistic-calibrated log-prob and (newer
    checkpoints) its isotonic calibration; logprob_input names the column the log-prob baselines read."""

    constant: ConstantBaseline
    logprob: LogprobBaseline
    logprob_isotonic: LogprobBaseline | None = None
    logprob_input: str | None = None
    trained_on: Any = None

    @classmethod
    def from_entry(cls, entry: dict, where: str) -> Baselines:
        try:
            iso = entry.get("logprob_isotonic")
            return cls(ConstantBaseline.from_dict(entry["constant"]), LogprobBaseline.from_dict(entry["logprob"]),
                       None if iso is None else LogprobBaseline.from_dict(iso), entry.get("logprob_input"),
                       entry.get("trained_on"))
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{where}: not a baselines entry ({type(err).__name__}: {err}); re-run "
                                  "`probe-train`") from None


class Checkpoint:
    """A probe-train checkpoint folder: checkpoint.json checked once, every component read through a typed,
    validated accessor (a missing or malformed one is a CheckpointError that says what to do)."""

    def __init__(self, path: str | os.PathLike, strict: bool = True):
        """strict=False also opens a bare folder of saved components without checkpoint.json (probes saved by
        hand, say); a checkpoint.json that is there is always checked."""
        folder = Path(path)
        nested = folder / "checkpoint" / CHECKPOINT_JSON
        if folder.is_dir() and not (folder / CHECKPOINT_JSON).is_file() and nested.is_file():
            raise CheckpointError(f"{folder} is not a probe-train checkpoint: it has no {CHECKPOINT_JSON}; "
                                  f"did you mean {folder / 'checkpoint'}?")
        self.folder = checkpoint_folder(path)
        bare = not strict and not (self.folder / CHECKPOINT_JSON).is_file()
        self.meta = {} if bare else read_meta(self.folder)
        self._probes: dict[tuple[str, str], HiddenStateProbe] = {}
        self._metrics: dict | None = None

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.folder)!r}, components={self.components})"

    # ------------------------------------------------------------------ what it holds
    @property
    def name(self) -> str:
        return str(self.meta.get("name") or self.folder.name)

    @property
    def components(self) -> list[str]:
        return list(self.meta.get("components", []))

    @property
    def config(self) -> dict[str, Any]:
        """The experiment config it was trained with (as saved in checkpoint.json)."""
        return self.meta.get("config") or {}

    def section(self, name: str) -> dict[str, Any]:
        return self.config.get(name) or {}

    @property
    def metrics(self) -> dict[str, Any]:
        """metrics.json (validation metrics, the question split); {} when absent."""
        if self._metrics is None:
            self._metrics = read_metrics(self.folder)
        return self._metrics

    def probe_names(self) -> list[str]:
        return sorted(p.stem for p in self.folder.glob("*.safetensors") if has_probe(self.folder, p.stem))

    def has_probe(self, name: str) -> bool:
        return has_probe(self.folder, name)

    # ------------------------------------------------------------------ components
    def require_probe(self, name: str, *, missing: str = "") -> None:
        """A CheckpointError unless probe `name` is here (its files, not read: a check before models load)."""
        if not self.has_probe(name):
            raise CheckpointError(f"the checkpoint {self.folder} has no probe {name!r} (no {name}.safetensors + "
                                  f"{name}.json){'; ' + missing if missing else ''}; probes present: "
                                  f"{self.probe_names() or 'none'}")

    def probe(self, name: str, map_location: Any = "cpu", *, missing: str = "") -> HiddenStateProbe:
        """Probe `name` (MLP or logistic, told apart by its format tag), loaded once per device. missing: what
        the error for an absent probe tells the caller's user to do."""
        key = (name, str(map_location))
        if key not in self._probes:
            self.require_probe(name, missing=missing)
            try:
                self._probes[key] = load_probe(self.folder, name, map_location=map_location)
            except (ValueError, KeyError, OSError) as err:
                raise CheckpointError(f"cannot load probe {name!r} from {self.folder}: {err}") from None
        return self._probes[key]

    def baselines(self) -> dict[str, Baselines]:
        """Each role's baselines over its training sets (target, draft)."""
        file = self.folder / BASELINES_JSON
        return {role: Baselines.from_entry(entry, f"{file} [{role}]")
                for role, entry in read_baselines(self.folder).items()}

    def set_baselines(self) -> dict[str, Baselines]:
        """Each row set's own baselines ({} for a checkpoint written before they existed)."""
        file = self.folder / BASELINES_JSON
        return {name: Baselines.from_entry(entry, f"{file} [sets.{name}]")
                for name, entry in read_set_baselines(self.folder).items()}

    def embedding(self) -> EmbeddingEntry:
        return read_embedding(self.folder)

    def judge(self) -> JudgeEntry:
        return read_judge(self.folder)
