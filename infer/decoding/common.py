"""State and helpers shared by the decoding loops.

Seeding. Every random choice is keyed by what it is about, not by how many draws came before: a step
generated after prefix text P by role R uses seed `seed_for(seed, R, P, branch)`, and the acceptance
draw for the draft at the position after P uses `seed_for(seed, "accept", P, branch)`. Hence a run is
reproducible from one seed whatever the thread timing (async), and two methods that reach the same
prefix make the same target step there — with reject-all every method writes exactly the target-only
output, under sampling as well as greedy.

Limits. A step is cut at min(max_step_tokens, tokens left), so no output exceeds max_new_tokens
(counted in target tokens); after max_steps steps the generation stops. The stop reason is "eos",
"max_new_tokens" or "max_steps".
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Sequence

from infer.engines.base import SamplingParams, Step
from infer.engines.token_spec import same_tokenizer
from infer.decoding.metrics import RunStats, join_steps

STOP_REASONS = ("eos", "max_new_tokens", "max_steps")


def seed_for(seed: int, *parts) -> int:
    """A 63-bit seed derived from a base seed and any parts (strings, ints): stable across runs."""
    digest = hashlib.blake2b(repr((int(seed),) + tuple(parts)).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@dataclass
class DecodeOptions:
    """Runtime settings of one generation (see RuntimeConfig for the YAML side)."""

    gamma: int = 3  # draft steps per cycle (lookahead depth)
    width: int = 1  # draft branches per position (multi-branch LR)
    max_new_tokens: int = 512
    max_steps: int = 40
    seed: int = 0
    accept_length_cut: bool = False  # a draft cut by the step-token cap may be accepted (system-speed only)
    target_params: SamplingParams = field(default_factory=SamplingParams)
    draft_params: SamplingParams | None = None  # None: same as target_params
    keep_trace: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.gamma, int) or self.gamma < 1:
            raise ValueError(f"gamma (draft steps per cycle) must be an int >= 1, got {self.gamma!r}")
        if not isinstance(self.width, int) or self.width < 1:
            raise ValueError(f"width (draft branches per position) must be an int >= 1, got {self.width!r}")
        if self.max_new_tokens < 1 or self.max_steps < 1:
            raise ValueError(f"max_new_tokens and max_steps must be >= 1, got {self.max_new_tokens}, {self.max_steps}")
        if self.draft_params is None:
            self.draft_params = self.target_params
        if self.draft_params.delimiter != self.target_params.delimiter:
            raise ValueError("draft and target must split steps on the same delimiter")

    @property
    def delimiter(self) -> str:
        return self.target_params.delimiter

    def replace(self, **kw) -> "DecodeOptions":
        from dataclasses import replace

        return replace(self, **kw)


@dataclass
class OutputStep:
    text: str
    source: str  # "target" | "draft"
    tokens: int  # in target tokens
    stop_reason: str  # the step's own: delimiter | eos | length

    def to_dict(self) -> dict:
        return {"text": self.text, "source": self.source, "tokens": self.tokens, "stop": self.stop_reason}


@dataclass
class GenerationResult:
    method: str
    question: str
    steps: list[OutputStep]
    stop_reason: str
    stats: RunStats
    trace: list[dict]
    delimiter: str = "\n\n"

    @property
    def text(self) -> str:
        return join_steps([s.text for s in self.steps], self.delimiter)

    @property
    def step_texts(self) -> list[str]:
        return [s.text for s in self.steps]

    def to_dict(self) -> dict:
        return {"method": self.method, "question": self.question, "text": self.text, "stop_reason": self.stop_reason,
                "steps": [s.to_dict() for s in self.steps], "stats": self.stats.to_dict()}


class GenState:
    """The committed output of one generation and its limits."""

    def __init__(self, question: str, target, draft, opts: DecodeOptions, method: str):
        if not isinstance(question, str) or not question.strip():
            raise ValueError("empty prompt: the question text is empty")
        for engine in (target, draft):
            if engine is not None:  # fail before any work when the prompt does not fit
                ids = engine.encode_prefix(engine.format_prefix(question))
                engine._check_fits(len(ids) + 1, "the prompt")
        self.question, self.target, self.draft, self.opts = question, target, draft, opts
        self.steps: list[OutputStep] = []
        self.tokens_used = 0
        self.stop_reason: str | None = None
        self.stats = RunStats(method=method, problems=1)
        self.trace: list[dict] = []
        self._same_tok = draft is None or same_tokenizer(draft.tokenizer, target.tokenizer)
        self._t0 = time.perf_counter()
        self._fp0 = {id(e): dict(e.stats) for e in (target, draft) if e is not None}

    # ------------------------------------------------------------------ views
    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def texts(self, extra: Sequence[str] = ()) -> list[str]:
        return [s.text for s in self.steps] + list(extra)

    def prefix(self, engine, extra: Sequence[str] = ()) -> str:
        return engine.format_prefix(self.question, self.texts(extra), self.opts.delimiter)

    @property
    def steps_left(self) -> int:
        return self.opts.max_steps - len(self.steps)

    def cap(self, extra_tokens: int = 0) -> int:
        """Token cap of a step written after the committed output plus `extra_tokens` more."""
        return min(self.opts.target_params.max_step_tokens, self.opts.max_new_tokens - self.tokens_used - extra_tokens)

    def count_tokens(self, step: Step, engine) -> int:
        """A step's length in target tokens."""
        if engine is self.target or self._same_tok:
            return step.num_tokens
        return len(self.target.encode_step(step.text))

    # ------------------------------------------------------------------ commit
    def commit(self, step: Step, source: str, tokens: int) -> OutputStep:
        if self.done:
            raise RuntimeError("commit after the generation ended")
        out = OutputStep(step.text, source, tokens, step.stop_reason)
        self.steps.append(out)
        self.tokens_used += tokens
        st = self.stats
        st.output_steps += 1
        st.output_tokens += tokens
        if source == "target":
            st.target_tokens += tokens
        else:
            st.draft_tokens += tokens
        if step.stop_reason == "eos":
            self.stop_reason = "eos"
        elif self.tokens_used >= self.opts.max_new_tokens:
            self.stop_reason = "max_new_tokens"
        elif len(self.steps) >= self.opts.max_steps:
            self.stop_reason = "max_steps"
        return out

    def acceptable(self, step: Step) -> bool:
        """May this draft step be accepted at all? Never when cut by the token cap (LR's rule), unless
        accept_length_cut (system-speed runs, where random-weight models rarely write the delimiter)."""
        return step.stop_reason != "length" or self.opts.accept_length_cut

    # ------------------------------------------------------------------ engine calls (timed)
    def generate(self, engine, role: str, prefixes: Sequence[str], seeds: Sequence[int], caps: Sequence[int],
                 params: SamplingParams) -> list[Step]:
        """Run one batch on `engine` and book its time and size under `role` (target | draft).

        The KV of every finished row is kept (`self.exports[i]`) until the next call, so the loop can hand
        the row whose step it commits to the engine's prefix cache (`keep`)."""
        from infer.engines.decode import RowSpec

        t0 = time.perf_counter()
        batch = engine.open_batch(params, export=True)
        specs = [RowSpec(i, engine.encode_prefix(p), int(c), s) for i, (p, s, c) in enumerate(zip(prefixes, seeds, caps))]
        results = dict(batch.add(specs))
        iterations = 1
        while len(batch):
            results.update(batch.step())
            iterations += 1
        dt = time.perf_counter() - t0
        steps = [results[i] for i in range(len(specs))]
        self.book(role, dt, len(specs), sum(s.num_tokens for s in steps), iterations,
                  batch.row_iterations + len(specs))
        self.exports = (engine, batch.exports)
        return steps

    def keep(self, row: int) -> None:
        """Put the KV of row `row` of the last `generate` call into its engine's prefix cache: the next
        prefix starts with that row's prompt and step, so it is not encoded again."""
        engine, exports = getattr(self, "exports", (None, {}))
        if row in exports:
            engine.remember_prefix(*exports[row])
        self.exports = (None, {})

    def book(self, role: str, seconds: float, rows: int, tokens: int, iterations: int,
             row_iterations: int | None = None) -> None:
        st = self.stats
        if role == "target":
            st.target_time_s += seconds
            st.target_calls += 1
            st.target_rows += rows
            st.target_generated_tokens += tokens
            st.target_iterations += iterations
            st.target_row_iterations += rows if row_iterations is None else row_iterations
        else:
            st.draft_time_s += seconds
            st.draft_calls += 1
            st.draft_steps += rows
            st.draft_generated_tokens += tokens
            st.draft_iterations += iterations

    def finish(self, method: str) -> GenerationResult:
        st = self.stats
        st.latency_s = time.perf_counter() - self._t0
        st.stop_reasons = {self.stop_reason: 1}
        for engine, key in ((self.target, "target_forward_passes"), (self.draft, "draft_forward_passes")):
            if engine is None:
                continue
            before = self._fp0[id(engine)]
            setattr(st, key, engine.stats["forward_passes"] - before["forward_passes"])
            if engine is self.target:
                st.spec_rounds = engine.stats["spec_rounds"] - before["spec_rounds"]
                st.spec_proposed = engine.stats["spec_proposed"] - before["spec_proposed"]
                st.spec_accepted = engine.stats["spec_accepted"] - before["spec_accepted"]
        return GenerationResult(method, self.question, self.steps, self.stop_reason, st, self.trace,
                                self.opts.delimiter)

    def add_trace(self, record: dict) -> None:
        if self.opts.keep_trace:
            self.trace.append(record)


def step_record(step: Step, tokens: int | None = None, **extra) -> dict:
    return {"text": step.text, "stop": step.stop_reason, "tokens": step.num_tokens if tokens is None else tokens,
            **extra}
