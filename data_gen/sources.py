"""Trace sources: read reasoning traces from s1K, GSM8K, reasoning-gym, CHAMP or generic jsonl.

Every reader yields validated ``Trace`` records. A bad record (missing or empty field, no steps, a step
over ``max_step_chars``) or a bad line (not UTF-8, invalid JSON, not an object) is skipped with a
``SourceWarning`` that names the file and line (or data set and row), the record id and the field;
reading then goes on with the next record. ``load_traces`` is the single entry point; it also filters
by domain, renames duplicate ids and applies ``limit``. Files and hub data sets are read by
``inputs.records`` (the benchmark reads its problems there too); an empty file warns. Reference answers
lose thousands separators ("1,234" -> "1234", ``infer.answers.strip_thousands_separators``).

Steps: s1K trajectories and generic text fields are split with ``data_gen.steps.split_steps``
(``step_mode``/``delimiter``); GSM8K-style rationales (GSM8K, reasoning-gym) are split one line per
step; CHAMP and generic ``steps`` lists keep their own steps (each normalised, blank ones dropped).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from specprobe.data_gen.steps import MODES, PARAGRAPH_BREAK, normalise_text, split_steps
from specprobe.infer.answers import extract_boxed, split_gsm8k, strip_thousands_separators
from specprobe.infer.engines.base import DEFAULT_STEP_DELIMITER
from specprobe.inputs.records import (
    HUB_NAMES,
    Record,
    SourceWarning,
    check_path,
    family_value,
    field_value,
    iter_reasoning_gym_items,
    iter_records,
    record_id,
    source_stem,
    warn_source,
)

__all__ = [
    "KINDS",
    "Trace",
    "InvalidRecord",
    "SourceWarning",
    "iter_s1k",
    "iter_gsm8k",
    "iter_reasoning_gym",
    "iter_champ",
    "iter_jsonl",
    "iter_traces",
    "load_traces",
]

KINDS = ("s1k", "gsm8k", "reasoning_gym", "champ", "jsonl")
TRAJECTORIES = ("deepseek", "gemini")
JSONL_FIELDS = {"id": "id", "question": "question", "steps": "steps", "text": "text",
                "answer": "answer", "domain": "domain", "family": None}  # family: read only where mapped
_CALCULATOR = re.compile(r"<<[^<>]*>>")


class InvalidRecord(ValueError):
    """A record cannot become a Trace; ``field`` names the offending source field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"field {field_name!r}: {message}")
        self.field = field_name


@dataclass
class Trace:
    """One reasoning trace: a question, its reasoning steps and the final answer."""

    id: str
    domain: str
    question: str
    steps: list[str]
    answer: str
    meta: dict = field(default_factory=dict)
    # Questions made from one template (reasoning-gym's generators) or copies of one record share a family;
    # splits keep a family on one side, so a held-out question is not a renamed training question. None: its id.
    family: str | None = None

    def __post_init__(self) -> None:
        for name in ("id", "domain", "question", "answer"):
            if not isinstance(getattr(self, name), str):
                raise InvalidRecord(name, f"expected a string, got {type(getattr(self, name)).__name__}")
        if not self.id:
            raise InvalidRecord("id", "empty id")
        try:
            self.family = family_value(self.family)
        except ValueError as err:
            raise InvalidRecord("family", str(err)) from None
        if not self.question.strip():
            raise InvalidRecord("question", "empty question")
        if not isinstance(self.steps, list) or not self.steps:
            raise InvalidRecord("steps", "a trace needs at least one step")
        for i, step in enumerate(self.steps):
            if not isinstance(step, str) or not step.strip():
                raise InvalidRecord(f"steps[{i}]", "step is empty or not a string")

    def to_dict(self) -> dict:
        """Plain-dict form (JSON-serialisable when ``meta`` is)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Trace:
        """Inverse of ``to_dict``; also reads a hand-written dict, where only id, question and steps are needed
        (domain "unknown", answer ""). A missing or malformed field raises InvalidRecord naming it."""
        missing = [k for k in ("id", "question", "steps") if k not in d]
        if missing:
            raise InvalidRecord(missing[0], "missing")
        if not isinstance(d["steps"], (list, tuple)):
            raise InvalidRecord("steps", f"expected a list of strings, got {type(d['steps']).__name__}")
        return cls(id=d["id"], domain=d.get("domain", "unknown"), question=d["question"], steps=list(d["steps"]),
                   answer=d.get("answer", ""), meta=dict(d.get("meta") or {}), family=d.get("family"))

    @property
    def split_group(self) -> str:
        """What a question split keeps together: the family, else the question itself."""
        return self.family if self.family is not None else self.id


# ---------------------------------------------------------------- small helpers


def _require_str(record: dict, key: str) -> str:
    """A non-blank string field, or InvalidRecord naming the field."""
    value = field_value(record, key)
    if value is None:
        raise InvalidRecord(key, "missing")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise InvalidRecord(key, f"expected a string, got {type(value).__name__}")
    if not value.strip():
        raise InvalidRecord(key, "empty")
    return value


def _optional_str(record: dict, keys: Iterable[str], default: str) -> str:
    """First non-blank string among ``keys``, else ``default``."""
    for key in keys:
        value = field_value(record, key)
        if isinstance(value, str) and value.strip():
            return value.strip()
    return default


def _split_or_fail(text: str, key: str, mode: str, delimiter: str) -> list[str]:
    """Split ``text`` into steps; an empty result is an InvalidRecord for ``key``."""
    steps = split_steps(text, mode=mode, delimiter=delimiter)
    if not steps:
        raise InvalidRecord(key, "empty trace (no steps)")
    return steps


def _clean_step_list(value: Any, key: str) -> list[str]:
    """Normalise a list of given steps, dropping blank ones; non-strings or no steps fail."""
    if not isinstance(value, (list, tuple)):
        raise InvalidRecord(key, f"expected a list of steps, got {type(value).__name__}")
    for i, step in enumerate(value):
        if not isinstance(step, str):
            raise InvalidRecord(f"{key}[{i}]", f"expected a string, got {type(step).__name__}")
    steps = [normalise_text(s) for s in value if s.strip()]
    if not steps:
        raise InvalidRecord(key, "empty trace (no steps)")
    return steps


# ---------------------------------------------------------------- record -> Trace


def _read(raws: Iterable[Record], make_id: Callable[[Record], str], build: Callable[[Record, str], Trace],
          max_step_chars: int | None) -> Iterator[Trace]:
    """Convert raw records to Traces, skipping bad ones with a warning naming location, id and field."""
    for raw in raws:
        rid = make_id(raw)
        try:
            trace = build(raw, rid)
            _check_step_lengths(trace, max_step_chars)
            trace.answer = strip_thousands_separators(trace.answer)
        except InvalidRecord as e:
            warn_source(f"{raw.where}: record {rid!r}: {e}; record skipped")
            continue
        trace.meta.setdefault("source", raw.where)
        yield trace


def _check_step_lengths(trace: Trace, max_step_chars: int | None) -> None:
    """InvalidRecord when a step is longer than ``max_step_chars`` characters."""
    if max_step_chars is None:
        return
    for i, step in enumerate(trace.steps):
        if len(step) > max_step_chars:
            key = trace.meta.get("steps_field", "steps")
            raise InvalidRecord(key, f"step {i} has {len(step)} characters, over max_step_chars={max_step_chars}")


def _id_maker(stem: str, id_field: str | None = "id") -> Callable[[Record], str]:
    """Record id from ``id_field`` when present, else ``{stem}-{index}``."""
    def make_id(raw: Record) -> str:
        return record_id(field_value(raw.record, id_field) if id_field else None) or f"{stem}-{raw.index}"
    return make_id


def _parse_gsm_rationale(text: str, key: str, strip_calculator: bool) -> tuple[list[str], str]:
    """Steps (one per line before ``####``) and the final answer of a GSM8K-style rationale."""
    gsm = split_gsm8k(text)
    if gsm is None:
        raise InvalidRecord(key, "no '#### <answer>' line")
    body, final = gsm
    if strip_calculator:
        body = _CALCULATOR.sub("", body)
    steps = split_steps(body, delimiter="\n")
    if not steps:
        raise InvalidRecord(key, "empty trace (no rationale lines before '####')")
    if not final:
        raise InvalidRecord(key, "no answer after '####'")
    return steps, final


def _s1k_trajectory(record: dict, trajectory: str, joiner: str) -> tuple[str, str]:
    """(column, text) of the chosen thinking trajectory of an s1K or s1K-1.1 record."""
    column = f"{trajectory}_thinking_trajectory"
    if any(k.endswith("_thinking_trajectory") for k in record):  # s1K-1.1 schema
        return column, _require_str(record, column)
    if "thinking_trajectories" not in record:
        raise InvalidRecord(column, "missing (and no s1K 'thinking_trajectories' column either)")
    value = record["thinking_trajectories"]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise InvalidRecord("thinking_trajectories", "expected a list of strings")
    return "thinking_trajectories", joiner.join(value)


def _s1k_builder(step_mode: str, delimiter: str, trajectory: str) -> Callable[[Record, str], Trace]:
    """Builder of Traces from s1K / s1K-1.1 records."""
    joiner = delimiter if step_mode == "delimiter" else PARAGRAPH_BREAK

    def build(raw: Record, rid: str) -> Trace:
        rec = raw.record
        question = _require_str(rec, "question")
        column, text = _s1k_trajectory(rec, trajectory, joiner)
        steps = _split_or_fail(text, column, step_mode, delimiter)
        solution = _require_str(rec, "solution")
        attempt_key = "attempt" if column == "thinking_trajectories" else f"{trajectory}_attempt"
        meta = {"steps_field": column, "attempt": field_value(rec, attempt_key),
                "source_type": field_value(rec, "source_type"), "solution": solution}
        return Trace(rid, _optional_str(rec, ("cot_type", "domain"), "unknown"), question.strip(), steps,
                     extract_boxed(solution) or solution.strip(), meta)
    return build


def _gsm8k_builder(strip_calculator: bool) -> Callable[[Record, str], Trace]:
    """Builder of Traces from GSM8K records (``question``, ``answer`` with ``#### n``)."""
    def build(raw: Record, rid: str) -> Trace:
        question = _require_str(raw.record, "question")
        steps, final = _parse_gsm_rationale(_require_str(raw.record, "answer"), "answer", strip_calculator)
        return Trace(rid, "math", question.strip(), steps, final, {"steps_field": "answer"})
    return build


def _reasoning_gym_builder(task: str, seed: int, strip_calculator: bool,
                           family_of: Callable[[int], str | None]) -> Callable[[Record, str], Trace]:
    """Builder of Traces from reasoning-gym items with ``metadata.answer_cot``; `family_of`: the family of the
    item at an index (`inputs.records.GymItem.family`)."""
    def build(raw: Record, rid: str) -> Trace:
        rec = raw.record
        question = _require_str(rec, "question")
        steps, final = _parse_gsm_rationale(_require_str(rec, "metadata.answer_cot"), "metadata.answer_cot",
                                            strip_calculator)
        meta = {"steps_field": "metadata.answer_cot", "task": task, "seed": seed, "index": raw.index,
                "cot_answer": final, "source_index": field_value(rec, "metadata.source_index")}
        return Trace(rid, "math", question.strip(), steps, _require_str(rec, "answer").strip(), meta,
                     family_of(raw.index))
    return build


def _champ_builder() -> Callable[[Record, str], Trace]:
    """Builder of Traces from CHAMP problems (converted to dicts)."""
    def build(raw: Record, rid: str) -> Trace:
        rec = raw.record
        steps = _clean_step_list(field_value(rec, "solution.steps"), "solution.steps")
        meta = {"steps_field": "solution.steps", "category": rec.get("category"),
                "identifier": rec.get("identifier")}
        return Trace(rid, "math", _require_str(rec, "text").strip(), steps,
                     _require_str(rec, "answer").strip(), meta)
    return build


def _jsonl_builder(fields: dict, step_mode: str, delimiter: str) -> Callable[[Record, str], Trace]:
    """Builder of Traces from generic records with configurable field names."""
    def build(raw: Record, rid: str) -> Trace:
        rec = raw.record
        question = _require_str(rec, fields["question"])
        steps_key, text_key = fields.get("steps"), fields.get("text")
        if steps_key and field_value(rec, steps_key) is not None:
            value = field_value(rec, steps_key)
            steps = (_split_or_fail(value, steps_key, step_mode, delimiter) if isinstance(value, str)
                     else _clean_step_list(value, steps_key))
            used = steps_key
        elif text_key and field_value(rec, text_key) is not None:
            steps, used = _split_or_fail(_require_str(rec, text_key), text_key, step_mode, delimiter), text_key
        else:
            named = " or ".join(repr(k) for k in (steps_key, text_key) if k)
            raise InvalidRecord(steps_key or text_key or "steps", f"missing (looked for {named})")
        # the data stage never reads the answer (probe-bench reads its own problems' answers): a record without
        # one is a trace like any other; an answer given must still be text or a number
        answer_key = fields.get("answer")
        given = field_value(rec, answer_key) if answer_key else None
        answer = "" if given is None or (isinstance(given, str) and not given.strip()) else \
            _require_str(rec, answer_key).strip()
        domain = _optional_str(rec, [fields["domain"]] if fields.get("domain") else [], "unknown")
        family = field_value(rec, fields["family"]) if fields.get("family") else None
        return Trace(rid, domain, question.strip(), steps, answer, {"steps_field": used}, family)
    return build


# ---------------------------------------------------------------- public readers


def _check_split_args(step_mode: str, delimiter: str) -> None:
    """Validate step-splitting options early (before any file is read)."""
    if step_mode not in MODES:
        raise ValueError(f"unknown step_mode {step_mode!r}; expected one of {MODES}")
    if not isinstance(delimiter, str) or not delimiter:
        raise ValueError(f"delimiter must be a non-empty string, got {delimiter!r}")


def iter_s1k(path: str | os.PathLike | None = None, name: str | None = None, split: str = "train", *,
             config: str | None = None, step_mode: str = "delimiter", delimiter: str = DEFAULT_STEP_DELIMITER,
             trajectory: str = "deepseek", max_step_chars: int | None = None) -> Iterator[Trace]:
    """Traces from s1K (``thinking_trajectories``) or s1K-1.1 (``{trajectory}_thinking_trajectory``)."""
    _check_split_args(step_mode, delimiter)
    if trajectory not in TRAJECTORIES:
        raise ValueError(f"unknown trajectory {trajectory!r}; expected one of {TRAJECTORIES}")
    if path is None and name is None:
        name = HUB_NAMES["s1k"]
    raws = iter_records(path, name, config, split)
    return _read(raws, _id_maker(source_stem(path, name)), _s1k_builder(step_mode, delimiter, trajectory),
                 max_step_chars)


def iter_gsm8k(path: str | os.PathLike | None = None, name: str | None = None, split: str = "train", *,
               config: str | None = None, strip_calculator: bool = True,
               max_step_chars: int | None = None) -> Iterator[Trace]:
    """Traces from GSM8K-format records: one step per rationale line, answer after ``####``."""
    if path is None and name is None:
        name = HUB_NAMES["gsm8k"]
    raws = iter_records(path, name, config, split)
    return _read(raws, _id_maker(source_stem(path, name)), _gsm8k_builder(strip_calculator), max_step_chars)


def iter_reasoning_gym(name: str = "gsm_symbolic", size: int = 100, seed: int = 0, *,
                       strip_calculator: bool = True, max_step_chars: int | None = None) -> Iterator[Trace]:
    """Traces generated offline by reasoning-gym (tasks whose items carry ``metadata.answer_cot``)."""
    items = {item.raw.index: item for item in iter_reasoning_gym_items(name, size, seed)}
    return _read((item.raw for item in items.values()), lambda raw: items[raw.index].id,
                 _reasoning_gym_builder(name, seed, strip_calculator, lambda i: items[i].family), max_step_chars)


@functools.lru_cache(maxsize=4)
def _champiter_records(source: str) -> tuple[dict, ...]:
    """The fields of CHAMP problems that traces use, in the data set's order (cached: the file is 70 MB)."""
    try:
        import champ_dataset
    except ImportError as e:
        raise RuntimeError(f"CHAMP needs the champ-dataset package (pip install champ-dataset natsort): {e}") from None
    records = []
    for key, problem in champ_dataset.load(source).problems.items():
        steps = None if problem.solution is None or problem.solution.steps is None else \
            [s.text for s in problem.solution.steps]
        records.append({"identifier": problem.identifier or key, "text": problem.text, "answer": problem.answer,
                        "category": problem.category, "solution": {"steps": steps}})
    return tuple(records)


def _champ_raws(source: str) -> Iterator[Record]:
    """CHAMP problems as raw records (copies, so the cache stays untouched)."""
    for i, record in enumerate(_champiter_records(source)):
        yield Record(i, f"champ {source} problem {record['identifier']}", copy.deepcopy(record))


def iter_champ(path: str | os.PathLike | None = None, name: str = "v0", *,
               max_step_chars: int | None = None) -> Iterator[Trace]:
    """Traces from CHAMP (the ``champ_dataset`` package, version ``name``, or a CHAMP .json ``path``)."""
    source = str(check_path(path)) if path is not None else name
    raws = _champ_raws(source)
    return _read(raws, lambda raw: f"champ-{raw.record['identifier']}", _champ_builder(), max_step_chars)


def iter_jsonl(path: str | os.PathLike | None = None, name: str | None = None, split: str = "train", *,
               config: str | None = None, fields: dict | None = None, step_mode: str = "delimiter",
               delimiter: str = DEFAULT_STEP_DELIMITER, max_step_chars: int | None = None) -> Iterator[Trace]:
    """Traces from generic records; ``fields`` maps id/question/steps/text/answer/domain to field names."""
    _check_split_args(step_mode, delimiter)
    unknown = set(fields or {}) - set(JSONL_FIELDS)
    if unknown:
        raise ValueError(f"unknown keys in fields: {sorted(unknown)}; allowed: {sorted(JSONL_FIELDS)}")
    mapping = {**JSONL_FIELDS, **(fields or {})}
    if not mapping.get("question"):
        raise ValueError("fields['question'] must name a field")
    raws = iter_records(path, name, config, split)
    return _read(raws, _id_maker(source_stem(path, name), mapping.get("id")),
                 _jsonl_builder(mapping, step_mode, delimiter), max_step_chars)


def _dedupe_ids(traces: Iterable[Trace]) -> Iterator[Trace]:
    """Rename repeated ids to ``{id}-dup{k}`` with a warning."""
    seen: set[str] = set()
    for trace in traces:
        if trace.id in seen:
            k = 1
            while f"{trace.id}-dup{k}" in seen:
                k += 1
            new_id = f"{trace.id}-dup{k}"
            warn_source(f"{trace.meta.get('source', '?')}: duplicate record id {trace.id!r}; renamed to {new_id!r}")
            # a copy stays in its original's family: both land on one side of the split
            trace = dataclasses.replace(trace, id=new_id, meta={**trace.meta, "original_id": trace.id},
                                        family=trace.split_group)
        seen.add(trace.id)
        yield trace


def iter_traces(kind: str, *, path: str | os.PathLike | None = None, name: str | None = None,
                split: str = "train", limit: int | None = None, seed: int = 0, size: int | None = None,
                step_mode: str = "delimiter", delimiter: str = DEFAULT_STEP_DELIMITER, trajectory: str = "deepseek",
                fields: dict | None = None, domains: list[str] | None = None,
                max_step_chars: int | None = None, config: str | None = None,
                strip_calculator: bool = True) -> Iterator[Trace]:
    """Generator form of ``load_traces`` (same arguments)."""
    if kind not in KINDS:
        raise ValueError(f"unknown trace source kind {kind!r}; expected one of {', '.join(KINDS)}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if kind == "s1k":
        traces = iter_s1k(path, name, split, config=config, step_mode=step_mode, delimiter=delimiter,
                          trajectory=trajectory, max_step_chars=max_step_chars)
    elif kind == "gsm8k":
        traces = iter_gsm8k(path, name, split, config=config, strip_calculator=strip_calculator,
                            max_step_chars=max_step_chars)
    elif kind == "reasoning_gym":
        n = size if size is not None else (limit if limit else 100)
        traces = iter_reasoning_gym(name or "gsm_symbolic", n, seed, strip_calculator=strip_calculator,
                                    max_step_chars=max_step_chars)
    elif kind == "champ":
        traces = iter_champ(path, name or "v0", max_step_chars=max_step_chars)
    else:
        if path is None and name is None:
            raise ValueError("kind 'jsonl' needs path= (a local file) or name= (a hub dataset)")
        traces = iter_jsonl(path, name, split, config=config, fields=fields, step_mode=step_mode,
                            delimiter=delimiter, max_step_chars=max_step_chars)
    return _limit(_dedupe_ids(_filter_domains(traces, domains)), limit)


def _filter_domains(traces: Iterable[Trace], domains: list[str] | None) -> Iterator[Trace]:
    """Traces whose domain is in ``domains`` (case-insensitive); all when ``domains`` is None. Keeping none of
    them warns, naming the domains the source has (a typo, or records without a domain field: 'unknown')."""
    if domains is None:
        yield from traces
        return
    wanted, seen, kept = {d.lower() for d in domains}, {}, 0
    for t in traces:
        if t.domain.lower() in wanted:
            kept += 1
            yield t
        else:
            seen[t.domain] = seen.get(t.domain, 0) + 1
    if not kept and seen:
        warn_source(f"source.domains={list(domains)} kept none of {sum(seen.values())} traces; their domains: "
                    + ", ".join(f"{d} ({n})" for d, n in sorted(seen.items())))


def _limit(traces: Iterator[Trace], limit: int | None) -> Iterator[Trace]:
    """At most ``limit`` traces, without reading further than needed."""
    if limit == 0:
        return
    for count, trace in enumerate(traces, start=1):
        yield trace
        if limit is not None and count >= limit:
            return


def load_traces(kind: str, *, path: str | os.PathLike | None = None, name: str | None = None,
                split: str = "train", limit: int | None = None, seed: int = 0, size: int | None = None,
                step_mode: str = "delimiter", delimiter: str = DEFAULT_STEP_DELIMITER, trajectory: str = "deepseek",
                fields: dict | None = None, domains: list[str] | None = None,
                max_step_chars: int | None = None, config: str | None = None,
                strip_calculator: bool = True) -> list[Trace]:
    """Load traces of one source kind (see KINDS) as a list.

    ``path`` reads a local .jsonl/.json/.parquet file; otherwise ``name`` is a hub data set (s1k, gsm8k,
    jsonl), a reasoning-gym task (default ``gsm_symbolic``, ``size`` items, default ``limit`` or 100,
    generated with ``seed``) or a CHAMP version (default ``v0``). ``domains`` keeps matching domains only,
    ``limit`` caps the number returned, ``max_step_chars`` skips traces with a longer step.
    """
    return list(iter_traces(kind, path=path, name=name, split=split, limit=limit, seed=seed, size=size,
                            step_mode=step_mode, delimiter=delimiter, trajectory=trajectory, fields=fields,
                            domains=domains, max_step_chars=max_step_chars, config=config,
                            strip_calculator=strip_calculator))
