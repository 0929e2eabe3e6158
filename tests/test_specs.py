"""SpecS: the score, SUBSAMPLE and the switching rule on tiny arrays; the loop on tiny random
models with scripted and real rewards."""
from __future__ import annotations

import math

import pytest
import torch

from specprobe.infer.decoding.common import DecodeOptions
from specprobe.infer.decoding.specs import (
    BernoulliReward,
    SpecSConfig,
    next_generator,
    reward_from_verifier,
    specs,
    specs_scores,
    subsample,
)
from specprobe.infer.engines import HFStepEngine, SamplingParams
from specprobe.infer.verifiers import BernoulliVerifier, build_verifier

Q = "What is 17 + 25? Think step by step."


# ----------------------------------------------------------------------------- pure rules
def test_score_is_log_ratio_plus_beta_reward():
    s = specs_scores([-1.0, -3.0], [-2.0, -1.0], [0.5, 0.0], beta=4.0)
    assert s.tolist() == [1.0 + 2.0, -2.0]
    with pytest.raises(ValueError):
        specs_scores([0.0], [0.0, 1.0], [0.0], 1.0)
    assert SpecSConfig().resolved_beta(100) == 200.0 and SpecSConfig(beta=3).resolved_beta(100) == 3.0


def _frequencies(scores, n=8000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(len(scores))
    for _ in range(n):
        counts[subsample(torch.tensor(scores), gen)] += 1
    return counts / n


def test_selection_with_beta_zero_and_generator_target_is_uniform():
    # generator == target: the log-ratio is 0; β = 0 removes the reward: every S_i is 0
    scores = specs_scores([-5.0, -0.3, -9.0, -2.0], [-5.0, -0.3, -9.0, -2.0], [0.9, 0.1, 0.5, 0.0], beta=0.0)
    assert scores.abs().max() == 0
    freq = _frequencies(scores.tolist())
    assert torch.allclose(freq, torch.full((4,), 0.25), atol=0.02)  # 4.6 standard errors


def test_selection_samples_proportional_to_exp_score_not_argmax():
    scores = [0.0, math.log(3.0), -math.inf]
    freq = _frequencies(scores)
    assert torch.allclose(freq, torch.tensor([0.25, 0.75, 0.0]), atol=0.02)
    assert subsample(torch.tensor([-math.inf, -math.inf])) in (0, 1)


def test_switching_rule_on_a_scripted_reward_sequence():
    rounds = [[0.1, 0.5], [0.9, 0.2], [0.3, 0.8], [0.81, 0.0], [0.2, 0.2]]
    assert [next_generator(r, 0.8) for r in rounds] == ["target", "draft", "target", "draft", "target"]
    assert all(next_generator(r, 1.0) == "target" for r in rounds)


# ----------------------------------------------------------------------------- the loop, tiny models
@pytest.fixture(scope="module")
def engines(one_thread):
    target = HFStepEngine("random:llama-20m", device="cpu", stop_at_eos=False)
    draft = HFStepEngine("random:llama-tiny", device="cpu", stop_at_eos=False)
    return target, draft


def options(**kw) -> DecodeOptions:
    base = dict(max_steps=5, max_new_tokens=400, accept_length_cut=True, seed=3,
                target_params=SamplingParams(temperature=0.8, max_step_tokens=4))
    base.update(kw)
    return DecodeOptions(**base)


class ScriptedReward:
    """Round k's rewards come from a script (a test double for a process reward model)."""

    name, layers = "scripted", None

    def __init__(self, script):
        self.script, self.calls = list(script), 0

    def rewards(self, prefix, steps, scored, seed):
        r = self.script[self.calls]
        self.calls += 1
        assert len(r) == len(steps)
        return r


def test_loop_follows_the_switching_rule(engines):
    script = [[0.1, 0.5], [0.9, 0.2], [0.3, 0.3], [0.85, 0.1], [0.0, 0.0]]
    res = specs(Q, *engines, ScriptedReward(script), options(), SpecSConfig(n=2, tau=0.8))
    assert [c["generator"] for c in res.trace] == ["target", "target", "draft", "target", "draft"]
    assert [s.source for s in res.steps] == ["target", "target", "draft", "target", "draft"]
    draft_rounds = [c for c in res.trace if c["generator"] == "draft"]
    # a draft round's scores include the target/draft log-ratio; a target round's are β·r only
    beta = 2 * 4
    assert all(c["scores"] == [beta * r for r in c["rewards"]] for c in res.trace if c["generator"] == "target")
    assert any(c["scores"] != [beta * r for r in c["rewards"]] for c in draft_rounds)
    assert res.stats.draft_tokens > 0 and res.stats.acceptance_rate == pytest.approx(2 / 5)


def test_tau_above_every_reward_never_switches(engines):
    # the coin reward is 1 for every candidate, the largest reachable value; τ = 1 is above it
    res = specs(Q, *engines, BernoulliReward(1.0), options(), SpecSConfig(n=3, tau=1.0))
    assert res.stats.output_steps == 5 and {s.source for s in res.steps} == {"target"}
    assert res.stats.draft_tokens == 0 and res.stats.draft_calls == 0
    switched = specs(Q, *engines, BernoulliReward(1.0), options(), SpecSConfig(n=3, tau=0.9))
    assert [s.source for s in switched.steps] == ["target"] + ["draft"] * 4


def test_rewards_from_verifiers(engines):
    assert isinstance(reward_from_verifier(BernoulliVerifier(0.3)), BernoulliReward)
    with pytest.raises(ValueError, match="needs one"):
        reward_from_verifier(build_verifier("exact"))
    res = specs(Q, *engines, reward_from_verifier(build_verifier("accept_all")), options(max_steps=3),
                SpecSConfig(n=2, tau=0.5))
    assert [s.source for s in res.steps] == ["target", "draft", "draft"]  # reward 1 > 0.5 after round 1


def test_probe_reward_is_the_target_probes_semantic_probability(engines):
    """A real probe pair on the tiny models: r is the target probe's p of each candidate, read from the
    same teacher-forced target pass that gives log π_target; p ≈ 0.88 > τ switches to the draft."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from specprobe.infer.decoding.specs import ProbeReward
    from specprobe.infer.verifiers import ProbePairVerifier

    from _probe_fixtures import make_probe

    target, draft = engines
    verifier = ProbePairVerifier(make_probe(target, 2.0, 0, layers="last"), make_probe(draft, 0.0, 1, layers="last"),
                                 target_engine=target, draft_engine=draft)
    reward = reward_from_verifier(verifier)
    assert isinstance(reward, ProbeReward) and reward.layers == verifier.layers("target")
    res = specs(Q, target, draft, reward, options(max_steps=3), SpecSConfig(n=2, tau=0.8))
    first = res.trace[0]
    assert all(0.85 < r < 0.9 for r in first["rewards"])  # sigmoid(2) = 0.881 for any input
    from specprobe.infer.engines.base import Prefix

    scored = target.score(Prefix(Q), [res.steps[0].text], hidden=True, layers=reward.layers).steps
    direct = float(verifier.p(verifier.pooled(scored[0], "target")[None]).reshape(-1)[0])
    assert direct == pytest.approx(first["rewards"][first["picked"]], abs=1e-4)
    assert [s.source for s in res.steps] == ["target", "draft", "draft"]


def test_loop_scores_with_target_minus_generator_and_draws_the_pick(engines, monkeypatch):
    """Draft rounds: S_i = log π_target(Y_i) − log π_draft(Y_i) + β·r_i with π_draft the draft's own sampled
    log-probability and π_target the target's teacher-forced one; the pick is a draw from exp(S), not the
    argmax (β = 0 target rounds score every candidate 0, so a draw spreads over them)."""
    from specprobe.infer.decoding import specs as specs_module

    target, draft = engines
    generated, scored, calls = [], [], []

    class Recorder:
        def __init__(self, engine, sink, method):
            self.engine, self.sink, self.method = engine, sink, method

        def __getattr__(self, name):
            attr = getattr(self.engine, name)
            if name != self.method:
                return attr

            def wrapped(*args, **kw):
                out = attr(*args, **kw)
                self.sink.append(out)
                return out
            return wrapped

    real_scores = specs_module.specs_scores
    monkeypatch.setattr(specs_module, "specs_scores", lambda *a: calls.append(a) or real_scores(*a))
    t, d = Recorder(target, scored, "score"), Recorder(draft, generated, "generate")
    script = [[0.9, 0.9], [0.9, 0.2], [0.9, 0.3]]  # round 1 by the target, then draft rounds
    specs(Q, t, d, ScriptedReward(script), options(max_steps=3), SpecSConfig(n=2, tau=0.8))
    assert len(generated) == 2 and len(scored) == 2 and len(calls) == 3
    for gen, sc, (lt, lg, _, _) in zip(generated, scored, calls[1:]):
        assert list(lg) == pytest.approx([s.logprob for s in gen.steps[0]])  # the draft's own log-probability
        assert list(lt) == pytest.approx([float(s.token_logprobs.sum()) for s in sc.steps])  # the target's
        assert not list(lt) == pytest.approx(list(lg))
    # the draw: 8 target rounds with every score 0 do not all pick candidate 0 (argmax's choice on ties)
    res = specs(Q, target, draft, ScriptedReward([[0.0] * 4] * 8), options(max_steps=8), SpecSConfig(n=4, tau=2.0,
                                                                                                   beta=0.0))
    assert all(c["scores"] == [0.0] * 4 for c in res.trace)
    assert len({c["picked"] for c in res.trace}) > 1


def test_a_candidate_that_ends_the_answer_is_scored_on_the_same_tokens_under_both_models(monkeypatch):
    """A draft candidate ending on EOS: its sampled log-probability counts the EOS token, the target's teacher-
    forced score of its text does not; the ratio compares the text's tokens under both (toy engines whose draft
    often ends the answer)."""
    from _toy_engine import ToyEngine

    from specprobe.infer.decoding import specs as specs_module

    target, draft = ToyEngine("target"), ToyEngine("draft", eos_weight=800)
    calls, generated = [], []
    real_scores, real_generate = specs_module.specs_scores, draft.generate
    monkeypatch.setattr(specs_module, "specs_scores", lambda *a: calls.append(a) or real_scores(*a))
    monkeypatch.setattr(draft, "generate", lambda *a: generated.append(a[0][0]) or real_generate(*a))
    opts = options(max_steps=5, target_params=SamplingParams(temperature=0.8, max_step_tokens=6))
    specs(Q, target, draft, ScriptedReward([[0.9] * 8] * 5), opts, SpecSConfig(n=8, tau=0.8))
    checked = 0
    for request, (lt, lg, _, _) in zip(generated, calls[1:]):  # round 1 is the target's
        for c, t, g in zip(real_generate([request], opts.draft_params).steps[0], lt, lg):
            if c.stop_reason == "eos" and c.text:
                assert g == pytest.approx(draft.score(request.prefix, [c.text]).steps[0].logprob)
                assert g != pytest.approx(c.logprob)  # the sampled sum, EOS included, is not what is compared
                assert t == pytest.approx(target.score(request.prefix, [c.text]).steps[0].logprob)
                checked += 1
    assert checked >= 1
