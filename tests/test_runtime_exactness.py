"""The decoding runtime on the real offline SmolLM2-135M-Instruct, greedy, compared in a way that does not
depend on one CPU's float rounding: two computations of a greedy continuation must agree up to the
reference's first near-tie (tests/_margins.py). The exact relations, bit for bit, are in
test_runtime_toy.py.

- target-only with a small step cap writes the model's plain autoregressive output (capped steps are
  continued as written, committed steps by their own token ids, KV reused);
- reject-all: every method (and token speculation inside the LR batch) writes the target-only tokens;
- accept-all: sync LR writes the draft's greedy chain of γ steps, then the target's next step;
- the probe acceptance draws are reproducible from the seed.
"""
from __future__ import annotations

import pytest
import torch

from specprobe.infer.decoding import DecodeOptions, decode
from specprobe.infer.engines import HFStepEngine, Prefix, SamplingParams, StepRequest
from specprobe.infer.engines.token_spec import TokenSpecConfig
from specprobe.infer.verifiers import build_verifier, load_verifier

from _margins import assert_same_greedy
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


def ids_of(result):
    return [t for s in result.steps for t in s.token_ids]


def test_target_only_with_a_small_cap_is_plain_autoregression(smol):
    target, _, _ = smol
    res = decode("target", Q, target, None, None, opts(target_params=SamplingParams(0.0, max_step_tokens=5),
                                                       max_steps=12, max_new_tokens=60))
    assert "length" in {s.stop_reason for s in res.steps}
    prompt = target.prefix_ids(Prefix(Q))
    with torch.inference_mode():
        out = target.model.generate(torch.tensor([prompt]), max_new_tokens=res.stats.output_tokens, do_sample=False)
    assert_same_greedy(target.model, prompt, ids_of(res), out[0, len(prompt):].tolist(), at_least=20)


def test_reject_all_every_method_equals_target_only_greedy(smol):
    target, plain, junk = smol
    base = decode("target", Q, target, None, None, opts())
    assert len(base.steps) == 3  # (the third step ends the answer or the step budget)
    reject = build_verifier("reject_all")
    runs = {
        "lr_sync": decode("lr_sync", Q, target, plain, reject, opts()),
        "lr_async": decode("lr_async", Q, target, plain, reject, opts()),
        "lr_sync_w2": decode("lr_sync", Q, target, junk, reject,
                             opts(width=2, draft_params=SamplingParams(0.8, max_step_tokens=24))),
        "semanticspec": decode("semanticspec", Q, target, plain, reject, opts()),
    }
    speculating = target.with_token_spec(TokenSpecConfig("ngram", num_tokens=8, ngram_size=3))
    runs["lr_sync+ngram"] = decode("lr_sync", Q, speculating, plain, reject, opts())
    runs["target+ngram"] = decode("target", Q, speculating, None, None, opts())
    prompt = target.prefix_ids(Prefix(Q))
    for _name, res in runs.items():
        assert_same_greedy(target.model, prompt, ids_of(res), ids_of(base), at_least=20)
    # token speculation ran inside the LR target batch and accepted tokens there
    assert runs["lr_sync+ngram"].stats.spec_accepted > 0


def test_accept_all_sync_writes_the_draft_chain_then_the_target_step(smol):
    target, plain, _ = smol
    d0 = plain.generate([StepRequest(Prefix(Q))], GREEDY).steps[0][0]
    d1 = plain.generate([StepRequest(Prefix(Q, (d0,)))], GREEDY).steps[0][0]
    assert "eos" not in (d0.stop_reason, d1.stop_reason)  # neither ends the answer, so both can be accepted
    s2 = target.generate([StepRequest(Prefix(Q, (d0, d1)))], GREEDY).steps[0][0]
    s0 = target.generate([StepRequest(Prefix(Q))], GREEDY).steps[0][0]
    assert s0.text != d0.text  # the chains differ, so the test can tell them apart
    res = decode("lr_sync", Q, target, plain, build_verifier("accept_all"), opts(accept_length_cut=True))
    assert [s.source for s in res.steps] == ["draft", "draft", "target"]
    assert res.stats.acceptance_by_position == [1.0, 1.0] and res.stats.cycles == 1
    # step by step, each against its own prompt, until the first near-tie
    for got, want, prompt in ((res.steps[0], d0, plain.prefix_ids(Prefix(Q))),
                              (res.steps[1], d1, plain.prefix_ids(Prefix(Q, (d0,)))),
                              (res.steps[2], s2, target.prefix_ids(Prefix(Q, (d0, d1))))):
        n = assert_same_greedy(plain.model, prompt, got.token_ids, want.token_ids)
        if n < len(want.token_ids):
            break


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
    assert a.step_texts == b.step_texts and sum(map(len, draws)) >= 1  # EOS drafts are refused before the probe
    flat = [d for cycle in draws for d in cycle]
    assert all(0.2 < p < 0.4 and 0.5 < q < 0.7 for _, p, q in flat)
    # the same probe pair plugs into Lookahead Reasoning
    lr = decode("lr_sync", Q, target, plain, verifier, o)
    assert lr.stats.judged >= 1 and lr.stop_reason in ("max_steps", "eos")
