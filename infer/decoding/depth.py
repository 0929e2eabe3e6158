"""gamma=adaptive: the lookahead depth of each cycle chosen from predicted acceptance (`probes.adaptive_gamma`).

The decoding loops ask `AdaptiveDepth` two things: after each drafted step (or multi-branch level), whether to
draft one more (`keep`), and when drafting stopped, how many drafted steps to keep (`kept`; 0 drops the draft
and the target writes the step). With the forecast skip (`DecodeOptions.forecast_skip`) they also ask, before
drafting, whether a cycle forecast at the last estimate pays at all (`pays`). Estimates come from an
`AcceptanceEstimator` (the acceptance probe, or the system-speed simulation); the costs c, b(rows) and v(k) come
from the config when given, else they are measured once per engine pair and cycle shape on a calibration
problem (`measure_costs`): median wall time of `repeats` calls per shape after one untimed call, as the
benchmarks measure b(k).
"""
from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specprobe.infer.acceptance_estimate import AcceptanceEstimator
from specprobe.infer.engines.base import Prefix, SamplingParams, Step, StepRequest
from specprobe.probes.adaptive_gamma import (
    CycleCosts,
    forecast_pays,
    keep_drafting,
    kept_depth,
    level_acceptance,
    tree_rows,
)

CALIBRATION_QUESTION = "Calibration (not timed): a train travels 60 km in 45 minutes. What is its speed in km/h?"
# Calibration steps end here, i.e. at the token cap: a real model ends its first step wherever it writes the
# runtime's delimiter, and the draft's and the target's steps of unequal length would make c, b and v ratios
# of lengths as well as of speeds
CALIBRATION_DELIMITER = "\n<end of calibration step>\n"


@dataclass
class AdaptiveDepth:
    """The per-cycle depth policy of one engine pair: gamma_max caps it (DecodeOptions.gamma)."""

    estimator: AcceptanceEstimator
    c: float | None = None  # draft step / target step; None: measured
    b: Sequence[float] | None = None  # b(rows) at index rows - 1 (Lookahead Reasoning); None: measured
    v: Sequence[float] | None = None  # v(k) at index k - 1 (SemanticSpec's teacher-forced pass); None: measured
    repeats: int = 3
    _measured: dict = field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def costs(self, kind: str, width: int, gamma_max: int, target, draft, params: SamplingParams) -> CycleCosts:
        """The cycle's costs: configured values where given, the rest measured once (and kept)."""
        need_b = kind == "lookahead" and self.b is None
        need_v = kind == "semanticspec" and self.v is None
        if self.c is not None and not need_b and not need_v:
            return CycleCosts(self.c, self.b, self.v, kind, width)
        rows = tree_rows(width, gamma_max) if need_b else 1
        # keyed by the models, not the engine objects: a wrapper made per generation (+lookahead) reuses it
        key = (target.info.model_id, draft.info.model_id, kind, rows, gamma_max if need_v else 0)
        with self._lock:
            if key not in self._measured:
                self._measured[key] = measure_costs(target, draft, params, rows, gamma_max if need_v else 0,
                                                    self.repeats)
            c, b, v = self._measured[key]
        return CycleCosts(self.c if self.c is not None else c, b if need_b else self.b, v if need_v else self.v,
                          kind, width)

    def estimate(self, prefix: Prefix, step: Step) -> float:
        return float(self.estimator.estimate(prefix, step))

    @staticmethod
    def keep(estimates: Sequence[float], costs: CycleCosts, gamma_max: int) -> bool:
        return keep_drafting(estimates, costs, gamma_max)

    @staticmethod
    def pays(forecast: float, costs: CycleCosts, gamma_max: int, drafted: int = 0) -> bool:
        return forecast_pays(forecast, costs, gamma_max, drafted)

    @staticmethod
    def kept(estimates: Sequence[float], costs: CycleCosts, gamma_max: int) -> int:
        return kept_depth(estimates, costs, gamma_max)

    @staticmethod
    def level(estimates: Sequence[float], width: int) -> float:
        return level_acceptance(estimates, width)

    def describe(self) -> dict:
        return {"estimator": self.estimator.name, "c": self.c, "b": None if self.b is None else list(self.b),
                "v": None if self.v is None else list(self.v),
                "measured": [{"rows": k[3], "c": c, "b": b, "v": v} for k, (c, b, v) in self._measured.items()]}


def median_seconds(call, repeats: int, warmup: int = 1) -> float:
    """The median wall time of `repeats` calls, after `warmup` untimed ones (lazy initialisation, kernel choice,
    graph capture)."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def nested_step_seconds(engine, prefix: Prefix, params: SamplingParams, rows: Sequence[int], repeats: int = 3,
                        filler: str = "Next.", sync: Callable[[], None] | None = None) -> dict[int, float]:
    """For each k of `rows`: the median wall time (`median_seconds`) of one step decoded for k rows, each after a
    prefix of its own, nested as a Lookahead batch's are (`prefix`, then `prefix` with one, two, ... `filler`
    steps). b(k) is its value at k over its value at one row (`measure_costs`; benchmarks/bench_runtime.py).
    sync: called after each call, inside the timing (a device's queued work, such as the kept KV's copies)."""
    def call(k: int):
        requests = [StepRequest(prefix.extend(*[filler] * j), 1, params.seed, params.max_step_tokens)
                    for j in range(k)]

        def run():
            engine.generate(requests, params)
            if sync is not None:
                sync()
        return run

    return {k: median_seconds(call(k), repeats) for k in rows}


def measure_costs(target, draft, params: SamplingParams, rows: int, chain: int, repeats: int = 3
                  ) -> tuple[float, list[float], list[float]]:
    """(c, [b(1..rows)], [v(1..chain)]) on the calibration question, in units of one target step of one row.
    Steps run to the step-token cap the runtime uses (greedy, seed 0, a delimiter no model writes), so the steps
    timed have one length unless a model ends its answer (EOS) first; the chain scored for v is the draft's own
    first step repeated."""
    prefix = Prefix(CALIBRATION_QUESTION, (), params.delimiter)
    greedy = SamplingParams(temperature=0.0, top_p=1.0, max_step_tokens=params.max_step_tokens,
                            delimiter=CALIBRATION_DELIMITER, seed=0)
    steps = nested_step_seconds(target, prefix, greedy, range(1, rows + 1), repeats)
    one = steps[1]
    c = nested_step_seconds(draft, prefix, greedy, [1], repeats)[1] / one
    b = [steps[k] / one for k in range(1, rows + 1)]
    v = []
    if chain:
        text = draft.generate([StepRequest(prefix, 1, 0, greedy.max_step_tokens)], greedy).steps[0][0].text or "Next."
        v = [median_seconds(lambda k=k: target.score_chain(prefix, [text] * k, hidden=True), repeats) / one
             for k in range(1, chain + 1)]
    return c, b, v
