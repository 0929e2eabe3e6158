"""Lookahead Decoding: the pool and verification rules on tiny arrays, the one-pass layout,
and, on a tiny random Llama in float32, exactness of greedy decoding and losslessness of sampling."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specprobe.infer.engines.hf_kv import cache_keyword
from specprobe.infer.engines.lookahead_decoding import (
    JacobiProposer,
    LookaheadDecoder,
    NgramPool,
    window_branch,
)
from specprobe.infer.engines.sequence_kv import SequenceKV
from specprobe.infer.engines.token_spec import DraftTree, LookaheadConfig, SideBranch, block_layout, verify_tree


def greedy_verify(cands, argmax):
    """Verification of pool candidates as the decoder does it (a trie); argmax[j][i] is the target's argmax
    after the context plus cands[j][:i], turned into one-hot logits per trie node."""
    tree = DraftTree.trie(cands)
    rows = torch.zeros(len(tree) + 1, 10)
    for cand, am in zip(cands, argmax):
        u = -1
        for i, t in enumerate(cand):
            rows[u + 1, am[i]] = 1.0
            u = next(c for c in tree.children()[u] if tree.tokens[c] == t)
        rows[u + 1, am[len(cand)]] = 1.0
    return verify_tree(tree, rows, 0.0, 1.0, None)[0]


def sample_verify(cands, probs, gen):
    """Sampled verification of pool candidates: probs[j] row i is the target after cands[j][:i]."""
    tree = DraftTree.trie(cands)
    rows = torch.zeros(len(tree) + 1, probs[0].shape[-1])
    for cand, p in zip(cands, probs):
        u = -1
        for i, t in enumerate(cand):
            rows[u + 1] = p[i]
            u = next(c for c in tree.children()[u] if tree.tokens[c] == t)
        rows[u + 1] = p[len(cand)]
    return verify_tree(tree, torch.log(rows), 1.0, 1.0, gen)[0]


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


# ----------------------------------------------------------------------------- pure parts
def test_pool_keeps_the_newest_continuations_per_first_token():
    pool = NgramPool(per_key=2)
    for g in ([1, 2, 3], [1, 4, 5], [1, 2, 3], [1, 6, 7], [9, 9, 9]):
        pool.add(g)
    assert pool.lookup(1, 5) == [[6, 7], [2, 3]]  # [4, 5] evicted: [2, 3] was re-added after it
    assert pool.lookup(1, 1) == [[6, 7]] and pool.lookup(3, 4) == [] and len(pool) == 3


def test_greedy_verify_longest_matching_prefix_plus_one():
    cands = [[5, 6, 7], [5, 8, 1], [2, 2, 2]]
    argmax = [[5, 8, 0, 0], [5, 8, 1, 4], [5, 0, 0, 0]]  # row i: argmax after context + cand[:i]
    assert greedy_verify(cands, argmax) == [5, 8, 1, 4]  # candidate 1 matches in full, plus its bonus
    assert greedy_verify([[5, 6, 7]], [[5, 6, 9, 3]]) == [5, 6, 9]
    assert greedy_verify([[4, 6, 7], [3, 1, 1]], [[5, 0, 0, 0], [5, 0, 0, 0]]) == [5]  # none: one token
    assert greedy_verify([[5, 6], [5, 6]], [[5, 6, 2], [5, 6, 2]]) == [5, 6, 2]  # duplicates share their nodes


def test_sample_verify_is_lossless():
    """Three deterministic candidates, two sharing a first token: the first output token is distributed as
    p0 and the second, given the first, as the row reached by that token (duplicates included)."""
    p0 = torch.tensor([0.1, 0.45, 0.35, 0.1])
    after1 = torch.tensor([0.3, 0.1, 0.2, 0.4])
    after2 = torch.tensor([0.25, 0.25, 0.25, 0.25])
    cands = [[1, 3], [1, 0], [2, 2]]
    probs = [torch.stack([p0, after1, torch.tensor([0.7, 0.1, 0.1, 0.1])]),
             torch.stack([p0, after1, torch.tensor([0.1, 0.1, 0.7, 0.1])]),
             torch.stack([p0, after2, torch.tensor([0.1, 0.2, 0.3, 0.4])])]
    gen = torch.Generator().manual_seed(0)
    n = 8000
    first = torch.zeros(4)
    second = {1: torch.zeros(4), 2: torch.zeros(4)}
    for _ in range(n):
        out = sample_verify(cands, probs, gen)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[0]][out[1]] += 1
    assert torch.allclose(first / n, p0, atol=0.025)
    # a first token that is no candidate (0 or 3) ends the step; an accepted 1 or 2 always continues
    assert int(second[1].sum()) == int(first[1]) and int(second[2].sum()) == int(first[2])
    assert torch.allclose(second[1] / second[1].sum(), after1, atol=0.035)
    assert torch.allclose(second[2] / second[2].sum(), after2, atol=0.035)


def test_layout_masks_and_positions():
    # current token at position 10, a trie of [[4, 5], [4, 6]] (3 nodes), then 2 levels x 3 columns of window
    window, offsets = window_branch(2, 3)
    tree = replace(DraftTree.trie([[4, 5], [4, 6]]), side=SideBranch((7, 7, 7, 8, 8, 8), window, offsets))
    tokens, allowed, pos = block_layout(tree, cur_pos=10)
    assert tokens == [4, 5, 6, 7, 7, 7, 8, 8, 8]
    assert pos.tolist() == [11, 12, 12, 11, 12, 13, 12, 13, 14]

    def seen(r):
        return allowed[r].nonzero().flatten().tolist()

    assert seen(0) == [0] and seen(1) == [0, 1] and seen(2) == [0, 2]  # trie: its path only, no window
    assert seen(3) == [3] and seen(5) == [3, 4, 5]  # level 0: causal guess sequence
    assert seen(7) == [3, 4, 7]  # level 1, column 1: level 0 up to column 1, then itself


def test_the_jacobi_proposer_fills_its_pool_from_full_window_columns_and_forks_per_sequence():
    cfg = LookaheadConfig(window=2, ngram=3)
    first = JacobiProposer(cfg).fork(3)
    tree = first.propose([5, 6, 7], 2)
    assert len(tree) == 0 and len(tree.side.tokens) == 2  # one level until the window is full
    assert all(t in (5, 6, 7) for t in tree.side.tokens)  # the window starts from context tokens

    def logits_for(tokens):  # the target's greedy output on every window token
        out = torch.full((len(tokens), 10), -5.0)
        out[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
        return out

    first.observe(tree, logits_for([1, 2]))  # level 2 is (1, 2): the window is full (N - 1 = 2 levels)
    assert len(first.pool) == 0
    tree = first.propose([5, 6, 7], 2)
    assert tree.side.tokens[2:] == (1, 2) and len(tree.side.tokens) == 4
    first.observe(tree, logits_for([0, 0, 3, 4]))  # columns emit (level 0 [j], 1 or 2, new guess 3 or 4)
    lv0 = tree.side.tokens[:2]
    assert [1, 3] in first.pool.lookup(lv0[0], 5) and [2, 4] in first.pool.lookup(lv0[1], 5) and len(first.pool) == 2
    assert first.propose([9, 9], 2).side.tokens == (1, 2, 3, 4)  # slid: (1, 2) is now level 0
    # a row's window start is drawn apart from the row's own acceptance draws (seeded with the same seed)
    row_draws = torch.randint(1000, (8,), generator=torch.Generator().manual_seed(3))
    assert not torch.equal(torch.randint(1000, (8,), generator=JacobiProposer(cfg).fork(3).generator), row_draws)
    again = JacobiProposer(cfg).fork(3)
    assert len(again.pool) == 0 and again.levels is None  # a fork starts its own window and pool
    assert again.propose([5, 6, 7], 2).side.tokens == JacobiProposer(cfg).fork(3).propose([5, 6, 7], 2).side.tokens


# ----------------------------------------------------------------------------- tiny model
def _tiny_llama(vocab: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    # a wide initialiser gives peaked distributions: greedy margins far above float noise, and sampling
    # that accepts proposals often enough to be tested
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.3)
    return LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def _plain_greedy(model, prompt, n):
    from transformers import DynamicCache

    cache, out = DynamicCache(config=model.config), []
    inp = torch.tensor([prompt])
    for _ in range(n):
        res = model(input_ids=inp, use_cache=True, **{cache_keyword(model): cache})
        tok = int(res.logits[0, -1].argmax())
        out.append(tok)
        inp = torch.tensor([[tok]])
    full = model(torch.tensor([list(prompt) + out])).logits[0, len(prompt) - 1:-1]
    top2 = full.topk(2, -1).values
    return out, float((top2[:, 0] - top2[:, 1]).min())


PROMPT = [1, 5, 7, 9, 3, 4, 5, 7]


@pytest.mark.slow
def test_greedy_lookahead_equals_plain_greedy_decoding():
    model = _tiny_llama(48)
    ref, margin = _plain_greedy(model, PROMPT, 60)
    # batched/masked kernels differ from one-token decoding by ~1e-6 in float32; a margin this large
    # cannot flip, so equality is exact, not luck
    assert margin > 1e-3
    accepted = 0
    for w, n, g in [(4, 3, None), (5, 4, 2), (1, 2, 1), (3, 5, None)]:
        out, stats = LookaheadDecoder(SequenceKV(model), LookaheadConfig(w, n, g)).generate(PROMPT, 60)
        assert out == ref, (w, n, g)
        assert stats.tokens == 60 and stats.forward_passes + stats.accepted >= 60 > stats.forward_passes
        accepted += stats.accepted
    assert accepted > 0  # the verification branch really accepted pool n-grams


def test_the_decoder_hands_the_window_its_own_outputs(monkeypatch):
    """What `observe` receives are the target's logits on the window tokens, as plain forwards compute them:
    level 0 is a causal guess sequence after the context (a wrong slice or position fails here, while the
    output stays exact and only acceptance suffers)."""
    model = _tiny_llama(48)
    seen = []
    real = JacobiProposer.observe

    def spy(self, tree, side_logits):
        seen.append((list(tree.side.tokens), side_logits.clone(), len(self.levels)))
        real(self, tree, side_logits)

    monkeypatch.setattr(JacobiProposer, "observe", spy)
    LookaheadDecoder(SequenceKV(model), LookaheadConfig(window=4, ngram=3)).generate(PROMPT, 1)
    tokens, side_logits, levels = seen[0]
    assert levels == 1 and len(tokens) == 4
    with torch.no_grad():
        plain = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT):]
    assert torch.allclose(side_logits, plain, atol=1e-4)


def test_greedy_lookahead_stops_where_plain_decoding_stops():
    model = _tiny_llama(48)
    ref, margin = _plain_greedy(model, PROMPT, 60)
    assert margin > 1e-3  # no near-tie: the exact comparison below cannot hang on float rounding
    stop_tok = ref[25]
    out, _ = LookaheadDecoder(SequenceKV(model), LookaheadConfig(4, 3)).generate(PROMPT, 60, stop=lambda t: t[-1] == stop_tok)
    assert out == ref[:ref.index(stop_tok) + 1]


@pytest.mark.slow
def test_sampled_lookahead_keeps_the_models_token_distribution():
    """Tokens 1 and 2 of sampled lookahead decoding (pool seeded from a repetitive prompt, so proposals
    are verified from the first step) against the model's exact marginals."""
    vocab = 6
    model = _tiny_llama(vocab, seed=1)
    prompt = [1, 2, 3, 1, 2, 4, 1, 2, 3, 1]
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
        rows = torch.softmax(model(torch.tensor([prompt + [t] for t in range(vocab)])).logits[:, -1], -1)
    p2 = p1 @ rows  # marginal of the second token
    dec = LookaheadDecoder(SequenceKV(model), LookaheadConfig(window=2, ngram=3))
    n = 1500
    c1, c2 = torch.zeros(vocab), torch.zeros(vocab)
    accepted = 0
    for s in range(n):
        out, stats = dec.generate(prompt, 2, temperature=1.0, seed=s, prompt_pool=True)
        c1[out[0]] += 1
        c2[out[1]] += 1
        accepted += stats.accepted
    assert accepted > n // 10  # proposals were accepted in many runs
    assert torch.allclose(c1 / n, p1, atol=0.045) and torch.allclose(c2 / n, p2, atol=0.045)
