"""Reading records (one dict per problem or trace) from local files and hub data sets.

One reader for every consumer: `data_gen.sources` turns records into traces, `infer.bench` into
benchmark problems. Local .jsonl/.ndjson/.json/.parquet files are read lazily; a bad line (not UTF-8,
invalid JSON, not an object) is skipped with a `SourceWarning` naming the file and line, and a file
with no records at all warns too. A hub data set is loaded with `datasets`; when that fails (no hub
access, no cache) the error says how to make a local file instead. `SourceConfig` is the config section
that names a source (`source` for traces, `bench.source` for problems).
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from specprobe.inputs.config import ConfigError, check_positive, opt

# hub data sets by short name (a source's or a benchmark's `name: gsm8k`), and the configs they load by default
HUB_NAMES = {"s1k": "simplescaling/s1K-1.1", "gsm8k": "openai/gsm8k", "math500": "HuggingFaceH4/MATH-500",
             "aime24": "HuggingFaceH4/aime_2024", "amc23": "math-ai/amc23"}
DEFAULT_HUB_CONFIGS = {"openai/gsm8k": "main"}
FILE_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet")


class SourceWarning(UserWarning):
    """A line or record was skipped or changed while reading a source."""


@dataclass(frozen=True)
class Record:
    """A raw source record with its position (for default ids) and location (for messages)."""

    index: int
    where: str
    record: dict


def warn_source(message: str) -> None:
    """Emit a SourceWarning attributed to the code that called the reader (two frames up from here)."""
    warnings.warn(message, SourceWarning, stacklevel=3)


def check_path(path: str | os.PathLike) -> Path:
    """The path as a Path; FileNotFoundError naming it when it does not exist."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(errno.ENOENT, "file not found", str(p))
    return p


def record_id(value: Any) -> str | None:
    """A record's id field as an id: a string or an int, stripped; None when missing, empty or of another type (the
    caller then numbers the record: `{source_stem}-{index}`)."""
    if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value).strip():
        return str(value).strip()
    return None


def source_stem(path: str | os.PathLike | None, name: str | None) -> str:
    """Short source name used in default ids: file stem or last part of a hub name."""
    if path is not None:
        stem = Path(path).name
        for suffix in FILE_SUFFIXES:
            if stem.endswith(suffix):
                return stem[: -len(suffix)]
        return stem
    return str(name).rstrip("/").split("/")[-1]


# ---------------------------------------------------------------- readers
def _iter_jsonl(path: Path) -> Iterator[Record]:
    """Records of a jsonl file; bad lines are skipped with a warning naming the line."""
    with open(path, "rb") as f:
        for lineno, raw_line in enumerate(f, start=1):
            try:
                line = raw_line.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                warn_source(f"{path}:{lineno}: line is not valid UTF-8 ({e.reason} at byte {e.start}); line skipped")
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                warn_source(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno}); line skipped")
                continue
            if not isinstance(record, dict):
                warn_source(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}; line skipped")
                continue
            yield Record(lineno - 1, f"{path}:{lineno}", record)


def _iter_json_array(path: Path) -> Iterator[Record]:
    """Records of a .json file holding one array of objects (a .json in jsonl form also works)."""
    data = path.read_bytes()
    if not data.removeprefix(b"\xef\xbb\xbf").lstrip().startswith(b"["):
        yield from _iter_jsonl(path)
        return
    try:
        items = json.loads(data.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    for i, record in enumerate(items):
        if not isinstance(record, dict):
            warn_source(f"{path}[{i}]: expected a JSON object, got {type(record).__name__}; item skipped")
            continue
        yield Record(i, f"{path}[{i}]", record)


def _iter_parquet(path: Path) -> Iterator[Record]:
    """Records of a parquet file, read in batches."""
    import pyarrow.parquet as pq

    index = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=256):
        for record in batch.to_pylist():
            yield Record(index, f"{path} row {index}", record)
            index += 1


def iter_file(path: str | os.PathLike) -> Iterator[Record]:
    """Records of a local .jsonl/.ndjson/.json/.parquet file (existence checked eagerly)."""
    p = check_path(path)
    readers = {".jsonl": _iter_jsonl, ".ndjson": _iter_jsonl, ".json": _iter_json_array,
               ".parquet": _iter_parquet}
    reader = readers.get(p.suffix.lower())
    if reader is None:
        raise ValueError(f"{p}: unsupported file type {p.suffix!r}; expected one of {sorted(readers)}")
    return _warn_if_empty(p, reader(p))


def _warn_if_empty(path: Path, records: Iterator[Record]) -> Iterator[Record]:
    empty = True
    for record in records:
        empty = False
        yield record
    if empty:
        warn_source(f"{path}: no records read (the file is empty or every line was skipped); check the path")


def hub_offline_flags() -> list[str]:
    """Names of the hub-offline environment variables that are switched on."""
    on = ("1", "true", "yes", "on")
    return [v for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if os.environ.get(v, "").lower() in on]


def _hub_error(name: str, config: str | None, split: str, error: Exception) -> RuntimeError:
    """A short RuntimeError explaining that a hub data set could not be loaded, and what to do."""
    flags = hub_offline_flags()
    why = f"{', '.join(flags)} is set" if flags else "set HF_HUB_OFFLINE=1 to fail fast without retries"
    config_text = f"config {config!r}, " if config else ""
    config_arg = f", {config!r}" if config else ""
    return RuntimeError(
        f"could not load the hub dataset {name!r} ({config_text}split {split!r}): "
        f"{type(error).__name__}: {str(error)[:300]}\n"
        f"This machine may have no hub access ({why}) and no cached copy. On a connected machine run\n"
        f"  python -c \"import datasets; datasets.load_dataset({name!r}{config_arg}, split={split!r})"
        f".to_json('{source_stem(None, name)}.jsonl')\"\n"
        f"(or .to_parquet(...)), copy the file here and pass path='<file>' instead of name=."
    )


def iter_hub(name: str, config: str | None, split: str) -> Iterator[Record]:
    """Rows of a hub data set via ``datasets.load_dataset`` (loaded eagerly, errors made readable)."""
    try:
        import datasets
    except ImportError as e:
        raise RuntimeError(f"loading {name!r} from the hub needs the 'datasets' package: {e}") from None
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # connection, offline-mode, missing-cache and not-found errors all land here
        raise _hub_error(name, config, split, e) from None
    return (Record(i, f"{name}[{split}] row {i}", dict(row)) for i, row in enumerate(ds))


def iter_records(path: str | os.PathLike | None, name: str | None, config: str | None, split: str) -> Iterator[Record]:
    """Raw records from a local file (preferred when given) or a hub data set (a hub id or a short name of
    HUB_NAMES)."""
    if path is not None:
        return iter_file(path)
    if name is None:
        raise ValueError("give path= (a local .jsonl/.json/.parquet file) or name= (a hub dataset)")
    name = HUB_NAMES.get(name, name)
    return iter_hub(name, config if config is not None else DEFAULT_HUB_CONFIGS.get(name), split)


def iter_reasoning_gym_items(task: str, size: int, seed: int) -> Iterator[GymItem]:
    """reasoning-gym's generated items, each with the id and family every consumer gives it (the data stage's
    traces and probe-bench's problems must agree: a checkpoint's test questions are benchmarked by id)."""
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(task, size=size, seed=seed)
    # gsm_symbolic draws each item's template with replacement (240 items use 81 templates): items of one
    # template are one problem with new names and numbers, so they share a family whatever the seed
    templates = getattr(dataset, "task_indices", None)
    for i, item in enumerate(dataset):
        family = None if templates is None else f"{task}/template-{templates[i]}"
        yield GymItem(Record(i, f"reasoning_gym {task} (seed={seed}) item {i}", item), f"{task}-{seed}-{i}", family)


@dataclass(frozen=True)
class GymItem:
    """One reasoning-gym item: the raw record, its id, and its family (the template it was drawn from, where the
    task draws items from a fixed set of templates; else None)."""

    raw: Record
    id: str
    family: str | None


def question_digest(text: str) -> str:
    """A question's text as a short digest, whitespace collapsed: how a question trained on is known in another
    file, whose records may give it another id (probe-train records them; probe-eval and probe-bench read them)."""
    return hashlib.sha256(" ".join(text.split()).encode("utf-8")).hexdigest()[:16]


def family_value(value: Any) -> str | None:
    """A record's family (the template its question was made from, as traces and problems carry it): a non-empty
    string, or a template number (as a string); None: the question is its own. ValueError for anything else."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"must be a non-empty string or a template number, got {value!r}")
    return value


def field_value(record: dict, key: str) -> Any:
    """Value of ``key`` in ``record``; a dotted key walks nested dicts. Missing gives None."""
    if key in record:
        return record[key]
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


@dataclass
class SourceConfig:
    kind: Literal["reasoning_gym", "s1k", "gsm8k", "champ", "jsonl"] = opt(
        "reasoning_gym", "trace source: reasoning_gym (offline default), s1k, gsm8k, champ, jsonl")
    path: str | None = opt(None, "local file (jsonl/parquet) for s1k, gsm8k and jsonl sources")
    name: str | None = opt(None, "datasets hub name, e.g. simplescaling/s1K-1.1, or a short name (s1k, gsm8k, "
                                 "math500, aime24, amc23); needs hub access or a cache. MATH-500 and AMC23 have "
                                 "only a test split (source.split=test)")
    split: str = opt("train", "dataset split")
    task: str = opt("gsm_symbolic", "reasoning-gym task name")
    size: int = opt(24, "number of generated reasoning-gym problems")
    limit: int | None = opt(None, "read at most this many traces")
    seed: int = opt(0, "seed for generated sources")
    step_mode: Literal["delimiter", "sentence"] = opt(
        "delimiter", "split the traces' reasoning on the delimiter or on sentence punctuation (the models' sampled "
                     "steps always end at the delimiter)")
    delimiter: str = opt("\n\n", "step delimiter")  # infer.engines.DEFAULT_STEP_DELIMITER (inputs imports no other package)
    trajectory: Literal["deepseek", "gemini"] = opt("deepseek", "which s1K-1.1 trajectory to read")
    domains: list[str] | None = opt(None, "keep only these domains (e.g. [math])")
    fields: dict | None = opt(None, "jsonl source: field names, e.g. {question: prompt, steps: reasoning, answer: label}")
    max_step_chars: int | None = opt(None, "skip (with a warning) traces that have a step longer than this")
    strip_calculator: bool = opt(
        True, "gsm8k / reasoning_gym: remove GSM8K's calculator annotations (<<48/2=24>>) from the steps; "
              "false keeps the rationale exactly as written")

    _FIELDS_KINDS = ("jsonl",)  # the kinds whose records `fields` renames (not a setting: no annotation)

    def __post_init__(self) -> None:
        check_positive(self, "size")
        if not self.delimiter:
            raise ConfigError("source.delimiter must not be empty")
        section = "bench.source" if isinstance(self, BenchSourceConfig) else "source"
        for key, name in (self.fields or {}).items():
            if name is not None and (not isinstance(name, str) or not name.strip()):
                raise ConfigError(f"{section}.fields.{key}: {name!r} is not a field name (a string, dotted for a "
                                  "nested field, or null)")
        if self.fields and self.kind not in self._FIELDS_KINDS:
            raise ConfigError(f"{section}.fields rename the fields of {' and '.join(self._FIELDS_KINDS)} records; "
                              f"{self.kind} records are read by their own names (set {section}.kind=jsonl to name "
                              "them yourself)")
        if self.kind == "jsonl" and not self.path and not self.name:
            raise ConfigError("source.kind is jsonl but neither source.path nor source.name is set; name a local "
                              ".jsonl/.parquet file (source.path=...) or a hub data set (source.name=..., e.g. "
                              f"one of {sorted(HUB_NAMES)} or org/name)")

    def check_available(self, key: str = "source") -> None:
        """Before any model loads: a local source file exists (`key`: the section's name in the config)."""
        if self.path and not Path(self.path).expanduser().exists():
            raise ConfigError(f"{key}.path: {self.path} does not exist ({key}.kind={self.kind})")


BENCH_FIELDS = ("id", "question", "answer", "family", "domain")  # the fields bench.source.fields may rename
# trace settings of a source that probe-bench does not read, and what to set instead
BENCH_UNREAD = {
    "step_mode": "the runtime's steps end at source.delimiter",
    "delimiter": "the runtime splits steps on source.delimiter (the steps the probes trained on)",
    "trajectory": "problems hold no reasoning; use bench.source.fields to name the question and answer",
    "max_step_chars": "problems hold no reasoning to cut",
    "strip_calculator": "problems hold no reasoning to clean",
    "limit": "bench.num_problems sets how many problems are decoded",
}


@dataclass
class BenchSourceConfig(SourceConfig):
    """probe-bench's problems (`bench.source`): a source whose split, unless set, is the named benchmark set's
    evaluation split (`infer.bench.BENCH_SPLITS`), else train."""

    _FIELDS_KINDS = ("jsonl", "gsm8k")
    split: str | None = opt(None, "dataset split; unset: the named benchmark set's evaluation split (gsm8k, "
                                  "math500, amc23: test; aime24: train), else train")

    def __post_init__(self) -> None:
        super().__post_init__()
        defaults = {f.name: f.default for f in dataclasses.fields(SourceConfig)}
        for key, instead in BENCH_UNREAD.items():
            if getattr(self, key) != defaults[key]:
                raise ConfigError(f"bench.source.{key} is not read by probe-bench (its problems are questions, the "
                                  f"models write the steps): {instead}")
        unknown = sorted(set(self.fields or {}) - set(BENCH_FIELDS))
        if unknown:
            raise ConfigError(f"bench.source.fields: probe-bench reads {', '.join(BENCH_FIELDS)}, not {unknown}")
        if self.kind != "jsonl" and self.domains is not None:
            raise ConfigError(f"bench.source.domains keeps jsonl records by their domain field; {self.kind} problems "
                              "are all of one domain (math)")

    def check_available(self, key: str = "bench.source") -> None:
        """As a source's, and a missing file of test questions says who writes it."""
        try:
            super().check_available(key)
        except ConfigError as err:
            if Path(self.path).name != "test_questions.jsonl":
                raise
            raise ConfigError(f"{err}: probe-train writes <output_dir>/test_questions.jsonl (its test split) when it "
                              "trains; for a checkpoint trained before it did, run python "
                              "benchmarks/export_test_questions.py CHECKPOINT DATA_FOLDER OUT.jsonl") from None
