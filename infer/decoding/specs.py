"""SpecS: step beam search with reward-guided soft verification and dynamic switching.

Each round the current generator π_gen (the target at first) samples n candidate steps Y_1..Y_n after the
committed output tr. Each gets the score (their eq. 1)

    S_i = log(π_target(Y_i | tr) / π_gen(Y_i | tr)) + β · r(Y_i | tr)

and ONE candidate is drawn with probability ∝ exp(S_i) (SUBSAMPLE, Alg. 2: a draw, not an argmax). When
π_gen is the target the log-ratio is 0 and no scoring pass is needed. Then the switching rule (Alg. 1,
line 9): if max_i r(Y_i) > τ the next round is drafted by the draft model, otherwise the target writes
it (hard steps stay with the target; the paper's τ → 1 end is plain target beam search).

Defaults are the paper's robust choice (its Table 5): β = 2·L with L the step-token cap, τ = 0.8, n = 4
(its smallest beam of Tables 1–3). The reward r is any step reward in [0, 1]: a specprobe probe (the target
probe's semantic probability of the candidate, read from the same teacher-forced target pass that gives
π_target), or any verifier's acceptance probability. Log-probabilities are those of the models'
unmodified distributions (Step.logprob, Scoring), as the score's KL reading requires; a draft candidate that
ends the answer is rescored by the draft on its text, since its Step.logprob counts the EOS token that the
target's teacher-forced score of the text leaves out. The ratio of such a candidate is thus over its text alone:
how likely each model is to end the answer there is not in it (the step-scoring interface has no EOS term).

The pure rules (`specs_scores`, `subsample`, `next_generator`) are unit-tested on tiny arrays; `specs`
is the loop over the step-engine interface (`generate`, `score`).
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specprobe.infer.decoding.common import GenState
from specprobe.infer.engines.base import StepRequest, seed_for
from specprobe.infer.verifiers import StepContext

TARGET, DRAFT = "target", "draft"


@dataclass(frozen=True)
class SpecSConfig:
    """n candidates per round, inverse temperature β (None: 2·L), switching threshold τ."""

    n: int = 4
    beta: float | None = None
    tau: float = 0.8

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"specs n (candidate steps per round) must be an int >= 1, got {self.n!r}")
        if self.beta is not None and (self.beta < 0 or math.isnan(self.beta)):
            raise ValueError(f"specs beta must be >= 0 (or null for 2 x the step-token cap), got {self.beta}")
        if math.isnan(self.tau):
            raise ValueError("specs tau must be a number")

    def resolved_beta(self, max_step_tokens: int) -> float:
        return 2.0 * max_step_tokens if self.beta is None else float(self.beta)


# ----------------------------------------------------------------------------- pure rules
def specs_scores(logp_target: Sequence[float], logp_gen: Sequence[float], rewards: Sequence[float],
                 beta: float) -> torch.Tensor:
    """S_i = (log π_target(Y_i) − log π_gen(Y_i)) + β·r(Y_i), float64."""
    lt, lg, r = (torch.as_tensor(list(x), dtype=torch.float64) for x in (logp_target, logp_gen, rewards))
    if not (lt.shape == lg.shape == r.shape) or lt.numel() == 0:
        raise ValueError(f"specs_scores needs equal, non-empty lengths, got {lt.numel()}, {lg.numel()}, {r.numel()}")
    return (lt - lg) + beta * r


def subsample(scores: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """Index i drawn with probability ∝ exp(S_i) (SUBSAMPLE). −inf scores are never drawn unless all are."""
    s = torch.as_tensor(scores, dtype=torch.float64)
    if bool(torch.isneginf(s).all()):
        s = torch.zeros_like(s)
    probs = torch.softmax(s, 0)
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    idx = int(torch.searchsorted(probs.cumsum(0), torch.tensor([u], dtype=torch.float64), right=True)[0])
    return min(idx, s.numel() - 1)


def next_generator(rewards: Sequence[float], tau: float) -> str:
    """Dynamic switching: the draft writes the next round when some candidate's reward exceeds τ."""
    return DRAFT if max(rewards) > tau else TARGET


# ----------------------------------------------------------------------------- rewards
class StepReward(Protocol):
    """r(Y | tr) in [0, 1] for candidate steps. `layers` (None: no hidden states needed) tells the loop
    which target hidden states to read in its teacher-forced pass; `rewards` gets those ScoredSteps."""

    name: str
    layers: list[int] | None

    def rewards(self, prefix, steps: Sequence, scored: Sequence | None, seed: int) -> list[float]:
        ...


class ProbeReward:
    """The target probe's semantic probability of each candidate (a trained specprobe probe pair)."""

    name = "probe"

    def __init__(self, verifier):
        self.verifier = verifier
        self.layers = verifier.layers("target")

    def rewards(self, prefix, steps, scored, seed):
        have = [i for i, s in enumerate(scored) if s is not None]
        out = [0.0] * len(steps)  # an empty step earns nothing
        if have:
            feats = torch.stack([self.verifier.pooled(scored[i], "target") for i in have])
            for i, p in zip(have, self.verifier.p(feats).reshape(-1).tolist()):
                out[i] = float(p)
        return out


class VerifierReward:
    """Any verifier that judges a step alone: r = its acceptance probability for the step."""

    def __init__(self, verifier):
        if getattr(verifier, "needs_target_step", False):
            raise ValueError(f"SpecS scores candidates without a target reference step; the {verifier.name} "
                             "verifier needs one. Use a probe checkpoint (verifier=probe) or bernoulli")
        self.verifier, self.name, self.layers = verifier, verifier.name, None

    def rewards(self, prefix, steps, scored, seed):

        ctx = StepContext(prefix.question, tuple(prefix.step_texts()))
        return [float(self.verifier.score(ctx, s.text)) for s in steps]


class BernoulliReward:
    """System-speed stand-in: r = 1 with probability α, else 0 (seeded), so the switch happens with
    probability 1 − (1 − α)^n per round, as a real reward of that hit rate would make it."""

    layers = None

    def __init__(self, alpha: float):
        self.alpha, self.name = float(alpha), f"bernoulli({alpha})"

    def rewards(self, prefix, steps, scored, seed):
        gen = torch.Generator().manual_seed(seed)
        return [float(torch.rand((), generator=gen) < self.alpha) for _ in steps]


def reward_from_verifier(verifier) -> StepReward:
    """The natural reward for a verifier: the probe's p for a probe pair, a coin of rate α for bernoulli,
    else the verifier's acceptance probability."""
    name = getattr(verifier, "name", "")
    if getattr(verifier, "needs_features", False):
        return ProbeReward(verifier)
    if name == "bernoulli":
        return BernoulliReward(verifier.alpha)
    return VerifierReward(verifier)


# ----------------------------------------------------------------------------- the loop
def specs(question: str, target, draft, reward: StepReward, opts, cfg: SpecSConfig | None = None,
          method: str = "specs"):
    """Generate an answer with SpecS. `reward`: a StepReward (see reward_from_verifier). With
    cfg.tau >= 1 (above any reward in [0, 1]) every round is the target's: target beam search with soft
    selection, the paper's τ → 1 end and this method's baseline."""

    cfg = cfg or SpecSConfig()
    if draft is None and cfg.tau < 1:
        raise ValueError("SpecS switches to a draft model; pass a draft engine (or tau >= 1 for target beam search)")
    state = GenState(question, target, draft, opts, method)
    beta = cfg.resolved_beta(opts.target_params.max_step_tokens)
    role = TARGET
    while not state.done:
        role = _round(state, target, draft, reward, cfg, beta, role)
    return state.finish(method)


def _round(state, target, draft, reward: StepReward, cfg: SpecSConfig, beta: float, role: str) -> str:

    opts, stats = state.opts, state.stats
    engine, params = (target, opts.target_params) if role == TARGET else (draft, opts.draft_params)
    prefix = state.prefix()
    key = state.key(prefix)
    out = engine.generate([StepRequest(prefix, cfg.n, seed_for(opts.seed, role, key, "specs"), state.cap())],
                          params)
    cands = out.steps[0]
    state.book(role, out.stats, cfg.n, calls=1)
    texts = [c.text for c in cands]
    # one teacher-forced target pass: π_target of draft candidates, and the probe's hidden states
    full = [i for i, t in enumerate(texts) if t]  # an empty step has nothing to score
    scored: list = [None] * len(cands)
    if (role == DRAFT or reward.layers is not None) and full:
        got = state.score(target, TARGET, prefix, [texts[i] for i in full], hidden=reward.layers is not None,
                          layers=reward.layers)
        for i, s in zip(full, got):
            scored[i] = s
    # generator == target: the ratio is 1 (no pass needed); an empty step keeps ratio 1 as well
    ratio_known = [role == DRAFT and s is not None for s in scored]
    logp_target = [s.logprob if k else 0.0 for s, k in zip(scored, ratio_known)]
    logp_gen = [c.logprob if k else 0.0 for c, k in zip(cands, ratio_known)]
    ended = [i for i, (c, k) in enumerate(zip(cands, ratio_known)) if k and c.stop_reason == "eos"]
    if ended:  # Step.logprob counts the EOS token, the target's score of the text does not: score the same tokens
        again = state.score(draft, DRAFT, prefix, [texts[i] for i in ended], hidden=False)
        for i, s in zip(ended, again):
            logp_gen[i] = s.logprob
    t0 = time.perf_counter()
    r = reward.rewards(prefix, cands, scored, seed_for(opts.seed, "reward", key))
    stats.verify_time_s += time.perf_counter() - t0
    scores = specs_scores(logp_target, logp_gen, r, beta)
    pick = subsample(scores, torch.Generator().manual_seed(seed_for(opts.seed, "select", key)))
    stats.record_position(0, role == DRAFT)  # "acceptance" of SpecS: share of rounds the draft wrote
    committed = state.commit(cands[pick], role, state.count_tokens(cands[pick], engine))
    nxt = next_generator(r, cfg.tau)
    stats.cycles += 1
    state.add_trace({"cycle": stats.cycles - 1, "generator": role, "rewards": r,
                     "scores": [float(s) for s in scores], "picked": pick, "next": nxt,
                     "committed": [committed.to_dict()]})
    return nxt


def specs_predicted_speedup(stats) -> dict:
    """SpecS over target beam search from its latency model (Observation 1 of the paper: a draft round =
    drafting n candidates + one target scoring pass, a target round = the target writing n candidates):
    1 / ((1 − a) + a·ρ), a = share of rounds drafted, ρ = draft-round time / target-round time, both
    measured in the same run. Scoring time is charged to draft rounds (true for rewards without hidden
    states; with a probe reward target rounds score too, and the prediction is slightly optimistic)."""
    out = {"ideal": None, "adjusted": None, "k": None, "formula": "1/((1-a)+a*rho) vs beam_target"}
    a = stats.acceptance_rate
    if a is None or not stats.target_calls or not stats.draft_calls:
        if a is not None and a == 0:
            out["ideal"] = 1.0
        return out
    t_round = stats.target_time_s / stats.target_calls
    d_round = (stats.draft_time_s + stats.score_time_s + stats.verify_time_s) / stats.draft_calls
    rho = d_round / t_round if t_round > 0 else None
    if rho is not None:
        out["ideal"] = 1.0 / ((1.0 - a) + a * rho)
    return out
