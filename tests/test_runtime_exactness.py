"""Exactness of the decoding runtime with greedy decoding on the real offline SmolLM2-135M-Instruct.

- reject-all: every method writes exactly what target-only greedy decoding writes;
- accept-all: sync LR writes the draft's greedy chain of γ steps, then the target's next step (the draft
  is the same weights without the chat template, so the two chains differ);
- the probe acceptance draws are reproducible from the seed.
Small limits (3 steps of <= 24 tokens) keep this CI-sized.
"""
from __future__ import annotations

import pytest

from infer.decoding import DecodeOptions, decode
from infer.engines import HFStepEngine, SamplingParams
from infer.engines.token_spec import TokenSpecConfig
from infer.verifiers import build_verifier, load_verifier

from _probe_fixtures import make_probe

pytestmark = pytest.mark.slow

Q = "Step 1: Tom has 3 apples.\n\nStep 2: He buys 2 more apples.\n\nStep 3: He eats 1 apple."
GREEDY = SamplingParams(temperature=0.0, max_step_tokens=24)


@pytest.fixture(scope="module")
def smol():
    target = HFStepEngine("offline:smollm2-135m-instruct", device="cpu")
    plain = HFStepEngine("offline:smollm2-135m-instruct", model=target.model, tokenizer=target.tokenizer,
                         use_chat_template=False)  # same weights, no chat template: another chain
    junk = HFStepEngine("random:llama-tiny", device="cpu")
    return target, plain, junk


def opts(**kw):
    return DecodeOptions(**{"gamma": 2, "max_steps": 3, "max_new_tokens": 200, "target_params": GREEDY, **kw})


def test_reject_all_every_method_equals_target_only_greedy(smol):
    target, plain, junk = smol
    base = decode("target", Q, target, None, None, opts())
    assert len(base.steps) == 3 and base.stop_reason == "max_steps"
    reject = build_verifier("reject_all")
    runs = {
        "lr_sync": decode("lr_sync", Q, target, plain, reject, opts()),
        "lr_async": decode("lr_async", Q, target, plain, reject, opts()),
        "lr_sync_w2": decode("lr_sync", Q, target, junk, reject, opts(width=2)),
        "semanticspec": decode("semanticspec", Q, target, plain, reject, opts()),
    }
    target.set_token_spec(TokenSpecConfig("ngram", num_tokens=8, ngram_size=3))
    try:
        runs["lr_sync+ngram"] = decode("lr_sync", Q, target, plain, reject, opts())
        runs["target+ngram"] = decode("target", Q, target, None, None, opts())
    finally:
        target.set_token_spec(None)
    for name, res in runs.items():
        assert res.step_texts == base.step_texts, name
    assert runs["lr_sync+ngram"].stats.spec_proposed > 0


def test_accept_all_sync_writes_the_draft_chain_then_the_target_step(smol):
    target, plain, _ = smol
    d0 = plain.generate_step(plain.format_prefix(Q), GREEDY)
    d1 = plain.generate_step(plain.format_prefix(Q, [d0.text]), GREEDY)
    assert d0.stop_reason == d1.stop_reason == "delimiter"  # whole steps, so they can be accepted
    s2 = target.generate_step(target.format_prefix(Q, [d0.text, d1.text]), GREEDY)
    s0 = target.generate_step(target.format_prefix(Q), GREEDY)
    assert s0.text != d0.text  # the chains differ, so the test can tell them apart
    res = decode("lr_sync", Q, target, plain, build_verifier("accept_all"), opts())
    assert res.step_texts == [d0.text, d1.text, s2.text]
    assert [s.source for s in res.steps] == ["draft", "draft", "target"]
    assert res.stats.acceptance_by_position == [1.0, 1.0] and res.stats.cycles == 1


def test_probe_acceptance_draws_are_reproducible(smol, tmp_path):
    target, plain, _ = smol
    make_probe(target, -0.85, 0, layers="last").save(tmp_path, "probe_target")  # p ~ 0.3
    make_probe(plain, 0.4, 1, layers="last").save(tmp_path, "probe_draft")  # q ~ 0.6: accept with prob ~ 0.5
    verifier = load_verifier(tmp_path, "probe", target_engine=target, draft_engine=plain)
    o = opts(max_steps=4, seed=3)
    a = decode("semanticspec", Q, target, plain, verifier, o)
    b = decode("semanticspec", Q, target, plain, verifier, o)
    draws = [[(d["verdict"]["accepted"], round(d["verdict"]["p"], 6), round(d["verdict"]["q"], 6))
              for d in c["drafts"] if d["verdict"] and "p" in d["verdict"]] for c in a.trace]
    assert draws == [[(d["verdict"]["accepted"], round(d["verdict"]["p"], 6), round(d["verdict"]["q"], 6))
                      for d in c["drafts"] if d["verdict"] and "p" in d["verdict"]] for c in b.trace]
    assert a.step_texts == b.step_texts and sum(map(len, draws)) >= 2
    flat = [d for cycle in draws for d in cycle]
    assert all(0.2 < p < 0.4 and 0.5 < q < 0.7 for _, p, q in flat)
    # the same probe pair plugs into Lookahead Reasoning
    lr = decode("lr_sync", Q, target, plain, verifier, o)
    assert lr.stats.judged >= 1 and lr.stop_reason == "max_steps"
