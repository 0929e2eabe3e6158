"""Contexts for training data: "question + the first j steps" of a reasoning trace, and their plan.

A context is where a model continues with one step; SemanticSpec samples N continuations of each
(papers.md §1). Which j are taken from a trace of S steps (j = number of steps already given, so j in
0..S-1 always leaves at least one reference step to come):

- ``spread``: ``contexts_per_trace`` values spread evenly over 0..S-1 (both ends included),
- ``first``: 0, 1, ..., contexts_per_trace - 1,
- ``all``: every j in 0..S-1.

``max_context_steps`` caps j. Everything here is deterministic: the same traces and settings give the
same contexts, ids, order and shard plan, which is what makes resumption and ``--shard i/n`` work.
"""
from __future__ import annotations

import hashlib
import re
import warnings
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from specprobe.data_gen.sources import InvalidRecord, Trace
from specprobe.infer.engines.base import DEFAULT_STEP_DELIMITER
from specprobe.infer.engines.base import context_text as verifier_context_text

__all__ = ["Context", "DataWarning", "context_positions", "coerce_traces", "build_contexts", "context_seed",
           "context_text", "plan_shards", "part_shards", "parse_part", "question_families"]


class DataWarning(UserWarning):
    """A trace or context was skipped while generating training data."""


@dataclass(frozen=True)
class Context:
    """Question + the first ``j`` steps of trace ``question_id``."""

    id: str
    question_id: str
    domain: str
    question: str
    steps: tuple[str, ...]
    j: int
    answer: str = ""

    @property
    def text(self) -> str:
        """Plain (template-free) context for equivalence judges: question, then the steps given."""
        return context_text(self.question, self.steps)


def context_text(question: str, steps: Sequence[str], delimiter: str = DEFAULT_STEP_DELIMITER) -> str:
    """The runtime judges' context text (`infer.engines.base.context_text`), ending with the delimiter the next step
    follows."""
    return verifier_context_text(question, steps, delimiter) + delimiter


def context_positions(num_steps: int, count: int, mode: str = "spread", max_steps: int | None = None) -> list[int]:
    """The j values (steps given) taken from a trace with `num_steps` steps, ascending and distinct."""
    if num_steps < 1:
        raise ValueError(f"a trace needs at least one step, got {num_steps}")
    if count < 1:
        raise ValueError(f"contexts per trace must be >= 1, got {count}")
    top = num_steps - 1 if max_steps is None else min(num_steps - 1, max_steps)
    available = top + 1
    if mode == "all" or (mode == "spread" and count >= available):
        return list(range(available))
    if mode == "first":
        return list(range(min(count, available)))
    if mode != "spread":
        raise ValueError(f"unknown context_positions {mode!r}; use spread, first or all")
    if count == 1:
        return [0]
    return sorted({round(i * top / (count - 1)) for i in range(count)})


def _trace_from(item: Any, index: int) -> Trace:
    if isinstance(item, Trace):
        # Trace validates itself on construction, but fields may have been changed since.
        return Trace(item.id, item.domain, item.question, list(item.steps), item.answer, dict(item.meta), item.family)
    if isinstance(item, dict):
        return Trace.from_dict(item)
    raise InvalidRecord("<record>", f"expected a Trace or a dict, got {type(item).__name__}")


# Lone surrogates cannot be encoded (the tokenizer fails on them) and control characters other than tab and
# line breaks are not text: both are replaced, the record kept, and a warning names it.
_BAD_CHARS = re.compile(r"[\ud800-\udfff\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def clean_text(text: str) -> tuple[str, int]:
    """(text with lone surrogates and control characters replaced by U+FFFD, how many were replaced)."""
    cleaned, n = _BAD_CHARS.subn("\ufffd", text)
    return cleaned, n


def _cleaned(trace: Trace, item: Any, index: int) -> Trace:
    fields = {"question": trace.question, "answer": trace.answer}
    fields.update({f"steps[{i}]": s for i, s in enumerate(trace.steps)})
    bad = {}
    for name, text in fields.items():
        if isinstance(text, str):
            fields[name], n = clean_text(text)
            if n:
                bad[name] = n
    if not bad:
        return trace
    warnings.warn(f"{_describe(item, index)}: replaced {sum(bad.values())} lone surrogate or control characters in "
                  f"{', '.join(bad)} with U+FFFD; trace kept", DataWarning, stacklevel=3)
    steps = [fields[f"steps[{i}]"] for i in range(len(trace.steps))]
    return Trace(trace.id, trace.domain, fields["question"], steps, fields["answer"], dict(trace.meta), trace.family)


def _describe(item: Any, index: int) -> str:
    rid = getattr(item, "id", None) if not isinstance(item, dict) else item.get("id")
    return f"trace #{index}" + (f" (id {rid!r})" if rid is not None else "")


def coerce_traces(items: Iterable[Any]) -> list[Trace]:
    """Valid Traces from Trace objects or dicts; a malformed one or a repeated id is skipped with a
    DataWarning naming the trace and the field."""
    traces: list[Trace] = []
    seen: set[str] = set()
    for index, item in enumerate(items):
        try:
            trace = _cleaned(_trace_from(item, index), item, index)
        except (InvalidRecord, TypeError, ValueError) as err:
            warnings.warn(f"{_describe(item, index)}: {err}; trace skipped", DataWarning, stacklevel=2)
            continue
        if trace.id in seen:
            warnings.warn(f"{_describe(item, index)}: id repeats an earlier trace; trace skipped",
                          DataWarning, stacklevel=2)
            continue
        seen.add(trace.id)
        traces.append(trace)
    return traces


def build_contexts(traces: Sequence[Trace], count: int, mode: str = "spread",
                   max_steps: int | None = None) -> list[Context]:
    """Contexts of every trace, trace by trace in the given order, j ascending. Id: ``<trace id>@<j>``."""
    contexts: list[Context] = []
    for trace in traces:
        for j in context_positions(len(trace.steps), count, mode, max_steps):
            contexts.append(Context(f"{trace.id}@{j}", trace.id, trace.domain, trace.question,
                                    tuple(trace.steps[:j]), j, trace.answer))
    return contexts


def question_families(traces: Iterable[Trace], question_ids: Collection[str]) -> dict[str, str]:
    """Question id -> family, for the questions in `question_ids` whose family is not the question itself
    (the data folder's manifest records them; splits keep a family on one side)."""
    return {t.id: t.family for t in traces if t.id in question_ids and t.family is not None and t.family != t.id}


def context_seed(seed: int, context_id: str, role: str) -> int:
    """Sampling seed of one model on one context: a hash of (run seed, context id, role), so a context
    draws the same samples whichever run, shard or resumption processes it."""
    digest = hashlib.sha256(f"{seed}\x1f{context_id}\x1f{role}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def plan_shards(contexts: Sequence[Context], per_shard: int) -> list[list[Context]]:
    """Consecutive groups of `per_shard` contexts; shard k holds contexts [k*per_shard, (k+1)*per_shard)."""
    if per_shard < 1:
        raise ValueError(f"contexts per shard must be >= 1, got {per_shard}")
    return [list(contexts[i:i + per_shard]) for i in range(0, len(contexts), per_shard)]


def parse_part(text: str) -> tuple[int, int]:
    """``"i/n"`` -> (i, n) with 0 <= i < n (part i of n, counted from 0)."""
    try:
        i_text, n_text = text.split("/")
        i, n = int(i_text), int(n_text)
    except ValueError:
        raise ValueError(f"--shard {text!r} must look like i/n, e.g. 0/4 (part i of n, counted from 0)") from None
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"--shard {text!r}: need n >= 1 and 0 <= i < n")
    return i, n


def part_shards(num_shards: int, part: int, parts: int) -> list[int]:
    """Shard indices of part `part` of `parts`: every parts-th shard starting at `part`."""
    return list(range(part, num_shards, parts))
