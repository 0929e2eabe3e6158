"""What every decoding run measures, and the per-cycle trace.

`RunStats` is additive: `merge` sums two runs (e.g. all problems of one method). Definitions:
- acceptance rate = accepted draft steps / judged draft steps, where a step is *judged* when the cycle
  reaches its position (every position up to and including the first failure; with W branches a
  position counts once and passes if any branch passes). Also per lookahead position.
- Ratio (SemanticSpec) = share of output tokens written by the target.
- c inputs: draft seconds per generated draft token and target seconds per decode iteration (one
  iteration = one forward of a target batch, whatever its number of rows).
The trace is a list of JSON-able dicts, one per cycle; `replay_text` rebuilds the output from it and
`stats_from_trace` recounts the acceptance, so a run can be checked from its trace alone.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path


def _grow(values: list[int], n: int) -> None:
    values.extend([0] * (n - len(values)))


@dataclass
class RunStats:
    method: str = ""
    problems: int = 0
    cycles: int = 0
    output_steps: int = 0
    output_tokens: int = 0
    target_tokens: int = 0  # output tokens written by the target
    draft_tokens: int = 0  # output tokens written by the draft (accepted drafts)
    judged_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    latency_s: float = 0.0
    draft_time_s: float = 0.0
    target_time_s: float = 0.0  # target generation (batched steps)
    score_time_s: float = 0.0  # teacher-forced passes (SemanticSpec, probe features)
    verify_time_s: float = 0.0
    draft_calls: int = 0
    draft_steps: int = 0  # draft steps generated (accepted or not)
    draft_steps_reused: int = 0  # SemanticSpec, gamma=adaptive: drafts past a kept depth reused next cycle
    draft_generated_tokens: int = 0
    draft_iterations: int = 0
    draft_row_iterations: int = 0  # sum over draft forwards of the rows in them
    target_calls: int = 0
    target_rows: int = 0
    target_generated_tokens: int = 0
    target_iterations: int = 0
    target_row_iterations: int = 0  # sum over target forwards of the rows in them
    target_forward_passes: int = 0
    draft_forward_passes: int = 0
    target_prefill_tokens: int = 0  # prompt tokens the target ran through the model (cache hits excluded)
    draft_abandoned: int = 0  # async: drafts cut short because a rejection made them useless
    draft_abandoned_s: float = 0.0
    spec_rounds: int = 0  # token-level speculation inside the written steps (target; draft-only: draft): rounds with a proposal
    spec_proposed: int = 0
    spec_accepted: int = 0
    stop_reasons: dict = field(default_factory=dict)
    decided: int = 0  # draft steps a verifier ruled on (refused ones: capped, empty, after a cut, are not)
    decided_accepted: int = 0
    refused: int = 0  # draft steps rejected without asking the verifier
    # gamma=adaptive: cycles by the depth they drafted and by the depth they kept (index = depth; kept 0 = the
    # drafts were dropped and the target wrote the step; drafted 0 = the forecast skip drafted nothing; a draft
    # reused by the next cycle counts in both cycles' drafted depth, once in draft_steps), and the time spent
    # estimating acceptance
    depth_drafted: list[int] = field(default_factory=list)
    depth_kept: list[int] = field(default_factory=list)
    estimate_time_s: float = 0.0

    # ------------------------------------------------------------------ recording
    def record_decisions(self, verdicts) -> None:
        """Count verdicts the verifier returned (each one a decided draft step)."""
        for v in verdicts:
            self.decided += 1
            self.decided_accepted += int(v.accepted)

    def record_depth(self, drafted: int, kept: int) -> None:
        """One adaptive cycle: how deep it drafted and how deep it kept."""
        _grow(self.depth_drafted, drafted + 1)
        _grow(self.depth_kept, kept + 1)
        self.depth_drafted[drafted] += 1
        self.depth_kept[kept] += 1

    def record_position(self, position: int, accepted: bool) -> None:
        _grow(self.judged_by_position, position + 1)
        _grow(self.accepted_by_position, position + 1)
        self.judged_by_position[position] += 1
        self.accepted_by_position[position] += int(accepted)

    def merge(self, other: RunStats) -> RunStats:
        out = RunStats(method=self.method or other.method)
        for f in fields(RunStats):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "method":
                continue
            if isinstance(a, list):
                n = max(len(a), len(b))
                setattr(out, f.name, [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)])
            elif isinstance(a, dict):
                merged = dict(a)
                for k, v in b.items():
                    merged[k] = merged.get(k, 0) + v
                setattr(out, f.name, merged)
            else:
                setattr(out, f.name, a + b)
        return out

    # ------------------------------------------------------------------ derived
    @property
    def judged(self) -> int:
        return sum(self.judged_by_position)

    @property
    def accepted(self) -> int:
        return sum(self.accepted_by_position)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.judged if self.judged else None

    @property
    def acceptance_by_position(self) -> list[float | None]:
        return [a / j if j else None for a, j in zip(self.accepted_by_position, self.judged_by_position)]

    @property
    def mean_accepted_per_cycle(self) -> float | None:
        return self.accepted / self.cycles if self.cycles else None

    @property
    def ratio(self) -> float | None:
        """Share of output tokens written by the target (SemanticSpec's Ratio)."""
        return self.target_tokens / self.output_tokens if self.output_tokens else None

    @property
    def tokens_per_second(self) -> float | None:
        return self.output_tokens / self.latency_s if self.latency_s > 0 else None

    @property
    def draft_time_per_token(self) -> float | None:
        return self.draft_time_s / self.draft_iterations if self.draft_iterations else None

    @property
    def target_time_per_iteration(self) -> float | None:
        return self.target_time_s / self.target_iterations if self.target_iterations else None

    @property
    def mean_target_rows(self) -> float | None:
        """Rows per target batch call (sync: k of the formulas, as run; async: rows per join)."""
        return self.target_rows / self.target_calls if self.target_calls else None

    @property
    def mean_rows_per_forward(self) -> float | None:
        """Rows in an average target forward (the batch size the target actually ran at)."""
        return self.target_row_iterations / self.target_iterations if self.target_iterations else None

    @property
    def mean_depth_kept(self) -> float | None:
        """gamma=adaptive: the mean lookahead depth its cycles kept (None when the run had no policy)."""
        n = sum(self.depth_kept)
        return sum(k * c for k, c in enumerate(self.depth_kept)) / n if n else None

    @property
    def spec_acceptance(self) -> float | None:
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else None

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in ("judged", "accepted", "acceptance_rate", "acceptance_by_position", "mean_accepted_per_cycle",
                     "ratio", "tokens_per_second", "draft_time_per_token", "target_time_per_iteration",
                     "mean_target_rows", "mean_rows_per_forward", "spec_acceptance", "mean_depth_kept"):
            d[name] = getattr(self, name)
        return d


# ----------------------------------------------------------------------------- trace
def write_trace(path: str | Path, records: Iterable[dict], mode: str = "w") -> None:
    """One JSON object per line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open(mode, encoding="utf-8") as fh:
        for rec in records:
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")


def read_trace(path: str | Path) -> list[dict]:
    with Path(path).open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def join_steps(texts: Sequence[str]) -> str:
    """The output text: the steps as they were written, one after the other (a step that stopped on the
    delimiter ends with it; a step cut by the token cap is continued as it is)."""
    return "".join(texts)


def replay_text(records: Sequence[dict], problem: str | None = None) -> str:
    """Rebuild the output of one generation from its trace (records of one problem, in order)."""
    texts = [c["text"] for rec in records if problem is None or rec.get("problem") == problem
             for c in rec["committed"]]
    return join_steps(texts)


def stats_from_trace(records: Sequence[dict]) -> RunStats:
    """Recount cycles, judged/accepted positions, decided and refused draft steps and token sources from a trace."""
    stats = RunStats()
    # async records one position per line; its cycles (stages between rejections) share an id
    stats.cycles = len({(rec.get("problem"), rec.get("method"), rec["cycle"]) for rec in records})
    for rec in records:
        for pos in rec.get("positions", []):
            stats.record_position(pos["position"], pos["accepted"])
        for step in rec.get("drafts", []):
            verdict = step.get("verdict")
            if verdict is None:  # not reached (after a rejection)
                continue
            if "reason" in verdict:  # `common.refused`: rejected without asking the verifier
                stats.refused += 1
            else:
                stats.decided += 1
                stats.decided_accepted += int(verdict["accepted"])
        for c in rec["committed"]:
            stats.output_steps += 1
            stats.output_tokens += c["tokens"]
            if c["source"] == "target":
                stats.target_tokens += c["tokens"]
            else:
                stats.draft_tokens += c["tokens"]
    return stats
