"""Token-level speculation inside steps: the pure rules on tiny arrays, and exactness of the engine.

Greedy decoding with speculation (prompt lookup or an assistant model) must write exactly the tokens
plain greedy decoding writes; the sampling rule must leave every token distributed as p.
"""
from __future__ import annotations

import pytest
import torch

from infer.engines import HFStepEngine, SamplingParams
from infer.engines.decode import RowSpec, common_prefix_len
from infer.engines.token_spec import (AssistantProposer, TokenSpecConfig, filtered_probs, greedy_accept,
                                      ngram_propose, sample_accept)


# ----------------------------------------------------------------------------- pure rules
def test_ngram_propose_uses_most_recent_match_and_backs_off():
    ctx = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert ngram_propose(ctx, 3, 2) == [7, 8]  # most recent earlier [1,2,3] is followed by 7, 8
    assert ngram_propose(ctx, 3, 10) == [7, 8, 5, 1, 2, 3]  # runs up to the end of the context
    assert ngram_propose([4, 5, 6, 5], 3, 2) == [6, 5]  # no 3- or 2-gram match: the 1-gram [5] matches
    assert ngram_propose([4, 5, 6, 5], 3, 2, min_ngram=2) == []
    assert ngram_propose([1, 2, 3], 3, 4) == []
    assert ngram_propose([], 3, 4) == [] and ngram_propose([1, 1], 2, 0) == []


def test_greedy_accept_longest_prefix_plus_one():
    assert greedy_accept([5, 6, 7], [5, 6, 9, 4]) == [5, 6, 9]
    assert greedy_accept([5, 6, 7], [5, 6, 7, 4]) == [5, 6, 7, 4]  # all accepted + bonus
    assert greedy_accept([5], [3, 1]) == [3]
    assert greedy_accept([], [8]) == [8]
    with pytest.raises(ValueError):
        greedy_accept([1, 2], [1, 2])


def test_sample_accept_is_lossless_for_a_deterministic_proposal():
    """Marginal of the first token and of the second (given the first) match p exactly in expectation."""
    p0 = torch.tensor([0.1, 0.5, 0.3, 0.1])
    p1 = torch.tensor([0.25, 0.25, 0.4, 0.1])
    p2 = torch.tensor([0.7, 0.1, 0.1, 0.1])
    probs = torch.stack([p0, p1, p2])
    gen = torch.Generator().manual_seed(0)
    n = 20000
    first = torch.zeros(4)
    second_after_prop = torch.zeros(4)
    hits = 0
    for _ in range(n):
        out = sample_accept([2, 0], probs, gen)
        first[out[0]] += 1
        if out[0] == 2:  # proposal accepted: the second token is distributed as p1
            hits += 1
            second_after_prop[out[1]] += 1
        assert 1 <= len(out) <= 3
    assert torch.allclose(first / n, p0, atol=0.015)
    assert torch.allclose(second_after_prop / hits, p1, atol=0.02)


def test_sample_accept_never_rejects_a_certain_token():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        assert sample_accept([1], probs, gen)[0] == 1
    with pytest.raises(ValueError):
        sample_accept([1, 2], probs, gen)


def _nucleus_reference(logits, temperature, top_p):
    probs = torch.softmax(logits / temperature, -1)
    sorted_p, order = probs.sort(-1, descending=True)
    drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    out = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return out / out.sum(-1, keepdim=True)


@pytest.mark.parametrize("scale", [0.1, 3.0, 12.0])  # flat, medium, peaked distributions
def test_filtered_probs_matches_a_full_sort_nucleus(scale):
    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(2)) * scale
    got = filtered_probs(logits, 0.7, 0.9)
    assert torch.allclose(got, _nucleus_reference(logits, 0.7, 0.9), atol=1e-6)
    assert torch.allclose(filtered_probs(logits, 1.0, 1.0), torch.softmax(logits, -1))
    with pytest.raises(ValueError):
        filtered_probs(logits, 0.0, 0.9)


def test_token_spec_config_validation():
    with pytest.raises(ValueError):
        TokenSpecConfig("medusa")
    with pytest.raises(ValueError):
        TokenSpecConfig("ngram", num_tokens=0)
    assert common_prefix_len([[1, 2, 3], [1, 2], [1, 2, 5]]) == 2 and common_prefix_len([]) == 0


# ----------------------------------------------------------------------------- engine (tiny random models)
@pytest.fixture(scope="module")
def tiny():
    return HFStepEngine("random:llama-tiny", device="cpu", use_chat_template=False)


@pytest.fixture(scope="module")
def small():
    return HFStepEngine("random:llama-20m", device="cpu", use_chat_template=False)


GREEDY = SamplingParams(temperature=0, max_step_tokens=12)
PREFIXES = ["What is 2 + 2? 2 + 2 = 4. What is 2 + 2?",
            "What is 2 + 2? 2 + 2 = 4. What is 2 + 2?\n\nFirst step.",
            "What is 2 + 2? 2 + 2 = 4. What is 2 + 2?\n\nFirst step.\n\nA much longer second step here."]


def test_batch_of_different_prefixes_equals_each_row_alone(tiny):
    alone = [tiny.generate_steps([p], GREEDY)[0] for p in PREFIXES]
    old_api = [tiny.sample([p], 1, GREEDY)[0][0] for p in PREFIXES]
    batched = tiny.generate_steps(PREFIXES, GREEDY)
    assert [s.token_ids for s in batched] == [s.token_ids for s in alone] == [s.token_ids for s in old_api]
    caps = tiny.generate_steps(PREFIXES, GREEDY, caps=[3, 5, 50])
    assert [s.num_tokens for s in caps] == [3, 5, 12] and {s.stop_reason for s in caps} == {"length"}
    assert [s.token_ids for s in caps] == [a.token_ids[:len(s.token_ids)] for s, a in zip(caps, alone)]


def test_rows_joining_a_running_batch_decode_as_if_alone(tiny):
    alone = [tiny.generate_steps([p], GREEDY)[0] for p in PREFIXES + ["Something else entirely"]]
    batch = tiny.open_batch(GREEDY)
    res = dict(batch.add([RowSpec(0, tiny.encode_prefix(PREFIXES[0]), 12)]))
    res.update(batch.step())
    res.update(batch.step())
    res.update(batch.add([RowSpec(k, tiny.encode_prefix(PREFIXES[k]), 12) for k in (1, 2)]))
    res.update(batch.step())
    res.update(batch.add([RowSpec(3, tiny.encode_prefix("Something else entirely"), 12)]))
    batch.remove([2])  # cancelled rows never produce a result
    res.update(batch.run())
    assert sorted(res) == [0, 1, 3]
    assert [res[k].token_ids for k in (0, 1, 3)] == [alone[k].token_ids for k in (0, 1, 3)]


def test_nested_prefixes_share_cached_columns(tiny):
    """An LR batch: prefix x, x + s0, x + s0 + s1, ... The longest is encoded once; the others copy its
    columns and encode a token or two of their own."""
    steps = ["First we add the numbers together carefully.\n\n", "Then we divide the total by two.\n\n",
             "Finally we check the result once more.\n\n"]
    nested = [PREFIXES[0] + "".join(steps[:j]) for j in range(4)]
    alone = [tiny.generate_steps([p], GREEDY)[0] for p in nested]
    batch = tiny.open_batch(GREEDY)
    res = dict(batch.add([RowSpec(i, tiny.encode_prefix(p), 12) for i, p in enumerate(nested)]))
    res.update(batch.run())
    assert [res[i].token_ids for i in range(4)] == [s.token_ids for s in alone]
    longest = len(tiny.encode_prefix(nested[-1])) - len(tiny.encode_prefix(nested[0]))
    assert batch.shared_tokens >= 2 * len(tiny.encode_prefix(nested[1]))  # rows 1, 2 reuse row 3's columns
    assert tiny.stats["shared_prefix_tokens"] > 0 and longest > 20


def test_dropping_unused_columns_keeps_results(tiny):
    alone = {k: tiny.generate_steps([p], GREEDY)[0] for k, p in enumerate(PREFIXES)}
    batch = tiny.open_batch(GREEDY)
    res = dict(batch.add([RowSpec(0, tiny.encode_prefix(PREFIXES[0]), 12), RowSpec(9, tiny.encode_prefix("Other"), 12)]))
    for _ in range(3):
        res.update(batch.step())
    batch.remove([9])  # its columns become holes
    res.update(batch.add([RowSpec(k, tiny.encode_prefix(PREFIXES[k]), 12) for k in (1, 2)]))
    dropped = 0
    while len(batch):
        before = batch.ncols
        batch._compact(min_cols=0, max_hole_share=0.0)  # drop every unused column
        assert batch.mask.shape[1] == batch.ncols and bool(batch.mask[:, len(batch.base_ids):].bool().any(0).all())
        dropped += before - batch.ncols
        res.update(batch.step())
    assert dropped > 0
    assert [res[k].token_ids for k in range(3)] == [alone[k].token_ids for k in range(3)]


def test_sampling_rows_are_seeded_per_row(tiny):
    p = SamplingParams(temperature=0.9, max_step_tokens=10)
    a = tiny.generate_steps(PREFIXES, p, seeds=[5, 6, 7])
    b = tiny.generate_steps(PREFIXES[::-1], p, seeds=[7, 6, 5])[::-1]
    assert [s.token_ids for s in a] == [s.token_ids for s in b]  # the row, not its place, decides
    assert tiny.generate_steps(PREFIXES[:1], p, seeds=[5])[0].token_ids == a[0].token_ids


@pytest.mark.parametrize("method", ["ngram", "assistant"])
def test_greedy_with_token_speculation_is_exactly_greedy(small, tiny, method):
    plain = [small.generate_steps([p], GREEDY)[0] for p in PREFIXES]
    before = dict(small.stats)
    small.set_token_spec(TokenSpecConfig(method, num_tokens=4, ngram_size=3),
                         assistant=tiny if method == "assistant" else None)
    try:
        spec = [small.generate_steps([p], GREEDY)[0] for p in PREFIXES]
        batched = small.generate_steps(PREFIXES, GREEDY)
    finally:
        small.set_token_spec(None)
    assert [s.token_ids for s in spec] == [s.token_ids for s in plain]
    assert [s.token_ids for s in batched] == [s.token_ids for s in plain]
    assert small.stats["spec_proposed"] > before["spec_proposed"]  # speculation really ran


def test_assistant_needs_the_same_tokenizer(small):
    from infer.models import load_tokenizer

    class Other:
        tokenizer = load_tokenizer("offline:minilm")
        model_name = "offline:minilm"

    with pytest.raises(ValueError, match="tokenizer"):
        AssistantProposer(Other(), small.tokenizer)
    with pytest.raises(ValueError, match="assistant engine"):
        small.set_token_spec(TokenSpecConfig("assistant"))


@pytest.mark.slow
def test_ngram_speculation_is_exact_on_real_smollm2():
    eng = HFStepEngine("offline:smollm2-135m-instruct", device="cpu")
    prefix = eng.format_prefix("Anna has 12 apples and 12 pears. She gives away 12 apples. "
                               "How many apples and pears does Anna have left?")
    params = SamplingParams(temperature=0, max_step_tokens=24)
    plain = eng.generate_steps([prefix], params)[0]
    eng.set_token_spec(TokenSpecConfig("ngram", num_tokens=8, ngram_size=3))
    spec = eng.generate_steps([prefix], params)[0]
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    assert eng.stats["spec_proposed"] > 0


def test_sample_from_inverts_the_cdf():
    from infer.engines.token_spec import sample_from

    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3])
    gen = torch.Generator().manual_seed(4)
    counts = torch.bincount(torch.tensor([sample_from(probs, gen) for _ in range(20000)]), minlength=5)
    assert counts[0] == 0 and counts[2] == 0  # zero-probability tokens are never drawn
    assert torch.allclose(counts / 20000.0, probs, atol=0.015)


def test_prefix_reuse_survives_retokenisation(tiny):
    """"...\\n\\n" is one token at the end of a text and two once text follows; the cached prefix is cut
    back to the shared tokens instead of re-encoding everything."""
    first = tiny.format_prefix("Question?", ["Step one is here.\n\n"])
    second = tiny.format_prefix("Question?", ["Step one is here.\n\n", "Step two."])
    a, b = tiny.encode_prefix(first), tiny.encode_prefix(second)
    assert b[:len(a)] != a  # the situation: not a token prefix
    tiny.clear_prefix_cache()
    tiny._prefill(a)
    before = dict(tiny.stats)
    _, logits = tiny._prefill(b)
    from infer.engines.hf import _common_prefix

    shared = _common_prefix(a, b)
    assert shared >= len(a) - 1
    assert tiny.stats["prefill_tokens"] - before["prefill_tokens"] == len(b) - shared
    tiny.clear_prefix_cache()
    _, fresh = tiny._prefill(b)
    assert torch.allclose(logits, fresh, atol=1e-4)
    assert _common_prefix([1, 2, 3, 4], [1, 2, 9]) == 2 and _common_prefix([], [1]) == 0
    assert _common_prefix([5, 6], [5, 6, 7]) == 2
