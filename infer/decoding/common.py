"""State and helpers shared by the decoding loops.

Seeding. Every random choice is keyed by what it is about, not by how many draws came before: a step
generated after prefix text P by role R uses seed `seed_for(seed, R, P, branch)`, and the acceptance
draw for the draft at the position after P uses `seed_for(seed, "accept", P, branch)` (with
`accept_draws="position"`, P is the question and the number of steps instead). Hence a run is
reproducible from one seed whatever the thread timing (async), and two methods that reach the same
prefix make the same target step there: with reject-all every method asks the target for exactly the
steps target-only asks for (same prefix token ids, same seed), under sampling as well as greedy. The
outputs are then equal up to the floating-point differences of an engine's batched kernels (exactly
equal on an engine whose rows do not depend on their batch; tests/test_runtime_toy.py).

Limits. A step is cut at min(max_step_tokens, tokens left, room left in the models' context windows), so no
output exceeds max_new_tokens (counted in target tokens) and no prefix outgrows a window; after max_steps steps
the generation stops. The stop reason is "eos", "max_new_tokens", "max_steps" or "max_length" (a window is full).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from specprobe.infer.answers import extract_boxed
from specprobe.infer.decoding.metrics import RunStats, join_steps
from specprobe.infer.engines.base import DEFAULT_STEP_DELIMITER, EngineStats, Prefix, SamplingParams, Step, StepRequest
from specprobe.infer.verifiers import Verdict

STOP_REASONS = ("eos", "max_new_tokens", "max_steps", "max_length")  # max_length: a model's context window is full
ACCEPT_DRAWS = ("prefix", "position")


@dataclass
class DecodeOptions:
    """Runtime settings of one generation (see RuntimeConfig for the YAML side)."""

    gamma: int = 3  # draft steps per cycle (lookahead depth)
    width: int = 1  # draft branches per position (multi-branch LR)
    max_new_tokens: int = 512
    max_steps: int = 40
    seed: int = 0
    accept_length_cut: bool = False  # a draft cut by the step-token cap may be accepted (system-speed only)
    # Lookahead Reasoning's public rule (ignore_half_sentence): a draft whose prefix ends in a step cut by the
    # token cap is never judged, since verifiers and probes learn on whole steps. True judges such drafts.
    judge_after_cut: bool = False
    refuse_boxed: bool = False  # refuse drafts that write a \boxed{} answer (in no paper or public code)
    target_params: SamplingParams = field(default_factory=SamplingParams)
    draft_params: SamplingParams | None = None  # None: same as target_params
    keep_trace: bool = True
    # gamma=adaptive (infer.decoding.depth.AdaptiveDepth): each cycle drafts as deep as predicted acceptance pays,
    # gamma is then the cap (gamma_max). None: every cycle drafts gamma steps.
    depth: Any = None
    # with depth: a sync cycle whose steps, forecast at the last estimate known, would not pay drafts nothing; the
    # target writes the step and the draft's estimate of that step (one teacher-forced draft pass with the
    # acceptance probe, booked as estimate time) is the next forecast: no draft generation on hard stretches
    forecast_skip: bool = False
    # what an acceptance draw is keyed by (ACCEPT_DRAWS): the prefix's text, or the question and the answer position
    # (common random numbers: every method draws the same at a position, whatever text it wrote before)
    accept_draws: str = "prefix"

    def __post_init__(self) -> None:
        if self.accept_draws not in ACCEPT_DRAWS:
            raise ValueError(f"accept_draws must be one of {ACCEPT_DRAWS}, got {self.accept_draws!r}")
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
        if self.width > 1 and self.draft_params.temperature == 0:
            raise ValueError(
                f"multi-branch drafting (width={self.width}) needs a sampling draft: at temperature 0 all "
                f"{self.width} branches would be the same step. Set the draft temperature above 0 "
                "(sampling.draft_temperature) or use width=1")

    @property
    def delimiter(self) -> str:
        return self.target_params.delimiter

    def replace(self, **kw) -> DecodeOptions:
        from dataclasses import replace

        return replace(self, **kw)


@dataclass
class OutputStep:
    text: str
    source: str  # "target" | "draft"
    tokens: int  # in target tokens
    stop_reason: str  # the step's own: delimiter | eos | length
    token_ids: list[int] = field(default_factory=list)  # as written, in the writer's tokenizer

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
    delimiter: str = DEFAULT_STEP_DELIMITER

    @property
    def text(self) -> str:
        return join_steps([s.text for s in self.steps])

    @property
    def step_texts(self) -> list[str]:
        return [s.text for s in self.steps]

    def to_dict(self) -> dict:
        return {"method": self.method, "question": self.question, "text": self.text, "stop_reason": self.stop_reason,
                "steps": [s.to_dict() for s in self.steps], "stats": self.stats.to_dict()}


class GenState:
    """The committed output of one generation, its limits and its statistics.

    Committed steps are kept as the engines generated them (`Step`, with token ids), so each engine
    conditions on its own tokens for the steps it wrote and never re-tokenises them (see
    `infer.engines.base.Prefix`)."""

    def __init__(self, question: str, target, draft, opts: DecodeOptions, method: str):
        if not isinstance(question, str) or not question.strip():
            raise ValueError("empty prompt: the question text is empty")
        self.question, self.target, self.draft, self.opts = question, target, draft, opts
        self.steps: list[OutputStep] = []
        self.committed: list[Step] = []
        for engine in (target, draft):
            if engine is not None:  # fail before any work when the prompt does not fit
                engine.check_fits(self.prefix(), 1)
        self.tokens_used = 0
        self.stop_reason: str | None = None
        self.stats = RunStats(method=method, problems=1)
        self.trace: list[dict] = []
        # gamma=adaptive: the last estimate of a draft that could be accepted, or of a step the target wrote in a
        # skipped cycle (see forecast_skip); a refused draft's 0 says nothing about how hard the position is
        self.forecast: float | None = None
        self._same_tok = draft is None or draft.info.tokenizer_id == target.info.tokenizer_id
        self._room = self.room(self.prefix())
        self._t0 = time.perf_counter()

    # ------------------------------------------------------------------ views
    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def texts(self, extra: Sequence[Step] = ()) -> list[str]:
        return [s.text for s in self.steps] + [s.text for s in extra]

    def prefix(self, extra: Sequence[Step] = ()) -> Prefix:
        """The committed output followed by `extra` (uncommitted draft steps), as the engines see it."""
        return Prefix(self.question, tuple(self.committed) + tuple(extra), self.opts.delimiter)

    def key(self, prefix: Prefix) -> str:
        """What seeds are keyed by: the prefix's text (the same for every method that reaches it)."""
        return "\x1e".join([prefix.question] + prefix.step_texts())

    def accept_key(self, prefix: Prefix) -> str:
        """What the acceptance draw of the draft after `prefix` is keyed by (`DecodeOptions.accept_draws`)."""
        if self.opts.accept_draws == "position":
            return f"{prefix.question}\x1e#{len(prefix.steps)}"
        return self.key(prefix)

    @property
    def steps_left(self) -> int:
        return self.opts.max_steps - len(self.steps)

    def cap(self, extra_tokens: int = 0) -> int:
        """Token cap of a step written after the committed output plus `extra_tokens` more: the step cap, what is
        left of max_new_tokens, and what is left of the models' context windows."""
        cap = min(self.opts.target_params.max_step_tokens, self.opts.max_new_tokens - self.tokens_used - extra_tokens)
        return cap if self._room is None else min(cap, self._room - extra_tokens)

    def room(self, prefix: Prefix) -> int | None:
        """Tokens that still fit after `prefix` in the smaller context window of the two models (None: no window
        known). Each engine counts its own prefix; a draft with another tokenizer counts the steps after it in
        target tokens, an estimate."""
        rooms = [e.info.max_length - len(e.prefix_ids(prefix)) for e in (self.target, self.draft)
                 if e is not None and e.info.max_length]
        return min(rooms) if rooms else None

    def count_tokens(self, step: Step, engine) -> int:
        """A step's length in target tokens."""
        if engine is self.target or self._same_tok:
            return step.num_tokens
        return self.target.count_tokens(step.text)

    # ------------------------------------------------------------------ commit
    def commit(self, step: Step, source: str, tokens: int) -> OutputStep:
        if self.done:
            raise RuntimeError("commit after the generation ended")
        out = OutputStep(step.text, source, tokens, step.stop_reason, list(step.token_ids))
        self.steps.append(out)
        self.committed.append(step)
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
        else:
            self._room = self.room(self.prefix())
            if self._room is not None and self._room < 1:  # the answer fills a context window: it ends here
                self.stop_reason = "max_length"
        return out

    def unacceptable(self, step: Step) -> str | None:
        """Why this draft step may not be accepted whatever the verifier says, or None.

        "length": cut by the token cap (LR's rule; allowed with accept_length_cut, for system-speed runs
        where random-weight models rarely write the delimiter). "after cut step": the committed step before it
        was cut by the cap, so the draft continues a half sentence (LR's public `ignore_half_sentence`, on
        unless judge_after_cut; with accept_length_cut a cut step counts as whole, so it is off too). "ends
        answer": it ends the answer (EOS) — the answer always ends on the target's own step at that position.
        "boxed answer": it writes a \\boxed{} answer (only with refuse_boxed)."""
        opts = self.opts
        if step.stop_reason == "length" and not opts.accept_length_cut:
            return "length"
        if (self.committed and self.committed[-1].stop_reason == "length" and not opts.judge_after_cut
                and not opts.accept_length_cut):
            return "after cut step"
        if self.ends_answer(step):
            return "ends answer"
        if opts.refuse_boxed and extract_boxed(step.text) is not None:
            return "boxed answer"
        return None

    @staticmethod
    def ends_answer(step: Step | None) -> bool:
        """The step ends the answer (EOS). Only the target ends it: a draft that would is refused ("ends answer"),
        and a target step that does is committed without judging the drafts at its position (LR's public
        run_problem stops on the target's EOS before it reads a verdict), so the answer ends where the target
        ended it."""
        return step is not None and step.stop_reason == "eos"

    def acceptable(self, step: Step) -> bool:
        return self.unacceptable(step) is None

    # ------------------------------------------------------------------ engine calls (timed)
    def generate(self, engine, role: str, prefixes: Sequence[Prefix], seeds: Sequence[int], caps: Sequence[int],
                 params: SamplingParams) -> list[Step]:
        """One step after each prefix in one engine call; its work is booked under `role` (target | draft)."""
        requests = [StepRequest(p, 1, s, int(c)) for p, s, c in zip(prefixes, seeds, caps)]
        out = engine.generate(requests, params)
        steps = [r[0] for r in out.steps]
        self.book(role, out.stats, len(requests), calls=1)
        return steps

    def score(self, engine, role: str, prefix: Prefix, texts: Sequence[str], *, chain: bool = False,
              hidden: bool = True, layers=None) -> list:
        """Teacher-forced pass (`score` or `score_chain`) booked as scoring time and `role`'s forward passes."""
        call = engine.score_chain if chain else engine.score
        out = call(prefix, texts, hidden=hidden, layers=layers)
        self.stats.score_time_s += out.stats.seconds
        self._book_passes(role, out.stats)
        return out.steps

    def _book_passes(self, role: str, es: EngineStats) -> None:
        st = self.stats
        if role == "target":
            st.target_forward_passes += es.forward_passes
            st.target_prefill_tokens += es.prefill_tokens
            st.draft_forward_passes += es.proposer_forward_passes  # the assistant is the draft model
        else:
            st.draft_forward_passes += es.forward_passes + es.proposer_forward_passes
        # token speculation inside the steps that are written: the target's, or the draft's when it writes every
        # step (draft-only: no draft beside it). A drafting engine's own (vLLM starts both with ngram) is left out.
        if role == "target" or self.draft is None:
            st.spec_rounds += es.spec_rounds
            st.spec_proposed += es.spec_proposed
            st.spec_accepted += es.spec_accepted

    def book(self, role: str, es: EngineStats, rows: int, calls: int, seconds: float | None = None) -> None:
        """Add one engine call's (or stream iteration's) work under `role`."""
        st = self.stats
        seconds = es.seconds if seconds is None else seconds
        if role == "target":
            st.target_time_s += seconds
            st.target_calls += calls
            st.target_rows += rows
            st.target_generated_tokens += es.generated_tokens
            st.target_iterations += es.iterations
            st.target_row_iterations += es.row_iterations
        else:
            st.draft_time_s += seconds
            st.draft_calls += calls
            st.draft_steps += rows
            st.draft_generated_tokens += es.generated_tokens
            st.draft_iterations += es.iterations
            st.draft_row_iterations += es.row_iterations
        self._book_passes(role, es)

    def finish(self, method: str) -> GenerationResult:
        st = self.stats
        st.latency_s = time.perf_counter() - self._t0
        st.stop_reasons = {self.stop_reason: 1}
        return GenerationResult(method, self.question, self.steps, self.stop_reason, st, self.trace,
                                self.opts.delimiter)

    def estimate(self, prefix: Prefix, step: Step, written: bool = False) -> float:
        """The depth policy's acceptance estimate of a draft step (0 for one that may not be accepted), timed.
        written: a step the target wrote, estimated only as the forecast of the next draft (no draft rule
        applies to it)."""
        if not written and not self.acceptable(step):
            return 0.0
        t0 = time.perf_counter()
        value = self.opts.depth.estimate(prefix, step)
        self.stats.estimate_time_s += time.perf_counter() - t0
        return value

    def skip_drafting(self, costs, gamma: int) -> bool:
        """gamma=adaptive with forecast_skip: do cycles of `gamma` steps, each forecast at the last estimate
        known, not pay? (Never before the first estimate: the first cycle drafts to learn one.)"""
        return (costs is not None and self.opts.forecast_skip and self.forecast is not None
                and not self.opts.depth.pays(self.forecast, costs, gamma))

    def forecast_written(self, prefix: Prefix, step: Step, width: int = 1) -> float:
        """A skipped cycle has no draft to estimate: the step the target wrote after `prefix`, scored by the draft
        (its level acceptance for W branches), is the next cycle's forecast."""
        self.forecast = self.opts.depth.level([self.estimate(prefix, step, written=True)], width)
        return self.forecast

    def add_trace(self, record: dict) -> None:
        if self.opts.keep_trace:
            self.trace.append(record)


def check_verifier(verifier, draft) -> None:
    """Speculative methods need a verifier and a draft engine."""
    if verifier is None:
        raise ValueError("speculative decoding needs a verifier (see infer.verifiers.build_verifier)")
    if draft is None:
        raise ValueError("speculative decoding needs a draft engine")


def refused(reason: str) -> Verdict:
    """The verdict on a draft step that may not be accepted whatever the verifier says."""
    return Verdict(False, float("nan"), 0.0, {"reason": reason})


def step_record(step: Step, tokens: int | None = None, **extra) -> dict:
    return {"text": step.text, "stop": step.stop_reason, "tokens": step.num_tokens if tokens is None else tokens,
            **extra}
