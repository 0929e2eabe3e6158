"""Token-level speculation inside steps: the pure rules on tiny arrays, and exactness of the engine.

Greedy decoding with speculation (prompt lookup, an assistant model, Lookahead Decoding) must write exactly the tokens
plain greedy decoding writes; the sampling rule must leave every token distributed as p.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specprobe.infer.engines import HFStepEngine, Prefix, SamplingParams, StepRequest
from specprobe.infer.engines.device_sampling import outside_nucleus
from specprobe.infer.engines.hf_kv import DecodeBatch, RowSpec, cache_keyword, common_prefix_len
from specprobe.infer.engines.static_kv import FastDecodeBatch
from specprobe.infer.engines.token_spec import (
    AssistantProposer,
    DraftTree,
    LookaheadConfig,
    NgramProposer,
    SideBranch,
    TokenSpecConfig,
    draw_tokens,
    drawn_rows,
    filtered_probs,
    ngram_propose,
    path_logprobs,
)

from _buffers import small_static_buffers
from _margins import assert_same_greedy


# ----------------------------------------------------------------------------- pure rules
def test_ngram_propose_uses_most_recent_match_and_backs_off():
    ctx = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert ngram_propose(ctx, 3, 2) == [7, 8]  # most recent earlier [1,2,3] is followed by 7, 8
    assert ngram_propose(ctx, 3, 10) == [7, 8, 5, 1, 2, 3]  # runs up to the end of the context
    assert ngram_propose([4, 5, 6, 5], 3, 2) == [6, 5]  # no 3- or 2-gram match: the 1-gram [5] matches
    assert ngram_propose([4, 5, 6, 5], 3, 2, min_ngram=2) == []
    assert ngram_propose([1, 2, 3], 3, 4) == []
    assert ngram_propose([], 3, 4) == [] and ngram_propose([1, 1], 2, 0) == []


def greedy_accept(proposal, target_argmax):
    """The chain rule under greedy decoding, with the target's argmax per position as one-hot logits."""
    return draw_tokens(proposal, torch.nn.functional.one_hot(torch.tensor(target_argmax), 10).float(), 0.0, 1.0, None)


def sample_accept(proposal, probs, gen):
    """The chain rule under sampling at temperature 1 (softmax of log p gives p back)."""
    return draw_tokens(proposal, torch.log(probs), 1.0, 1.0, gen)


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


def test_draft_trees_chain_trie_and_checks():
    chain = DraftTree.chain([4, 5, 6])
    assert chain.parents == (-1, 0, 1) and chain.is_chain and chain.depths() == [1, 2, 3]
    trie = DraftTree.trie([[1, 3], [1, 0], [2, 2], [1, 3]])  # common prefixes merged, first appearance first
    assert trie.tokens == (1, 3, 0, 2, 2) and trie.parents == (-1, 0, 0, -1, 3) and not trie.is_chain
    assert trie.children() == {-1: [0, 3], 0: [1, 2], 3: [4]} and trie.depths() == [1, 2, 2, 1, 2]
    assert trie.ancestry()[4].nonzero().flatten().tolist() == [3, 4]
    assert len(DraftTree.trie([])) == 0 and DraftTree().is_chain
    with pytest.raises(ValueError, match="before their children"):
        DraftTree((1, 2), (1, -1))
    with pytest.raises(ValueError, match="one parent per token"):
        DraftTree((1, 2), (-1,))
    side = SideBranch((7, 8), torch.tril(torch.ones(2, 2, dtype=torch.bool)), (1, 2))
    assert not replace(chain, side=side).is_chain  # a side branch needs the 4-D mask
    assert chain.reach() == 3 and replace(trie, side=side).reach() == 2 and DraftTree().reach() == 0
    with pytest.raises(ValueError, match="side branch of 2 tokens"):
        SideBranch((7, 8), torch.ones(2, 3, dtype=torch.bool), (1, 2))


def test_a_verified_paths_tokens_are_scored_at_the_rows_they_were_drawn_from():
    # tokens drawn after the context (row 0), after node 2 (row 3) and after node 4 (row 5)
    assert drawn_rows([2, 4, -2]) == [0, 3, 5] and drawn_rows([-2]) == [0]
    logits = torch.log(torch.tensor([[0.5, 0.5, 0.0], [0.1, 0.1, 0.8], [0.2, 0.2, 0.6], [0.3, 0.3, 0.4],
                                     [0.6, 0.2, 0.2], [0.9, 0.05, 0.05]]) + 1e-12)
    got = path_logprobs([1, 2, 0], [2, 4, -2], logits)
    assert got == pytest.approx([float(torch.log(torch.tensor(x))) for x in (0.5, 0.4, 0.9)], abs=1e-5)


def test_the_proposers_return_chains():
    tree = NgramProposer(3).propose([1, 2, 3, 9, 1, 2, 3], 2)
    assert tree == DraftTree.chain([9, 1])


def test_the_nucleus_keeps_tokens_until_the_mass_before_them_reaches_top_p():
    # dyadic probabilities: the sums are exact, so the boundary case does not depend on rounding
    p = torch.tensor([[0.5, 0.25, 0.125, 0.125]])
    assert outside_nucleus(p, 0.75).tolist() == [[False, False, True, True]]  # 0.5 + 0.25 reaches 0.75
    assert outside_nucleus(p, 0.8).tolist() == [[False, False, False, True]]
    assert outside_nucleus(p, 0.1).tolist() == [[False, True, True, True]]  # the first token always stays
    assert outside_nucleus(p, 1.0).tolist() == [[False, False, False, False]]


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
Q0 = "What is 2 + 2? 2 + 2 = 4. What is 2 + 2?"
PREFIXES = [Prefix(Q0), Prefix(Q0, ("First step.",)), Prefix(Q0, ("First step.", "A much longer second step here."))]
OTHER = Prefix("Something else entirely")


def gen(engine, prefixes, params=GREEDY, seeds=None, caps=None):
    seeds = seeds or [None] * len(prefixes)
    caps = caps or [None] * len(prefixes)
    return [r[0] for r in engine.generate([StepRequest(p, 1, s, c) for p, s, c in zip(prefixes, seeds, caps)],
                                          params).steps]


def same_greedy(engine, prefix, got, want):
    """Greedy rows of two computations agree up to the reference's first near-tie (see tests/_margins.py)."""
    return assert_same_greedy(engine.model, engine.prefix_ids(prefix), got.token_ids, want.token_ids, at_least=4)


def test_batch_of_different_prefixes_equals_each_row_alone(tiny):
    alone = [gen(tiny, [p])[0] for p in PREFIXES]
    batched = gen(tiny, PREFIXES)
    for p, b, a in zip(PREFIXES, batched, alone):
        same_greedy(tiny, p, b, a)
    # a delimiter a random model does not write: the caps alone end these rows, on any CPU's rounding
    caps = gen(tiny, PREFIXES, SamplingParams(temperature=0, max_step_tokens=12, delimiter="\n\n\n\n"),
               caps=[3, 5, 50])
    assert [s.num_tokens for s in caps] == [3, 5, 12] and {s.stop_reason for s in caps} == {"length"}
    for p, c, a in zip(PREFIXES, caps, alone):
        same_greedy(tiny, p, c, type(a)(a.text, a.token_ids[:c.num_tokens], a.stop_reason, a.logprob))


def test_rows_joining_a_running_batch_decode_as_if_alone(tiny):
    alone = [gen(tiny, [p])[0] for p in PREFIXES + [OTHER]]
    stream = tiny.open_stream(GREEDY)
    res = dict(stream.add([(0, StepRequest(PREFIXES[0]))]))
    res.update(stream.step())
    res.update(stream.step())
    res.update(stream.add([(k, StepRequest(PREFIXES[k])) for k in (1, 2)]))
    res.update(stream.step())
    res.update(stream.add([(3, StepRequest(OTHER))]))
    stream.cancel([2])  # cancelled rows never produce a result
    while len(stream):
        res.update(stream.step())
    assert sorted(res) == [0, 1, 3]
    for k, p in zip((0, 1, 3), (PREFIXES[0], PREFIXES[1], OTHER)):
        same_greedy(tiny, p, res[k], alone[k])
    work = stream.take_stats()
    assert work.iterations >= 4 and work.generated_tokens == sum(res[k].num_tokens for k in (0, 1, 3))
    assert stream.take_stats().iterations == 0  # taken: the counters start again


def test_nested_prefixes_share_cached_columns(tiny):
    """An LR batch: prefix x, x + s0, x + s0 + s1, ... The longest is encoded once; the others copy its
    columns and encode a token or two of their own."""
    steps = ["First we add the numbers together carefully.", "Then we divide the total by two.",
             "Finally we check the result once more."]
    nested = [Prefix(Q0, tuple(steps[:j])) for j in range(4)]
    alone = [gen(tiny, [p])[0] for p in nested]
    tiny.clear_prefix_cache()
    out = tiny.generate([StepRequest(p) for p in nested], GREEDY)
    for p, got, want in zip(nested, out.steps, alone):
        same_greedy(tiny, p, got[0], want)
    ids = [tiny.prefix_ids(p) for p in nested]
    assert all(ids[j] == ids[-1][:len(ids[j])] for j in range(4))  # given steps encode as nested token lists
    # rows 0..2 reuse row 3's columns; only the longest prefix is encoded (plus 1 own token per shorter row)
    assert out.stats.prefill_tokens <= len(ids[-1]) + 3


def test_dropping_unused_columns_keeps_results(tiny):
    alone = {k: gen(tiny, [p])[0] for k, p in enumerate(PREFIXES)}
    stream = tiny.open_stream(GREEDY)
    batch = stream.batch
    res = dict(stream.add([(0, StepRequest(PREFIXES[0])), (9, StepRequest(Prefix("Other")))]))
    for _ in range(3):
        res.update(stream.step())
    stream.cancel([9])  # its columns become holes
    res.update(stream.add([(k, StepRequest(PREFIXES[k])) for k in (1, 2)]))
    dropped = 0
    while len(stream):
        before = batch.ncols
        batch._compact(min_cols=0, max_hole_share=0.0)  # drop every unused column
        assert batch.mask.shape[1] == batch.ncols and bool(batch.mask[:, len(batch.base_ids):].bool().any(0).all())
        dropped += before - batch.ncols
        res.update(stream.step())
    assert dropped > 0
    for k in range(3):
        same_greedy(tiny, PREFIXES[k], res[k], alone[k])


@pytest.mark.parametrize("method", ["ngram", "assistant", "lookahead"])
def test_greedy_with_token_speculation_is_exactly_greedy(small, tiny, method):
    plain = [gen(small, [p])[0] for p in PREFIXES]
    view = small.with_token_spec(TokenSpecConfig(method, num_tokens=4, ngram_size=3,
                                                 lookahead=LookaheadConfig(window=4, ngram=3)),
                                 assistant=tiny if method == "assistant" else None)
    spec = [view.generate([StepRequest(p)], GREEDY) for p in PREFIXES]
    batched = gen(view, PREFIXES)
    for p, s, b, want in zip(PREFIXES, spec, batched, plain):
        same_greedy(small, p, s.steps[0][0], want)
        same_greedy(small, p, b, want)
    assert sum(s.stats.spec_accepted for s in spec) > 0  # speculation really ran and was accepted
    if method == "assistant":
        assert sum(s.stats.proposer_forward_passes for s in spec) > 0
    # chosen per call: the engine itself never speculates, before or after the view's calls
    again = small.generate([StepRequest(PREFIXES[0])], GREEDY)
    assert small.token_spec is None and again.stats.spec_proposed == 0
    assert view.with_token_spec(None).token_spec is None and view.token_spec is not None


def test_assistant_needs_the_same_tokenizer(small):
    other = HFStepEngine("random:llama-tiny", device="cpu", use_chat_template=False)
    other.info.tokenizer_id = "another-vocabulary"
    with pytest.raises(ValueError, match="tokenizer"):
        AssistantProposer(other, small.info.tokenizer_id)
    with pytest.raises(ValueError, match="assistant engine"):
        small.with_token_spec(TokenSpecConfig("assistant"))


@pytest.mark.slow
def test_ngram_speculation_is_exact_on_real_smollm2():
    eng = HFStepEngine("offline:smollm2-135m-instruct", device="cpu")
    prefix = Prefix("Anna has 12 apples and 12 pears. She gives away 12 apples. "
                    "How many apples and pears does Anna have left?")
    params = SamplingParams(temperature=0, max_step_tokens=24)
    plain = gen(eng, [prefix], params)[0]
    out = eng.with_token_spec(TokenSpecConfig("ngram", num_tokens=8, ngram_size=3)).generate([StepRequest(prefix)],
                                                                                            params)
    assert_same_greedy(eng.model, eng.prefix_ids(prefix), out.steps[0][0].token_ids, plain.token_ids, at_least=8)
    assert out.stats.spec_proposed > 0


def test_sample_from_inverts_the_cdf():
    from specprobe.infer.engines.token_spec import sample_from

    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3])
    gen = torch.Generator().manual_seed(4)
    counts = torch.bincount(torch.tensor([sample_from(probs, gen) for _ in range(20000)]), minlength=5)
    assert counts[0] == 0 and counts[2] == 0  # zero-probability tokens are never drawn
    assert torch.allclose(counts / 20000.0, probs, atol=0.015)


def test_prefix_cache_reuses_the_longest_shared_token_prefix(tiny):
    """A cached prefix that is not a token prefix of the new one is cut back to the shared tokens instead
    of re-encoding everything; the logits equal a fresh computation."""
    from specprobe.infer.engines.base import EngineStats

    a = tiny.prefix_ids(Prefix("Question?", ("Step one is here.",)))
    b = a[:-1] + tiny.text.text_ids(" and more.\n\nStep two.")
    runner = tiny.runner
    runner.clear()
    runner.prefill(a, EngineStats())
    work = EngineStats()
    _, logits = runner.prefill(b, work)
    shared = common_prefix_len([a, b])
    assert shared == len(a) - 1
    assert work.prefill_tokens == len(b) - shared and work.reused_prefix_tokens == shared
    runner.clear()
    _, fresh = runner.prefill(b, EngineStats())
    assert torch.allclose(logits, fresh, atol=1e-4)
    assert common_prefix_len([[1, 2, 3, 4], [1, 2, 9]]) == 2 and common_prefix_len([[], [1]]) == 0


class _KnownTreeProposer:
    """A test double for the batch's tree path. While a row's output follows its known greedy continuation it
    proposes a tree whose first child is wrong and whose second child is the true continuation, `depth` deep,
    then one wrong token; beside it a side branch of the next two true tokens, whose outputs it records. Rows it
    does not know get no proposal."""

    def __init__(self, known: dict[tuple[int, ...], list[int]], depth: int, vocab: int):
        self.known, self.depth, self.vocab = known, depth, vocab
        self.rounds: list[tuple[int, int]] = []  # (tokens written before the round, true depth proposed)
        self.side_argmax: list[tuple[int, list[int]]] = []

    def fork(self, seed):
        return self

    def propose(self, context, k, stats=None):
        for prompt, ref in self.known.items():
            done = len(context) - len(prompt)
            if tuple(context[:len(prompt)]) != prompt or list(context[len(prompt):]) != ref[:done]:
                continue
            d = min(k - 1, self.depth, len(ref) - done - 1)
            if d < 1:
                return DraftTree()
            self.rounds.append((done, d))
            truth, wrong = ref[done:done + d], (ref[done] + 1) % self.vocab
            side = SideBranch(tuple(ref[done:done + 2]), torch.tril(torch.ones(2, 2, dtype=torch.bool)), (1, 2))
            return replace(DraftTree.trie([[wrong], truth + [(ref[done + d] + 1) % self.vocab]]), side=side)
        return DraftTree()

    def observe(self, tree, side_logits):
        self.side_argmax.append((self.rounds[-1][0], side_logits.argmax(-1).tolist()))


@pytest.mark.slow
@pytest.mark.parametrize("batch_class,column_block", [(DecodeBatch, None), (FastDecodeBatch, None),
                                                      (FastDecodeBatch, 8)])
def test_tree_proposals_in_a_batch_keep_only_the_accepted_paths_columns(batch_class, column_block, monkeypatch):
    """Real SmolLM2 weights, so that a wrong column, mask or position changes the output. Claims are checked only
    over the reference's stretch of clear argmax margins (tests/_margins.py). Both decode paths: the eager batch
    crops what no row kept, the fast one leaves it in its static buffers unseen; with 8-column blocks the fast
    batch's buffers are compacted (at a join, where nothing is dropped) and grown while rows live, and every row
    must still see exactly its own columns and keep its own KV."""
    compacted = small_static_buffers(monkeypatch, column_block) if column_block is not None else []
    eng = HFStepEngine("offline:smollm2-135m-instruct", device="cpu")
    params = SamplingParams(temperature=0, max_step_tokens=20)
    prefixes = [Prefix("Anna has 12 apples. She buys 5 more and eats 3. How many are left?"),
                Prefix("Name three prime numbers.")]
    plain = gen(eng, prefixes, params)
    ids = [eng.prefix_ids(p) for p in prefixes]
    ref = list(plain[0].token_ids)
    proposer = _KnownTreeProposer({tuple(ids[0]): ref}, depth=3, vocab=eng.info.vocab_size)
    batch = batch_class(eng.runner, eng.text, params, proposer=proposer, spec_tokens=5)
    out = dict(batch.add([RowSpec(0, ids[0], 20, keep=True)]))
    out.update(batch.step())
    out.update(batch.add([RowSpec(1, ids[1], 20, keep=True)]))  # joins a batch with tree holes; never proposes
    while batch.rows:
        out.update(batch.step())
        if column_block is not None:  # each row sees exactly its prompt and fed tokens, through every compaction
            for r in batch.rows:
                seen = batch.kv.mask[r.slot].nonzero().flatten().tolist()
                assert seen == sorted(r.cols + r.gen_cols), (r.key, seen, r.cols + r.gen_cols)
    trusted = [assert_same_greedy(eng.model, ids[k], out[k].token_ids, plain[k].token_ids, at_least=10 - 2 * k)
               for k in range(2)]  # row 0: two rounds of 1 + 3 tokens after the first
    # each round accepted the true child exactly as deep as it was proposed (the next round starts there)
    checked = [(a, b) for a, b in zip(proposer.rounds, proposer.rounds[1:]) if a[0] + a[1] + 1 <= trusted[0]]
    assert len(checked) >= 2 and all(b[0] - a[0] == a[1] + 1 for a, b in checked), proposer.rounds
    # the side branch's outputs are the target's: after ref[done + j] comes ref[done + j + 1]
    sides = [(done + j + 1, top) for done, tops in proposer.side_argmax for j, top in enumerate(tops)]
    assert all(top == ref[m] for m, top in sides if m < trusted[0]) and any(m < trusted[0] for m, _ in sides)
    # a finished row's kept KV (prompt + step but its last token) continues exactly like a fresh prefill, and its
    # log-probability is its tokens' (each scored at the row it was drawn from: the true child is node 1, not 0)
    for k in range(2):
        seq = ids[k] + list(out[k].token_ids)
        with torch.inference_mode():
            lsm = torch.log_softmax(eng.model(torch.tensor([seq])).logits[0].float(), -1)
        n = len(ids[k])
        assert out[k].logprob == pytest.approx(sum(float(lsm[n - 1 + j, t]) for j, t in enumerate(seq[n:])), abs=1e-3)
        cache, _ = batch.finished_kv[tuple(seq[:-1])]
        assert cache.get_seq_length() == len(seq) - 1
        with torch.inference_mode():
            kept = eng.model(torch.tensor([seq[-1:]]), **{cache_keyword(eng.model): cache},
                             position_ids=torch.tensor([[len(seq) - 1]])).logits[0, -1]
            fresh = eng.model(torch.tensor([seq])).logits[0, -1]
        assert torch.allclose(kept.float(), fresh.float(), atol=1e-3 * float(fresh.abs().max()))
    assert column_block is None or any(compacted)  # the columns were compacted or grown while rows lived


def test_lookahead_rows_near_the_models_last_position_stop_speculating(tiny, monkeypatch):
    """A Jacobi window reaches W + N - 2 positions past the current token: near max_length a row decodes
    without it rather than feeding positions the model does not have."""
    from specprobe.infer.engines.lookahead_decoding import JacobiProposer

    ids = tiny.prefix_ids(PREFIXES[0])
    limit = len(ids) + 12
    seen = []
    forward = tiny.runner.forward

    def spy(stats, **kw):
        seen.append(int(kw["position_ids"].max()))
        return forward(stats, **kw)

    monkeypatch.setattr(tiny.runner, "forward", spy)
    batch = DecodeBatch(tiny.runner, tiny.text, SamplingParams(temperature=0, max_step_tokens=12, delimiter="\n\n\n\n"),
                        max_length=limit, proposer=JacobiProposer(LookaheadConfig(window=4, ngram=3)), spec_tokens=4)
    batch.add([RowSpec(0, ids, 12)])
    out = batch.run()
    assert out[0].num_tokens == 12 and max(seen) < limit
    assert batch.stats.decode_tokens > 2 * 12  # the window was fed while it fit
