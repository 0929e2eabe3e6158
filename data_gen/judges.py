"""Meaning-equivalence judges for clustering sampled steps.

Interface (`EquivalenceJudge`): ``judge(items: Sequence[PairQuery]) -> list[bool]``, batched; ``name``
identifies the judge and its settings (cache keys use it); ``model_calls`` counts pair evaluations that
reached a model; ``symmetric`` says whether judge(a, b) == judge(b, a) by construction.

- `NLIJudge`: bidirectional entailment with an MNLI sequence classifier (SemanticSpec's recipe; the
  real model, e.g. microsoft/deberta-large-mnli, needs a hub or a local copy).
- `EmbeddingNumberJudge`: the offline stand-in (no NLI model ships on PyPI): sentence-embedding cosine
  plus a same-numbers check.
- `CachedJudge`: memoises any judge, optionally in an append-only JSONL file so resumed runs reuse it.
- `make_judge(kind, **kwargs)`: build one by name ("nli" | "embedding").
"""
from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

import torch

from specprobe.data_gen.cluster import PairQuery, normalise_step
from specprobe.infer.models import load_model

log = logging.getLogger(__name__)

__all__ = ["PairQuery", "EquivalenceJudge", "NLIJudge", "EmbeddingNumberJudge", "CachedJudge", "make_judge",
           "nli_equivalent", "label_roles", "extract_numbers", "position_limit"]


class EquivalenceJudge(ABC):
    """Decides, for a batch of (context, a, b), whether steps a and b mean the same after context."""

    name: str = "judge"
    symmetric: bool = False
    model_calls: int = 0  # pair evaluations that reached a model (instances keep their own count)

    @abstractmethod
    def judge(self, items: Sequence[PairQuery]) -> list[bool]:
        ...

    def equivalent(self, context: str, pairs: Sequence[tuple[str, str]]) -> list[bool]:
        """Convenience form: many (a, b) pairs under one context."""
        return self.judge([PairQuery(context, a, b) for a, b in pairs])


# ----------------------------------------------------------------------------------------------- NLI

ENTAILMENT, NEUTRAL, CONTRADICTION, OTHER = "entailment", "neutral", "contradiction", "other"


def _label_role(label: str) -> str:
    name = str(label).strip().lower()
    # startswith, not "in": "not_entailment" (2-way RTE-style heads) must not count as entailment
    if name.startswith("entail"):
        return ENTAILMENT
    if name.startswith("neutral"):
        return NEUTRAL
    if name.startswith("contradict"):
        return CONTRADICTION
    return OTHER


def label_roles(id2label: dict, model_name: str, strict: bool = True) -> list[str]:
    """Role (entailment / neutral / contradiction / other) of every class index, read from the label
    NAMES: MNLI checkpoints order their labels differently, so indices alone mean nothing."""
    if not id2label:
        raise ValueError(f"NLI model {model_name!r} has no config.id2label; cannot tell which output is entailment")
    roles_by_id = {int(i): _label_role(lbl) for i, lbl in id2label.items()}
    roles = [roles_by_id.get(i, OTHER) for i in range(max(roles_by_id) + 1)]
    shown = {int(i): lbl for i, lbl in id2label.items()}
    if ENTAILMENT not in roles:
        raise ValueError(f"NLI model {model_name!r} has no 'entailment' label (id2label = {shown}); "
                         "use an MNLI-style classifier whose config names its labels")
    if not strict and (NEUTRAL not in roles or CONTRADICTION not in roles):
        raise ValueError(f"non-strict NLI judging needs 'neutral' and 'contradiction' labels, but model "
                         f"{model_name!r} has id2label = {shown}; use strict=True")
    return roles


def nli_equivalent(forward: str, backward: str, strict: bool) -> bool:
    """Decision from the two directions' predicted roles (a => b, b => a).

    strict: both directions entailment (SemanticSpec; the default of Farquhar et al.'s semantic-entropy code).
    Non-strict (that code's other mode): no direction is a contradiction and the two are not both neutral, i.e.
    one is entailment (a model with a fourth class: that class counts as not entailment). (Kuhn
    et al.'s original code was looser still: only a contradiction separates two answers.)
    """
    if strict:
        return forward == ENTAILMENT and backward == ENTAILMENT
    if CONTRADICTION in (forward, backward):
        return False
    # "one entailment" rather than "not both neutral": the same with MNLI's three labels, and a model's extra class
    # ("other") both ways is then no agreement
    return ENTAILMENT in (forward, backward)


@dataclass(frozen=True)
class PairTemplate:
    """Where a tokenizer puts its special tokens around a (first, second) text pair, read off one
    example encoding, so pairs can be assembled from separately tokenized (and trimmed) pieces.
    transformers 5 fast tokenizers no longer offer build_inputs_with_special_tokens."""

    prefix: list[int]
    middle: list[int]
    suffix: list[int]
    type_first: int
    type_second: int

    @property
    def num_special(self) -> int:
        return len(self.prefix) + len(self.middle) + len(self.suffix)

    @classmethod
    def from_tokenizer(cls, tokenizer) -> PairTemplate:
        first_text, second_text = "premise", "hypothesis"
        first = tokenizer(first_text, add_special_tokens=False)["input_ids"]
        second = tokenizer(second_text, add_special_tokens=False)["input_ids"]
        enc = tokenizer(first_text, second_text)
        ids = list(enc["input_ids"])
        types = list(enc.get("token_type_ids") or [0] * len(ids))
        i = _find(ids, first, 0)
        j = _find(ids, second, i + len(first)) if i >= 0 else -1
        if i < 0 or j < 0:
            raise ValueError(f"cannot work out how {type(tokenizer).__name__} encodes a text pair "
                             f"(got ids {ids} for {first_text!r} / {second_text!r})")
        return cls(ids[:i], ids[i + len(first):j], ids[j + len(second):], types[i], types[j])

    def build(self, first: list[int], second: list[int]) -> tuple[list[int], list[int]]:
        """(input_ids, token_type_ids) of the pair. Special tokens take the type of the segment they
        close, which is what BERT/DeBERTa tokenizers do; DeBERTa-MNLI ignores types anyway."""
        ids = self.prefix + first + self.middle + second + self.suffix
        types = ([self.type_first] * (len(self.prefix) + len(first) + len(self.middle))
                 + [self.type_second] * (len(second) + len(self.suffix)))
        return ids, types


def _find(haystack: list[int], needle: list[int], start: int) -> int:
    for i in range(start, len(haystack) - len(needle) + 1):
        if haystack[i:i + len(needle)] == needle:
            return i
    return -1


def fit_pair(context: list[int], a: list[int], b: list[int], budget: int) -> tuple[list[int], list[int], list[int]]:
    """Trim so that (context + a) and (context + b) fit in `budget` tokens together.

    The CONTEXT loses tokens from the left (the steps and the context's end matter most). Steps are
    cut (from the right) only when the two steps alone exceed the budget; then each keeps at least
    half, and the caller warns.
    """
    if len(a) + len(b) > budget:
        half = budget // 2
        if len(a) <= half:
            b = b[:budget - len(a)]
        elif len(b) <= half:
            a = a[:budget - len(b)]
        else:
            a, b = a[:half], b[:budget - half]
    keep = min(len(context), (budget - len(a) - len(b)) // 2)
    return (context[len(context) - keep:] if keep > 0 else []), a, b


def position_limit(model) -> int | None:
    """The longest input a classifier with learned absolute positions reads (BERT, RoBERTa: 512; BART: 1024; DeBERTa
    only with position_biased_input); None where positions are relative only (DeBERTa MNLI) or the layout is not
    known."""
    base = getattr(model, "base_model", model)
    table = getattr(getattr(base, "embeddings", None), "position_embeddings", None)
    if isinstance(table, torch.nn.Embedding):
        # RoBERTa counts positions from padding_idx + 1 (514 rows, 512 positions)
        return table.num_embeddings - (table.padding_idx + 1 if table.padding_idx is not None else 0)
    table = getattr(getattr(base, "encoder", None), "embed_positions", None)  # BART: 1024 positions, 2 rows offset
    if isinstance(table, torch.nn.Embedding) and isinstance(getattr(table, "offset", None), int):
        return table.num_embeddings - table.offset
    return None


class NLIJudge(EquivalenceJudge):
    """Bidirectional entailment with a sequence-classification (MNLI) model.

    Premise "context + a", hypothesis "context + b", and the reverse; both directions of all pairs go
    through the model in one batched pass (minibatches of `batch_size`, sorted by length). Label roles
    are read from ``config.id2label`` by name. Too long inputs lose context from the left, never the
    step (see `fit_pair`). Both modes are symmetric in (a, b) because both directions are judged.

    model: a name for `infer.models.load_model` (hub id, local folder) or a preloaded (model, tokenizer).
    """

    symmetric = True

    def __init__(self, model="microsoft/deberta-large-mnli", strict: bool = True, batch_size: int = 16,
                 max_length: int = 512, device: str | None = None, name: str | None = None):
        self.model_calls = 0
        if batch_size < 1:
            raise ValueError(f"NLIJudge.batch_size must be >= 1, got {batch_size}")
        if isinstance(model, str):
            model_name = model
            self.model, self.tokenizer = load_model(model, kind="seq_cls", device=device)
        else:
            self.model, self.tokenizer = model
            model_name = getattr(self.model.config, "_name_or_path", "") or f"preloaded-{self.model.config.model_type}"
            if device is not None:
                self.model.to(device)
        self.model.eval()
        self.strict = strict
        self.batch_size = batch_size
        self.max_length = max_length
        self.roles = label_roles(self.model.config.id2label, model_name, strict)
        self.template = PairTemplate.from_tokenizer(self.tokenizer)
        if max_length < self.template.num_special + 2:
            raise ValueError(f"NLIJudge.max_length={max_length} leaves no room for text "
                             f"({self.template.num_special} special tokens per pair)")
        limit = position_limit(self.model)
        if limit is not None and max_length > limit:  # longer inputs would index past the position table
            raise ValueError(f"NLIJudge.max_length={max_length} (data.nli_max_length) is longer than the {limit} "
                             f"learned positions of {model_name}: set data.nli_max_length to at most {limit}")
        self.name = name or f"nli:{model_name}:{'strict' if strict else 'nonstrict'}:max_length={max_length}"
        self._use_types = "token_type_ids" in getattr(self.tokenizer, "model_input_names", [])
        self.truncated_steps = 0  # pairs whose steps alone were longer than max_length

    def judge(self, items: Sequence[PairQuery]) -> list[bool]:
        items = list(items)
        if not items:
            return []
        encodings = self._encode_both_directions(items)
        roles = self._classify(encodings)
        self.model_calls += len(items)
        n = len(items)
        return [nli_equivalent(roles[i], roles[n + i], self.strict) for i in range(n)]

    def _token_ids(self, texts: list[str]) -> dict[str, list[int]]:
        unique = list(dict.fromkeys(texts))
        # verbose=False: long contexts are expected here (trimmed below), no "longer than max" warning
        ids = self.tokenizer(unique, add_special_tokens=False, verbose=False)["input_ids"] if unique else []
        return dict(zip(unique, ids))

    def _encode_both_directions(self, items: list[PairQuery]) -> list[tuple[list[int], list[int]]]:
        """Encodings for a => b of every pair, then b => a of every pair (same order)."""
        # Pieces are tokenized separately so the context can be trimmed without touching the step.
        contexts = self._token_ids([q.context for q in items])
        steps = self._token_ids([s for q in items for s in (q.a, q.b)])
        budget = self.max_length - self.template.num_special
        forward, backward = [], []
        for q in items:
            a, b = steps[q.a], steps[q.b]
            ctx, a_fit, b_fit = fit_pair(contexts[q.context], a, b, budget)
            if len(a_fit) < len(a) or len(b_fit) < len(b):
                self.truncated_steps += 1
                log.warning("NLIJudge: steps of %d and %d tokens exceed max_length=%d; cutting the steps",
                            len(a), len(b), self.max_length)
            forward.append(self.template.build(ctx + a_fit, ctx + b_fit))
            backward.append(self.template.build(ctx + b_fit, ctx + a_fit))
        return forward + backward

    @torch.inference_mode()
    def _classify(self, encodings: list[tuple[list[int], list[int]]]) -> list[str]:
        device = next(self.model.parameters()).device
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        roles: list[str] = [OTHER] * len(encodings)
        # Length-sorted minibatches waste little compute on padding.
        order = sorted(range(len(encodings)), key=lambda i: len(encodings[i][0]))
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            width = max(len(encodings[i][0]) for i in idx)
            ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
            types = torch.zeros((len(idx), width), dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for row, i in enumerate(idx):
                seq, seq_types = encodings[i]
                ids[row, :len(seq)] = torch.tensor(seq)
                types[row, :len(seq)] = torch.tensor(seq_types)
                mask[row, :len(seq)] = 1
            inputs = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
            if self._use_types:
                inputs["token_type_ids"] = types.to(device)
            predicted = self.model(**inputs).logits.argmax(dim=-1).tolist()
            for i, label_id in zip(idx, predicted):
                roles[i] = self.roles[label_id]
        return roles


# ------------------------------------------------------------------------------- embedding + numbers

# A number: optional minus sign directly attached, digits with optional thousands commas, optional
# decimals; or a bare decimal like ".5". Not inside identifiers ("x2", "v1").
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<![\w.])-?\.\d+")


def _canonical_number(raw: str) -> str:
    try:
        value = Decimal(raw.replace(",", ""))
    except InvalidOperation:  # the pattern only matches valid decimals; keep the text if not
        return raw
    if value == 0:
        return "0"  # "-0", "0.00" -> "0"
    return format(value.normalize(), "f")


# A list marker at the start of a line ("1. ", "2) ", "Step 3: "): it numbers the step, it is not a quantity of
# the reasoning, so "1. First, ..." and "2. First, ..." must not differ by their numbers.
_LIST_MARKER = re.compile(r"^[ \t]*(?:step[ \t]+)?\d{1,2}[.):][ \t]+", re.IGNORECASE | re.MULTILINE)


def extract_numbers(text: str) -> frozenset[str]:
    """The SET of numbers written with digits in `text`, canonicalised: "1,000" -> "1000",
    "3.50" -> "3.5", "-0" -> "0". Number words ("twelve") are not recognised; list markers at a line's
    start ("1. ", "Step 2: ") are not numbers of the step."""
    text = _LIST_MARKER.sub("", text)
    return frozenset(_canonical_number(m.group()) for m in _NUMBER.finditer(text))


class EmbeddingNumberJudge(EquivalenceJudge):
    """Offline equivalence: cosine(a, b) >= threshold AND both steps mention the same set of numbers.

    An APPROXIMATION of bidirectional entailment, used because no NLI model ships on PyPI. Embeddings
    see wording, not logic: "The answer is 72." and "The answer is 48." have cosine 0.86 with MiniLM,
    so the number check does the work there. Known gaps: numbers written as words, the same value in
    another form (1/2 vs 0.5, 50% vs 0.5), a changed operator with the same numbers ("3 + 4" vs
    "3 * 4"), and negations.

    Numbers are compared as SETS, not multisets: repeating a value ("12 ... so 12") does not change the
    meaning, and the steps of one context often restate a number. Only the steps are compared; the
    context (shared by both) is ignored. Pairs failing the number check are decided without the model,
    so `model_calls` counts only the pairs that needed embeddings.
    """

    symmetric = True

    def __init__(self, embedder="offline:minilm", threshold: float = 0.8, require_same_numbers: bool = True,
                 device: str | None = None):
        self.model_calls = 0
        if not -1.0 <= threshold <= 1.0:
            raise ValueError(f"EmbeddingNumberJudge.threshold is a cosine in [-1, 1], got {threshold}")
        if isinstance(embedder, str):
            from specprobe.infer.embedder import SentenceEmbedder

            embedder = SentenceEmbedder(embedder, device=device)
        self.embedder = embedder
        self.threshold = threshold
        self.require_same_numbers = require_same_numbers
        self.name = (f"embedding:{embedder.name}:cos>={threshold}"
                     f"{':same-numbers' if require_same_numbers else ''}")

    def judge(self, items: Sequence[PairQuery]) -> list[bool]:
        items = list(items)
        decisions = [True] * len(items)
        if self.require_same_numbers:
            decisions = [extract_numbers(q.a) == extract_numbers(q.b) for q in items]
        todo = [i for i, ok in enumerate(decisions) if ok]
        if todo:
            cos = self.embedder.cosine([items[i].a for i in todo], [items[i].b for i in todo])
            self.model_calls += len(todo)
            for i, c in zip(todo, cos.tolist()):
                decisions[i] = c >= self.threshold
        return decisions


# --------------------------------------------------------------------------------------------- cache

class CachedJudge(EquivalenceJudge):
    """Memoises another judge's decisions, optionally persisted as append-only JSONL.

    Key: sha256 of (inner.name, context, whitespace-normalised a, b); the pair is sorted first when
    the inner judge is symmetric, so (a, b) and (b, a) share one entry. Steps that differ only in
    whitespace share a decision (clustering treats them as duplicates too); letter case is kept.

    The file holds one ``{"key": ..., "equivalent": ...}`` per line. Loading skips malformed lines and
    cuts off a partial last line (a crash mid-write), so a resumed run reuses everything written whole.
    """

    def __init__(self, inner: EquivalenceJudge, cache_path: str | os.PathLike | None = None):
        self.inner = inner
        self.name = inner.name  # same decisions, same identity
        self.symmetric = bool(getattr(inner, "symmetric", False))
        self.cache_path = Path(cache_path) if cache_path is not None else None
        self.hits = 0
        self.misses = 0
        self.skipped_lines = 0
        self._memo: dict[str, bool] = {}
        if self.cache_path is not None and self.cache_path.exists():
            self._load()

    @property
    def model_calls(self) -> int:  # type: ignore[override]  # the inner judge owns the count
        return self.inner.model_calls

    def __len__(self) -> int:
        return len(self._memo)

    def key(self, q: PairQuery) -> str:
        a, b = normalise_step(q.a), normalise_step(q.b)
        if self.symmetric and b < a:
            a, b = b, a
        payload = json.dumps([self.inner.name, q.context, a, b], ensure_ascii=False)
        # surrogatepass: text read from JSON may hold a lone surrogate, which strict UTF-8 refuses; valid
        # text encodes as before, so existing caches keep their keys.
        return hashlib.sha256(payload.encode("utf-8", errors="surrogatepass")).hexdigest()

    def judge(self, items: Sequence[PairQuery]) -> list[bool]:
        items = list(items)
        keys = [self.key(q) for q in items]
        missing: dict[str, PairQuery] = {}
        for k, q in zip(keys, items):
            if k not in self._memo and k not in missing:
                missing[k] = q
        self.misses += len(missing)
        self.hits += len(items) - len(missing)
        if missing:
            decisions = list(self.inner.judge(list(missing.values())))
            if len(decisions) != len(missing):  # zip would drop the tail and leave a KeyError below
                raise RuntimeError(f"judge {self.inner.name!r} returned {len(decisions)} decisions for "
                                   f"{len(missing)} pairs; a judge answers each pair it is given, in order")
            new = {k: bool(d) for k, d in zip(missing, decisions)}
            self._memo.update(new)
            self._append(new)
        return [self._memo[k] for k in keys]

    def decisions(self, since: int = 0) -> dict[str, bool]:
        """The decisions known (key -> equivalent) in the order they became known, from the `since`-th
        on: ``n = len(judge)`` before some work, ``judge.decisions(n)`` after it is what that work added."""
        return dict(itertools.islice(self._memo.items(), since, None))

    def merge(self, decisions: dict[str, bool]) -> int:
        """Add decisions made elsewhere by the same judge (keys from `key`); new ones are persisted
        too. Returns how many were new."""
        new = {k: bool(v) for k, v in decisions.items() if k not in self._memo}
        if new:
            self._memo.update(new)
            self._append(new)
        return len(new)

    def _load(self) -> None:
        raw = self.cache_path.read_bytes()
        complete = raw.rfind(b"\n") + 1
        if complete < len(raw):
            # A partial last line from a crash: drop it so the next append starts on a fresh line.
            log.warning("CachedJudge: dropping a truncated last line of %s", self.cache_path)
            with open(self.cache_path, "r+b") as f:
                f.truncate(complete)
        for line in raw[:complete].decode("utf-8", errors="replace").splitlines():
            record = _parse_record(line)
            if record is None:
                if line.strip():
                    self.skipped_lines += 1
                continue
            self._memo[record[0]] = record[1]
        if self.skipped_lines:
            log.warning("CachedJudge: skipped %d unreadable line(s) in %s", self.skipped_lines, self.cache_path)

    def _append(self, decisions: dict[str, bool]) -> None:
        if self.cache_path is None:
            return
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        lines = "".join(json.dumps({"key": k, "equivalent": v}) + "\n" for k, v in decisions.items())
        with open(self.cache_path, "a", encoding="utf-8") as f:
            f.write(lines)
            f.flush()


def _parse_record(line: str) -> tuple[str, bool] | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict):
        return None
    key, value = record.get("key"), record.get("equivalent")
    if not isinstance(key, str) or not isinstance(value, bool):
        return None
    return key, value


# ------------------------------------------------------------------------------------------- factory

JUDGE_KINDS = {"nli": NLIJudge, "embedding": EmbeddingNumberJudge}


def make_judge(kind: str, cache_path: str | os.PathLike | None = None, **kwargs) -> EquivalenceJudge:
    """Build a judge by kind ("nli" | "embedding"); kwargs go to its constructor. With cache_path the
    judge is wrapped in a persistent `CachedJudge`."""
    if kind not in JUDGE_KINDS:
        raise ValueError(f"unknown judge kind {kind!r}; choose one of {sorted(JUDGE_KINDS)}")
    judge = JUDGE_KINDS[kind](**kwargs)
    return CachedJudge(judge, cache_path) if cache_path is not None else judge
