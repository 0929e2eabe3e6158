"""Decoding loops on tiny random-weight models: plumbing, exactness relations, limits, statistics, traces.

Random models write junk and rarely the delimiter, so most tests allow accepting steps cut by the
token cap (`accept_length_cut`, as system-speed runs do).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specprobe.infer.bench import options_from_config
from specprobe.infer.decoding import DecodeOptions, decode, read_trace, replay_text, stats_from_trace, write_trace
from specprobe.infer.engines import HFStepEngine, Prefix, PromptTooLongError, SamplingParams
from specprobe.infer.verifiers import BernoulliVerifier, Verifier, build_verifier
from specprobe.inputs.config import ConfigError
from specprobe.train.config import load_config

from _margins import assert_same_greedy

Q = "What is 17 + 25? Think step by step."
SPEC = ["lr_sync", "lr_async", "semanticspec"]


@pytest.fixture(scope="module")
def engines():
    target = HFStepEngine("random:llama-20m", device="cpu", stop_at_eos=False)
    draft = HFStepEngine("random:llama-tiny", device="cpu", stop_at_eos=False)
    return target, draft


def options(temperature=0.8, **kw) -> DecodeOptions:
    base = dict(gamma=3, max_steps=6, max_new_tokens=400, accept_length_cut=True, seed=11,
                target_params=SamplingParams(temperature=temperature, max_step_tokens=4))
    base.update(kw)
    return DecodeOptions(**base)


def run(method, engines, verifier=None, opts=None):
    target, draft = engines
    return decode(method, Q, target, draft, verifier, opts or options())


# ----------------------------------------------------------------------------- relations on a real engine
# (the exact relations, bit for bit, are in test_runtime_toy.py; here: what holds on any CPU)
def test_reject_all_writes_the_target_only_tokens_up_to_a_near_tie(engines):
    """Greedy reject-all on the real engine (batched rows, KV reuse): the same tokens as target-only
    wherever the target's choice is not a near-tie (see tests/_margins.py)."""
    target, draft = engines
    question = "What is 2 + 2? 2 + 2 = 4. What is 2 + 2?"  # no near-tie in its first 24 greedy tokens
    opts = options(0.0)
    base = decode("target", question, target, None, None, opts)
    ref = [t for s in base.steps for t in s.token_ids]
    prompt = target.prefix_ids(Prefix(question))
    for method in SPEC:
        res = decode(method, question, target, draft, build_verifier("reject_all"), opts)
        assert res.stats.accepted == 0 and res.stats.judged > 0 and res.stats.ratio == 1.0, method
        assert_same_greedy(target.model, prompt, [t for s in res.steps for t in s.token_ids], ref, at_least=8)


def test_accept_all_sync_cycle_is_gamma_drafts_then_a_bonus_target_step(engines):
    res = run("lr_sync", engines, build_verifier("accept_all"), options(max_steps=8, gamma=3))
    assert [s.source for s in res.steps] == ["draft"] * 3 + ["target"] + ["draft"] * 3 + ["target"]
    assert res.stats.mean_accepted_per_cycle == 3.0 and res.stats.acceptance_by_position == [1.0, 1.0, 1.0]


class BranchOne(Verifier):
    """Accepts exactly the drafts of branch 1 (to test multi-branch selection)."""
    name = "branch_one"

    def _score(self, items):
        return [(float(it.meta["branch"] == 1),) * 2 + ({},) for it in items]


def test_multi_branch_keeps_the_first_passing_branch(engines):
    res = run("lr_sync", engines, BranchOne(), options(gamma=2, width=2, max_steps=6))
    assert res.stats.acceptance_rate == 1.0
    for cycle in res.trace:
        kept = [d for d in cycle["drafts"] if d["verdict"] and d["verdict"]["accepted"]]
        assert all(d["branch"] == 1 for d in kept)
        assert len(cycle["drafts"]) == 2 + 4  # W + W^2 drafts in a depth-2 tree
        committed_drafts = [c["text"] for c in cycle["committed"] if c["source"] == "draft"]
        on_path = [d["text"] for d in cycle["drafts"] if set(d["path"]) == {1}]  # branch 1 at every depth
        assert committed_drafts == on_path[:len(committed_drafts)] and committed_drafts
    with pytest.raises(ValueError, match="width"):
        run("lr_async", engines, BranchOne(), options(width=2))
    # when every branch passes, the FIRST one is kept (not the last)
    both = run("lr_sync", engines, build_verifier("accept_all"), options(gamma=2, width=2, max_steps=6))
    kept = [c["text"] for cycle in both.trace for c in cycle["committed"] if c["source"] == "draft"]
    first_path = [d["text"] for cycle in both.trace for d in cycle["drafts"] if set(d["path"]) == {0}]
    assert kept and set(kept) <= set(first_path)
    assert all(p["branch"] == 0 for cycle in both.trace for p in cycle["positions"] if p.get("accepted"))


def test_length_cut_drafts_are_never_accepted_by_lookahead(engines):
    res = run("lr_sync", engines, build_verifier("accept_all"), options(accept_length_cut=False))
    assert res.stats.accepted == 0 and res.stats.judged > 0  # every random-model step is cut at 4 tokens
    reasons = {d["verdict"]["reason"] for c in res.trace for d in c["drafts"] if d["verdict"]}
    assert reasons == {"length"}
    # the verifier decided none of them: they are counted as refused, not as its rejections
    assert res.stats.decided == 0 and res.stats.refused == res.stats.judged


@pytest.mark.parametrize("method", ["lr_sync", "lr_async", "semanticspec"])
def test_decided_steps_are_the_ones_the_verifier_ruled_on(engines, method):
    """With the cap allowed every draft step reaches the verifier: decided = judged, nothing refused, and an
    accept-all verifier's acceptance over decided steps is 1."""
    res = run(method, engines, build_verifier("accept_all"), options(accept_length_cut=True))
    assert res.stats.refused == 0 and res.stats.decided == res.stats.judged > 0
    assert res.stats.decided_accepted == res.stats.accepted


# ----------------------------------------------------------------------------- statistics and seeds
@pytest.fixture(scope="module")
def tiny_pair():
    tiny = HFStepEngine("random:llama-tiny", device="cpu", stop_at_eos=False)
    return tiny, HFStepEngine("random:llama-tiny", model=tiny.model, tokenizer=tiny.tokenizer, stop_at_eos=False)


@pytest.mark.parametrize("method", SPEC)
def test_bernoulli_acceptance_matches_alpha(tiny_pair, method):
    alpha = 0.6
    opts = options(max_steps=160, max_new_tokens=10_000, target_params=SamplingParams(temperature=0.8, max_step_tokens=2))
    res = run(method, tiny_pair, BernoulliVerifier(alpha), opts)
    n = res.stats.judged
    assert n >= 100
    assert abs(res.stats.acceptance_rate - alpha) < 4 * np.sqrt(alpha * (1 - alpha) / n), (res.stats.acceptance_rate, n)


def test_runs_are_reproducible_from_the_seed(engines):
    """Same process, same inputs, same computations (async's batch composition depends on thread timing,
    so its reproducibility is tested on the toy engines)."""
    v = BernoulliVerifier(0.5)
    for method in ("lr_sync", "semanticspec"):
        a, b = run(method, engines, v), run(method, engines, v)
        assert a.text == b.text and [c["positions"] for c in a.trace] == [c["positions"] for c in b.trace], method
    other = run("lr_sync", engines, v, options(seed=12))
    assert other.text != run("lr_sync", engines, v).text


# ----------------------------------------------------------------------------- limits and bad input
@pytest.mark.parametrize("method", ["target", "draft"] + SPEC)
def test_limits_end_cleanly_with_their_reason(engines, method):
    v = BernoulliVerifier(0.5)
    res = run(method, engines, v, options(max_new_tokens=10, max_steps=50))
    assert res.stop_reason == "max_new_tokens" and res.stats.output_tokens == 10
    res = run(method, engines, v, options(max_steps=2))
    assert res.stop_reason == "max_steps" and len(res.steps) == 2


def test_eos_ends_the_generation(engines):
    target, draft = engines
    opts = options(max_steps=3)
    steps = decode("target", Q, target, None, None, opts).steps
    eos_id = next(t for t in steps[1].token_ids if t not in steps[0].token_ids)
    t2 = HFStepEngine("random:llama-20m", device="cpu", model=target.model, tokenizer=target.tokenizer)
    t2.text.eos_ids = {eos_id}  # pretend that token is EOS: the 2nd step must end there
    res = decode("target", Q, t2, None, None, opts)
    assert res.stop_reason == "eos" and len(res.steps) == 2 and res.steps[-1].stop_reason == "eos"
    assert res.steps[0].text == steps[0].text
    spec = decode("lr_sync", Q, t2, draft, build_verifier("reject_all"), opts)
    assert spec.stop_reason == "eos" and spec.steps[-1].source == "target"


def test_bad_input_gives_clear_errors(engines):
    target, draft = engines
    v = build_verifier("accept_all")
    with pytest.raises(ValueError, match="gamma"):
        DecodeOptions(gamma=0)
    with pytest.raises(ConfigError, match="gamma"):
        load_config(None, ["runtime.gamma=0"])
    for method in ["target"] + SPEC:
        with pytest.raises(ValueError, match="empty prompt"):
            decode(method, "   ", target, draft, v, options())
    short = HFStepEngine("random:llama-20m", device="cpu", model=target.model, tokenizer=target.tokenizer)
    short.info.max_length = 40
    with pytest.raises(PromptTooLongError, match="context window"):
        decode("lr_sync", Q * 10, short, draft, v, options())
    with pytest.raises(ValueError, match="verifier"):
        decode("lr_sync", Q, target, draft, None, options())
    with pytest.raises(ValueError, match="target's own step"):
        decode("semanticspec", Q, target, draft, build_verifier("exact"), options())


# ----------------------------------------------------------------------------- traces
def test_trace_replays_the_output_and_the_counts(engines, tmp_path):
    refused = 0
    # (without accept_length_cut the capped drafts are refused before the verifier is asked)
    for method, cut in [(m, cut) for m in SPEC for cut in (True, False)]:
        res = run(method, engines, BernoulliVerifier(0.6), options(max_steps=12, accept_length_cut=cut))
        refused += res.stats.refused
        assert replay_text(res.trace) == res.text
        recount = stats_from_trace(res.trace)
        assert (recount.judged_by_position, recount.accepted_by_position) == \
               (res.stats.judged_by_position, res.stats.accepted_by_position)
        assert (recount.output_tokens, recount.target_tokens, recount.cycles) == \
               (res.stats.output_tokens, res.stats.target_tokens, res.stats.cycles)
        assert (recount.decided, recount.decided_accepted, recount.refused) == \
               (res.stats.decided, res.stats.decided_accepted, res.stats.refused), method
        path = tmp_path / f"{method}.jsonl"
        write_trace(path, res.trace)
        assert replay_text(read_trace(path)) == res.text
    assert refused > 0


def test_metrics_are_filled(engines):
    res = run("lr_sync", engines, BernoulliVerifier(0.6), options(max_steps=12))
    st = res.stats
    assert st.latency_s > 0 and st.tokens_per_second > 0
    assert st.target_forward_passes > 0 and st.draft_forward_passes > 0
    assert st.draft_time_s > 0 and st.target_time_s > 0 and st.draft_time_per_token > 0
    assert st.target_tokens + st.draft_tokens == st.output_tokens
    assert 1 < st.mean_target_rows <= 4  # γ + 1 rows per target batch at most
    assert 1 <= st.mean_rows_per_forward <= st.mean_target_rows
    assert st.stop_reasons == {"max_steps": 1}
    d = res.to_dict()
    assert d["stats"]["acceptance_rate"] == st.acceptance_rate and d["text"] == res.text


def test_committed_rows_are_not_encoded_again(engines):
    """Committed steps are prefixes by their own token ids and the engine keeps the KV of the row it wrote,
    so each new step encodes exactly one token: the last of the previous step (never fed while decoding)."""
    target, _ = engines
    prompt = len(target.prefix_ids(Prefix(Q)))
    target.clear_prefix_cache()
    res = run("target", engines, opts=options(max_steps=6))  # 6 steps of 4 tokens
    assert res.stats.output_tokens == 24 and res.stats.target_prefill_tokens == prompt + 5
    sync = run("lr_sync", engines, build_verifier("reject_all"), options(max_steps=6))
    assert sync.stats.target_prefill_tokens < prompt + 6 * 24  # nested rows and committed rows are reused


def test_semanticspec_judges_each_draft_with_its_own_features_and_p_over_q(engines):
    """Input-dependent probes: each judged draft carries its own step's hidden states (not the first draft's),
    p comes from the target probe on the target's view and q from the draft probe on the draft's, and the
    acceptance probability is min(1, p / q)."""
    from specprobe.infer.verifiers import ProbePairVerifier

    from _probe_fixtures import make_input_probe

    target, draft = engines
    seen = []

    class Spy(ProbePairVerifier):
        def _score(self, items):
            out = super()._score(items)
            seen.extend((it.meta["position"], it.draft, it.target_features, it.draft_features, o) for it, o in zip(items, out))
            return out

    pt, pd = make_input_probe(target, 0.0, 1), make_input_probe(draft, 0.5, 2)
    res = run("semanticspec", engines, Spy(pt, pd), options(gamma=3, max_steps=8))
    assert res.stats.judged >= 4 and len(seen) == res.stats.judged
    # features differ between positions of a cycle whose texts differ
    cycles, current = [], []
    for entry in seen:
        if entry[0] == 0 and current:
            cycles.append(current)
            current = []
        current.append(entry)
    cycles.append(current)
    later = [(c[0], e) for c in cycles for e in c[1:] if e[1] != c[0][1]]
    assert later, "no cycle judged two different drafts"
    for first, entry in later:
        assert not torch.equal(first[2], entry[2]) and not torch.equal(first[3], entry[3])
    for _, _, tf, df, (_, prob, detail) in seen:
        p, q = float(pt.predict_proba(tf[None]).reshape(-1)[0]), float(pd.predict_proba(df[None]).reshape(-1)[0])
        assert detail["p"] == pytest.approx(p, abs=1e-6) and detail["q"] == pytest.approx(q, abs=1e-6)
        assert prob == pytest.approx(min(1.0, p / q), abs=1e-6)
    assert len({round(d["p"], 4) for *_, (_, _, d) in seen}) > 1  # the probes did see different inputs


def _decisions_by_position(res) -> dict[int, bool]:
    """Answer position (steps before the draft) -> whether the draft judged there was accepted. A cycle's i-th
    judged position follows its start and i committed steps (async LR's "position" counts its stage instead)."""
    return {c["start_step"] + i: p["accepted"] for c in res.trace for i, p in enumerate(c["positions"])}


def test_acceptance_draws_keyed_by_position_are_the_same_for_every_method(engines):
    """runtime.accept_draws=position: each method faces the same Bernoulli draw at an answer position, whatever
    text it wrote before (common random numbers for comparing methods on a few problems). Keyed by the prefix's
    text (the default), the methods' different texts give them different draws."""
    v = BernoulliVerifier(0.5)
    methods = [("lr_sync", 1), ("lr_sync", 3), ("semanticspec", 3), ("lr_async", 3)]
    for draws in ("position", "prefix"):
        seen = [_decisions_by_position(run(m, engines, v, options(gamma=g, max_steps=24, accept_draws=draws)))
                for m, g in methods]
        pairs = [(a[k], b[k]) for i, a in enumerate(seen) for b in seen[i + 1:] for k in a.keys() & b.keys()]
        assert len(pairs) >= 20, draws
        differ = sum(x != y for x, y in pairs)
        assert (differ == 0) if draws == "position" else (differ > 0), (draws, differ, len(pairs))
    with pytest.raises(ValueError, match="accept_draws must be one of"):
        options(accept_draws="text")
    setup = load_config("configs/tiny.yaml", ["runtime.accept_draws=position"]).bench_setup()
    assert options_from_config(setup).accept_draws == "position"
    assert options_from_config(load_config("configs/tiny.yaml", []).bench_setup()).accept_draws == "prefix"
