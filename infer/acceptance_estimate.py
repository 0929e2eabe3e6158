"""Predicted acceptance of a draft step before the target runs: what the adaptive lookahead depth reads.

Two estimators behind one call, `estimate(prefix, step) -> a` (prefix: the question and every step before
`step`, committed or drafted):
- `ProbeAcceptance`: the checkpoint's acceptance probe (`probe_acceptance`, trained on `prob_under_target`,
  the chance that an equivalence verifier accepts the step) on the draft's own hidden states of its step,
  from one teacher-forced draft pass over the step.
- `SimulatedAcceptance`: system-speed runs (random weights, no meaning): a `LatentDifficulty` gives each
  answer position a hidden class, easy or hard; the Bernoulli verifier accepts with that class's α and the
  estimator sees a noisy, calibrated estimate of it.

LatentDifficulty. Position i of the answer to question Q (i = steps before it) is hard or easy; the class of
position 0 is drawn from the prior (hard with probability hard_share); each next class copies the previous
one with probability `persistence`, else is drawn from the prior again (so the prior is also the share of
hard steps in the long run, and persistence sets the length of easy and hard stretches). The estimator sees
a signal: the true class, replaced with probability `noise` by a fresh draw from the prior. Its estimate is
E[α | signal], calibrated by construction:

    P(hard | signal hard) = (1 - noise) + noise * hard_share,   P(hard | signal easy) = noise * hard_share.

noise 0: a perfect predictor; noise 1: no information (always the mean α). Classes and signals are
drawn from streams seeded by (seed, Q), so every method sees the same difficulties at the same positions.
"""
from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from specprobe.infer import checkpoint_format as ckpt
from specprobe.infer.checkpoint_format import CheckpointError
from specprobe.infer.engines.base import Prefix, Step

ACCEPTANCE_PROBE = "probe_acceptance"


class AcceptanceEstimator(Protocol):
    name: str

    def estimate(self, prefix: Prefix, step: Step) -> float:
        """Predicted probability that `step`, drafted after `prefix`, is accepted."""


# ----------------------------------------------------------------------------- system-speed
@dataclass
class LatentDifficulty:
    """Hidden easy/hard classes of answer positions, their acceptance and a noisy calibrated estimate."""

    easy_alpha: float = 0.6
    hard_alpha: float = 0.6
    hard_share: float = 0.5
    persistence: float = 0.0
    noise: float = 0.0
    seed: int = 0
    _drawn: dict = field(default_factory=dict, init=False, repr=False)  # question -> [(hard, signal_hard)]
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("easy_alpha", "hard_alpha", "hard_share", "persistence", "noise"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"difficulty {name} must be in [0, 1], got {value}")

    def _classes(self, question: str, index: int) -> tuple[bool, bool]:
        if index < 0:
            raise ValueError(f"step index must be >= 0, got {index}")
        with self._lock:  # the async runtime asks from two threads
            drawn = self._drawn.setdefault(question, [])
            if len(drawn) <= index:
                # one generator per question, replayed from the start: positions keep their classes whatever
                # order they are asked in
                rng = random.Random(f"{self.seed}\x1e{question}")
                n = max(index + 1, 2 * len(drawn) + 64)
                drawn.clear()
                hard = None
                for _ in range(n):
                    copy, prior, replace, fresh = rng.random(), rng.random(), rng.random(), rng.random()
                    hard = (prior < self.hard_share) if hard is None or copy >= self.persistence else hard
                    signal = (fresh < self.hard_share) if replace < self.noise else hard
                    drawn.append((hard, signal))
            return drawn[index]

    def is_hard(self, question: str, index: int) -> bool:
        return self._classes(question, index)[0]

    def alpha(self, question: str, index: int) -> float:
        """The acceptance probability of a draft at answer position `index` (the Bernoulli verifier's)."""
        return self.hard_alpha if self.is_hard(question, index) else self.easy_alpha

    def estimate(self, question: str, index: int) -> float:
        """E[α | the signal at this position]: what the simulated acceptance probe reports."""
        signal = self._classes(question, index)[1]
        p_hard = (1 - self.noise) + self.noise * self.hard_share if signal else self.noise * self.hard_share
        return p_hard * self.hard_alpha + (1 - p_hard) * self.easy_alpha

    @property
    def mean_alpha(self) -> float:
        return self.hard_share * self.hard_alpha + (1 - self.hard_share) * self.easy_alpha

    def describe(self) -> dict:
        return {"easy_alpha": self.easy_alpha, "hard_alpha": self.hard_alpha, "hard_share": self.hard_share,
                "persistence": self.persistence, "noise": self.noise, "seed": self.seed}


class SimulatedAcceptance:
    """The system-speed acceptance probe: `LatentDifficulty.estimate` at the step's answer position."""

    name = "simulated"

    def __init__(self, difficulty: LatentDifficulty):
        self.difficulty = difficulty

    def estimate(self, prefix: Prefix, step: Step) -> float:
        return self.difficulty.estimate(prefix.question, len(prefix.steps))


# ----------------------------------------------------------------------------- learned
class ProbeAcceptance:
    """The acceptance probe on the draft's hidden states of its own step (one teacher-forced draft pass)."""

    name = "probe"

    def __init__(self, probe, draft_engine, allow_model_mismatch: bool = False):
        info = draft_engine.info
        try:
            probe.spec.check_compatible(info.num_layers, info.hidden_size, info.model_id,
                                        allow_model_mismatch=allow_model_mismatch)
        except ValueError as err:
            raise CheckpointError(f"{ACCEPTANCE_PROBE} does not fit the draft model: {err}") from None
        self.probe, self.draft = probe, draft_engine

    def estimate(self, prefix: Prefix, step: Step) -> float:
        if not step.text:
            return 0.0  # an empty step is refused whatever a verifier says
        scored = self.draft.score(prefix, [step.text], hidden=True, layers=list(self.probe.spec.layers)).steps[0]
        feats = scored.mean_hidden if self.probe.spec.pooling == "mean" else scored.last_hidden
        with torch.no_grad():
            return float(self.probe.predict_proba(feats.unsqueeze(0))[0])


def load_acceptance_probe(path: str | Path, draft_engine, *, device: str | torch.device = "cpu",
                          allow_model_mismatch: bool = False) -> ProbeAcceptance:
    """The checkpoint's acceptance probe, checked against the draft engine's model."""
    probe = ckpt.Checkpoint(path, strict=False).probe(
        ACCEPTANCE_PROBE, map_location=device,
        missing="gamma=adaptive reads it; probe-train writes it when the data holds draft steps labelled under the "
                "target (both models in data.models), or run with a fixed gamma")
    return ProbeAcceptance(probe, draft_engine, allow_model_mismatch)
