"""The fast decode path (`infer.engines.static_kv`, `infer.engines.decode_step`, `infer.engines.device_sampling`) against the eager one.

Greedy steps must equal the eager path's (up to a near-tie of the reference: `_margins`), for single
rows, nested-prefix batches, different questions side by side, and rows that join and leave a running
stream, with and without token speculation inside steps; seeded sampling must reproduce and draw from the
eager path's distribution (chi-square).
"""
from __future__ import annotations

import math

import pytest
import torch

from specprobe.infer.engines import HFStepEngine, Prefix, SamplingParams, StepRequest, decode_step, static_kv
from specprobe.infer.engines.base import EngineStats
from specprobe.infer.engines.device_sampling import nucleus_logprobs, sample_tokens, seed_key, uniforms
from specprobe.infer.engines.hf_kv import DecodeBatch, RowSpec
from specprobe.infer.engines.static_kv import FastDecodeBatch
from specprobe.infer.engines.token_spec import (
    DraftTree,
    LookaheadConfig,
    StatelessProposer,
    TokenSpecConfig,
    filtered_probs,
)

from _buffers import small_static_buffers
from _margins import assert_same_greedy
from _stats import chi_square_p

GREEDY = SamplingParams(temperature=0.0, max_step_tokens=24)
QUESTIONS = ["A baker makes 12 muffins per tray and bakes 4 trays. She sells 30 muffins. How many muffins are left? "
             "Think step by step.",
             "Tom has 3 apples. He buys 2 more apples and eats 1. How many apples does he have?"]


# ----------------------------------------------------------------------------- pure sampling rules
def test_uniforms_are_uniform_reproducible_and_row_independent():
    keys = torch.tensor([seed_key(s) for s in range(64)])
    counters = torch.arange(64)
    u = uniforms(keys, counters, 1000)
    assert u.shape == (64, 1000) and bool(((u > 0) & (u < 1)).all())
    assert torch.equal(u, uniforms(keys, counters, 1000))  # counter-based: no state
    assert torch.equal(u[5], uniforms(keys[5:6], counters[5:6], 1000)[0])  # a row alone draws the same
    counts = torch.histc(u.flatten(), bins=10, min=0, max=1).long().tolist()
    assert chi_square_p(counts, [0.1] * 10) > 1e-3
    assert not torch.equal(u[0], uniforms(keys[:1], counters[:1] + 1, 1000)[0])  # the counter matters
    assert abs(float(torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1])) < 0.02


def test_seed_keys_differ_for_nearby_and_large_seeds():
    keys = {seed_key(s) for s in list(range(1000)) + [2**62 + 1, 2**62 + 2, -1]}
    assert len(keys) == 1003


def test_nucleus_matches_the_eager_distribution():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=gen) * 3
    for temperature, top_p in ((0.6, 0.95), (1.0, 1.0), (0.3, 0.5), (1.3, 0.9)):
        fast = nucleus_logprobs(logits, temperature, top_p).exp()
        eager = filtered_probs(logits, temperature, top_p)
        assert torch.allclose(fast, eager, atol=1e-6), (temperature, top_p)


@pytest.mark.parametrize("temperature,top_p", [(0.7, 0.9), (1.0, 1.0)])
def test_sample_tokens_draw_from_the_filtered_distribution(temperature, top_p):
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.2, -0.5, -1.0, -3.0, 0.8]])
    draws = 20000
    keys = torch.full((draws,), seed_key(7))
    tok, lp = sample_tokens(logits.expand(draws, -1), temperature, top_p, keys, torch.arange(draws))
    probs = filtered_probs(logits[0], temperature, top_p).tolist()
    counts = torch.bincount(tok, minlength=8).tolist()
    assert chi_square_p(counts, probs) > 1e-3
    assert all(c == 0 for c, p in zip(counts, probs) if p == 0)  # outside the nucleus: never
    # the reported log-probability is the model's own (unfiltered) one
    assert torch.allclose(lp, torch.log_softmax(logits[0], -1)[tok])


def test_sample_tokens_greedy_is_argmax_and_power_catches_a_shift():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    tok, _ = sample_tokens(logits, 0.0, 1.0, torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long))
    assert tok.tolist() == logits.argmax(-1).tolist()
    # the test has the power to see a 1-point shift of mass: drawing at T = 0.9 is rejected against T = 1
    row = torch.tensor([[1.0, 0.9, 0.8, 0.5, 0.0]])
    draws = 40000
    tok, _ = sample_tokens(row.expand(draws, -1), 0.9, 1.0, torch.full((draws,), seed_key(3)), torch.arange(draws))
    assert chi_square_p(torch.bincount(tok, minlength=5).tolist(), filtered_probs(row[0], 1.0, 1.0).tolist()) < 1e-3


# ----------------------------------------------------------------------------- the engine on SmolLM2
@pytest.fixture(scope="module")
def engines(smol_engine, one_thread):
    fast = HFStepEngine("offline:smollm2-135m-instruct", model=smol_engine.model, tokenizer=smol_engine.tokenizer,
                        decode="fast")
    assert fast.decode == "fast" and smol_engine.decode == "eager"  # "auto" on CPU is the eager path
    return smol_engine, fast


def _same_greedy(model, engine, prefix, got, want):
    return assert_same_greedy(model, engine.prefix_ids(prefix), got.token_ids, want.token_ids, at_least=4)


@pytest.mark.slow
def test_greedy_steps_equal_the_eager_path(engines):
    eager, fast = engines
    step1 = eager.generate([StepRequest(Prefix(QUESTIONS[0]))], GREEDY).steps[0][0]
    step2 = eager.generate([StepRequest(Prefix(QUESTIONS[0], (step1,)))], GREEDY).steps[0][0]
    cases = [
        [Prefix(QUESTIONS[0])],  # one row
        [Prefix(QUESTIONS[0]), Prefix(QUESTIONS[0], (step1,)), Prefix(QUESTIONS[0], (step1, step2))],  # nested (LR)
        [Prefix(QUESTIONS[0]), Prefix(QUESTIONS[1])],  # different questions: no shared base beyond the template
    ]
    whole = 0
    for prefixes in cases:
        reqs = [StepRequest(p) for p in prefixes]
        eager.clear_prefix_cache()
        fast.clear_prefix_cache()
        want, got = eager.generate(reqs, GREEDY), fast.generate(reqs, GREEDY)
        for p, (w,), (g,) in zip(prefixes, want.steps, got.steps):
            n = _same_greedy(eager.model, eager, p, g, w)
            if n == w.num_tokens:
                whole += 1
                assert (g.text, g.stop_reason) == (w.text, w.stop_reason)
                assert g.logprob == pytest.approx(w.logprob, abs=1e-3)
        assert got.stats.generated_tokens == sum(s.num_tokens for (s,) in got.steps)
    assert whole >= 4


def _nested_batch(eager):
    """A Lookahead batch's prefixes (each continues the one before by a greedy step), its requests, the eager path's
    steps for them, and the first step."""
    step1 = eager.generate([StepRequest(Prefix(QUESTIONS[0]))], GREEDY).steps[0][0]
    step2 = eager.generate([StepRequest(Prefix(QUESTIONS[0], (step1,)))], GREEDY).steps[0][0]
    prefixes = [Prefix(QUESTIONS[0]), Prefix(QUESTIONS[0], (step1,)), Prefix(QUESTIONS[0], (step1, step2))]
    reqs = [StepRequest(p) for p in prefixes]
    eager.clear_prefix_cache()
    return prefixes, reqs, eager.generate(reqs, GREEDY), step1


def _padded(fast) -> HFStepEngine:
    """A fast engine whose joins run as chunks padded to their widths (what a captured step does on CUDA), eagerly."""
    padded = HFStepEngine("offline:smollm2-135m-instruct", model=fast.model, tokenizer=fast.tokenizer, decode="fast")
    padded.decode_step = decode_step.DecodeStep(fast.model, "none", bucket_chunks=True)
    return padded


@pytest.mark.slow
def test_nested_prefixes_are_encoded_once_in_one_row(engines):
    """A Lookahead batch's rows (each prefix continues the one before) cost one one-row forward of the longest, which
    keeps the logits after every row's prompt; the rows copy its columns and forward nothing more. Called again, the
    prefix cache holds the longest: the forward starts at the first row's last token, so that it still gives every
    row's logits. Both write the eager steps."""
    eager, fast = engines
    prefixes, reqs, want, _ = _nested_batch(eager)
    fast.clear_prefix_cache()
    first = fast.generate(reqs, GREEDY)
    assert first.stats.prefill_tokens == len(fast.prefix_ids(prefixes[-1]))  # each token encoded once
    assert first.stats.forward_passes == first.stats.iterations  # the longest's forward, then one per decode step
    assert first.stats.reused_prefix_tokens == 0  # what this call encoded is not served from a cache
    again = fast.generate(reqs, GREEDY)
    assert again.stats.prefill_tokens == len(fast.prefix_ids(prefixes[-1])) - len(fast.prefix_ids(prefixes[0])) + 1
    assert again.stats.forward_passes == again.stats.iterations
    for got in (first, again):
        for p, (w,), (g,) in zip(prefixes, want.steps, got.steps):
            _same_greedy(eager.model, eager, p, g, w)


@pytest.mark.slow
def test_rows_joining_a_nested_batch_write_the_eager_steps(engines):
    """Rows joining a running batch whose base is its nested rows' longest: one that is the base's own prefix (its
    logits kept: it forwards nothing) beside one that continues it (one forward of its tail) write the eager path's
    steps for their prompts, as do the rows already running."""
    eager, fast = engines
    steps = []
    for _ in range(3):
        steps.append(eager.generate([StepRequest(Prefix(QUESTIONS[0], tuple(steps)))], GREEDY).steps[0][0])
    prompts = [fast.prefix_ids(Prefix(QUESTIONS[0], tuple(steps[:j]))) for j in range(4)]
    first = [RowSpec(j, prompts[j], GREEDY.max_step_tokens) for j in range(3)]
    later = [RowSpec(3, prompts[0], GREEDY.max_step_tokens), RowSpec(4, prompts[3], GREEDY.max_step_tokens)]
    results = []
    for batch in (FastDecodeBatch(fast.runner, fast.text, GREEDY, pool=fast.kv_pool, decode_step=fast.decode_step),
                  DecodeBatch(eager.runner, eager.text, GREEDY)):
        batch.runner.clear()
        done = dict(batch.add(first))
        for _ in range(2):
            done.update(batch.step())
        done.update(batch.add(later))
        done.update(batch.run())
        results.append(done)
    got, want = results
    for k, p in enumerate(prompts[:3] + [prompts[0], prompts[3]]):
        assert_same_greedy(eager.model, p, got[k].token_ids, want[k].token_ids, at_least=4)
    # the same prompt, joined later beside a tail's forward: the same tokens (up to a near-tie) and log-probability
    assert_same_greedy(eager.model, prompts[0], got[3].token_ids, got[0].token_ids, at_least=4)
    if got[3].token_ids == got[0].token_ids:
        assert got[3].logprob == pytest.approx(got[0].logprob, abs=1e-3)


@pytest.mark.slow
def test_chunks_padded_to_their_widths_write_the_eager_steps(engines):
    """On CUDA a join's chunk forward is padded to one of CHUNK_WIDTHS (its capture per width): pad tokens at the
    positions after each tail, into columns no row's mask takes, and one kept logits row per slot. Run eagerly here
    (bucket_chunks): rows of different questions, a step continuing a cached one by a whole step's tokens (a draft
    taking the target's step), and rows joining a running batch (one continuing a running row's prompt) write the
    eager path's steps."""
    eager, fast = engines
    padded = _padded(fast)
    assert [padded.decode_step.chunk_width(m) for m in (1, 16, 17, 600)] == [16, 16, 32, 600]
    step = padded.decode_step
    assert step.chunks_for(4, 128) and not step.chunks_for(8, 128) and not step.chunks_for(32, 16)  # larger: eager
    assert not step.chunks_for(1, 600) and not step.chunks_for(1, 17)  # a width past the buckets, or not one
    step1 = eager.generate([StepRequest(Prefix(QUESTIONS[0]))], GREEDY).steps[0][0]
    cases = [[Prefix(QUESTIONS[0]), Prefix(QUESTIONS[1])], [Prefix(QUESTIONS[0])], [Prefix(QUESTIONS[0], (step1,))]]
    for prefixes in cases:
        reqs = [StepRequest(p) for p in prefixes]
        eager.clear_prefix_cache()
        want = eager.generate(reqs, GREEDY)
        padded.clear_prefix_cache()
        if prefixes[0].steps:  # the question cached: the row forwards step 1's tokens alone
            padded.runner.prefill(padded.prefix_ids(Prefix(QUESTIONS[0])), EngineStats())
        calls = step.chunk_calls
        got = padded.generate(reqs, GREEDY)
        assert step.chunk_calls == calls + 1  # every case joins its rows in one chunk
        for p, (w,), (g,) in zip(prefixes, want.steps, got.steps):
            _same_greedy(eager.model, eager, p, g, w)
    assert len(step1.token_ids) > 8  # more than the decode step takes one token at a time
    widths = {w for kv in padded.kv_pool.free for w in kv.chunks}
    assert widths and widths <= set(decode_step.CHUNK_WIDTHS)
    prompts = [fast.prefix_ids(p) for p in (Prefix(QUESTIONS[0]), Prefix(QUESTIONS[1]), Prefix(QUESTIONS[0], (step1,)))]
    results = []
    for batch in (FastDecodeBatch(padded.runner, padded.text, GREEDY, pool=padded.kv_pool,
                                  decode_step=padded.decode_step),
                  DecodeBatch(eager.runner, eager.text, GREEDY)):
        batch.runner.clear()
        done = dict(batch.add([RowSpec(0, prompts[0], GREEDY.max_step_tokens)]))
        for _ in range(3):
            done.update(batch.step())
        done.update(batch.add([RowSpec(1, prompts[1], GREEDY.max_step_tokens),
                               RowSpec(2, prompts[2], GREEDY.max_step_tokens)]))
        done.update(batch.run())
        results.append(done)
    got, want = results
    for k, p in enumerate(prompts):
        assert_same_greedy(eager.model, p, got[k].token_ids, want[k].token_ids, at_least=4)


@pytest.mark.slow
def test_nested_prefixes_in_one_padded_chunk_write_the_eager_steps(engines):
    """With chunks bucketed (CUDA), a Lookahead batch's nested rows take the longest row's tail after the cached
    base in one chunk of the longest's slot alone that keeps every row's logits; the other rows copy its columns.
    Called again (the question cached), the chunk starts after it. The same steps as the eager path, and each token
    encoded once."""
    eager, fast = engines
    padded = _padded(fast)
    chunk, seen = padded.decode_step.chunk, []

    def checked(kv, width):  # the forwarded slots' queries must see a column: one that sees none gives NaN on CUDA
        col = int(kv.cache.layers[0].cumulative_length)
        seen.append((kv.slots, kv.keeps, int((kv.mask[:, col:col + width].sum(1) == 0).sum())))
        return chunk(kv, width)

    padded.decode_step.chunk = checked
    prefixes, reqs, want, step1 = _nested_batch(eager)
    padded.clear_prefix_cache()
    first = padded.generate(reqs, GREEDY)
    assert seen == [(1, 4, 0)]  # one slot forwarded, a kept logits row for each of the buffer's 4 slots
    assert padded.decode_step.chunk_calls == 1  # the longest row's chunk, all of it uncached
    longest = len(padded.prefix_ids(prefixes[-1]))
    assert first.stats.prefill_tokens == longest  # each token encoded once, in the longest row's chunk
    assert first.stats.forward_passes == first.stats.iterations  # the chunk, then one per decode step
    padded.generate([StepRequest(prefixes[0])], GREEDY)  # caches the question's prompt
    with torch.inference_mode():  # what the pooled buffers hold from the first call must not be read again
        for kv in padded.kv_pool.free:
            for layer in kv.layers:
                layer.keys.normal_()
                layer.values.normal_()
    again = padded.generate(reqs, GREEDY)
    assert padded.decode_step.chunk_calls == 2  # (the question's own call: one token after a kept row's, by a step)
    assert seen == [(1, 4, 0)] * 2  # one slot again, after the cached question
    assert again.stats.prefill_tokens == longest - len(padded.prefix_ids(prefixes[0])) + 1
    assert again.stats.forward_passes == again.stats.iterations
    for got in (first, again):
        for p, (w,), (g,) in zip(prefixes, want.steps, got.steps):
            _same_greedy(eager.model, eager, p, g, w)
            if g.token_ids == w.token_ids:
                assert g.logprob == pytest.approx(w.logprob, abs=1e-3)
    # rows that are not nested, on the same pooled buffer and chunk width: each keeps its own slot's logits again,
    # every slot forwarded
    others = [Prefix(QUESTIONS[1]), Prefix(QUESTIONS[0], (step1,)), Prefix(QUESTIONS[1], (step1,))]
    created = padded.kv_pool.created
    padded.clear_prefix_cache()
    eager.clear_prefix_cache()
    got = padded.generate([StepRequest(p) for p in others], GREEDY)
    assert padded.decode_step.chunk_calls == 3 and seen[-1] == (4, 4, 0)
    want = eager.generate([StepRequest(p) for p in others], GREEDY)
    assert padded.kv_pool.created == created  # the same buffer
    (kv,) = [kv for kv in padded.kv_pool.free if kv.slots == 4]
    assert set(kv.chunks) and set(kv.chunks) <= set(kv.first_slot().chunks)  # a width on every slot, and on the first
    for p, (w,), (g,) in zip(others, want.steps, got.steps):
        _same_greedy(eager.model, eager, p, g, w)


@pytest.mark.slow
def test_batches_reuse_pooled_buffers_without_seeing_old_contents(engines):
    """Each generate call borrows the engine's static buffers (on CUDA their captured decode step replays in later
    batches): a batch on a buffer that another batch filled writes exactly what a fresh engine writes, and
    allocates nothing."""
    eager, fast = engines
    fresh = HFStepEngine("offline:smollm2-135m-instruct", model=fast.model, tokenizer=fast.tokenizer, decode="fast")
    fast.generate([StepRequest(Prefix(QUESTIONS[0]), 2)], GREEDY)  # fills a two-slot buffer
    before = fast.kv_pool.created
    reqs = [StepRequest(Prefix(QUESTIONS[1])), StepRequest(Prefix(QUESTIONS[1], ("Let me think.",)))]
    fast.clear_prefix_cache()  # both encode the prompts the same way: only the buffers differ
    got, want = fast.generate(reqs, GREEDY).steps, fresh.generate(reqs, GREEDY).steps
    assert fast.kv_pool.created == before and fresh.kv_pool.created == 1
    assert [s.token_ids for (s,) in got] == [s.token_ids for (s,) in want]
    assert [s.logprob for (s,) in got] == pytest.approx([s.logprob for (s,) in want], abs=1e-4)


def test_kv_pool_hands_out_empty_buffers_of_the_asked_shape_and_keeps_few(engines):
    model = engines[1].model
    pool = static_kv.StaticKVPool(model, pad_id=7, keep=2)
    a, b, c = pool.take(1, 256), pool.take(2, 256), pool.take(1, 512)
    b.mask[:, :5] = 1
    b.ids.fill_(3)
    b.set_column(5)
    for kv in (a, b, c):
        pool.give(kv)
    assert pool.free == [b, c]  # the least recently returned went
    again = pool.take(2, 256)
    assert again is b and pool.created == 3
    assert not again.mask.any() and again.col == 0 and bool((again.ids == 7).all())
    assert int(again.layers[0].cumulative_length) == 0
    assert pool.take(1, 256) is not a and pool.created == 4
    small = static_kv.StaticKVPool(model, pad_id=7, keep_bytes=a.nbytes + 1)  # room for one such buffer
    small.give(a)
    small.give(c)  # twice a's size: over the byte bound alone, it goes too
    small.give(b)
    assert small.free == [] and b.nbytes > a.nbytes
    small.give(a)
    assert small.free == [a]


def test_copy_to_a_used_larger_buffer_keeps_the_kept_columns_and_nothing_else(engines):
    """Growing a batch's slots or columns moves it to a pooled buffer that may hold another batch's K/V."""
    model = engines[1].model
    pool = static_kv.StaticKVPool(model, pad_id=7)
    old, new = pool.take(2, 256), pool.take(4, 512)
    gen = torch.Generator().manual_seed(0)
    for kv in (old, new):
        for layer in kv.layers:
            layer.keys.copy_(torch.randn(layer.keys.shape, generator=gen))
            layer.values.copy_(torch.randn(layer.values.shape, generator=gen))
    new.mask.fill_(1)  # a previous batch's mask, until the copy
    old.mask[0, :3] = 1
    old.mask[1, 2] = 1
    old.ids[:, 0] = torch.tensor([11, 12])
    old.pos[:, 0] = torch.tensor([3, 4])
    old.set_column(3)
    old.copy_to(new, torch.tensor([0, 2]))
    assert new.col == 2 and int(new.layers[0].cumulative_length) == 2
    assert new.mask[:2, :2].tolist() == [[1, 1], [0, 1]] and not new.mask[2:].any() and not new.mask[:, 2:].any()
    assert new.ids[:2, 0].tolist() == [11, 12] and new.pos[:2, 0].tolist() == [3, 4]
    assert new.ids[2:, 0].tolist() == [7, 7]  # the new slots are free: pad tokens
    for lo, ln in zip(old.layers, new.layers):
        assert torch.equal(ln.keys[:2, :, :2], lo.keys[:, :, [0, 2]])
        assert torch.equal(ln.values[:2, :, :2], lo.values[:, :, [0, 2]])


@pytest.mark.slow
def test_a_stream_that_empties_gives_its_buffer_back_once_and_decodes_again(engines):
    eager, fast = engines
    prefixes = [Prefix(QUESTIONS[1]), Prefix(QUESTIONS[0])]
    want = [s[0] for s in eager.generate([StepRequest(p) for p in prefixes], GREEDY).steps]
    stream = fast.open_stream(GREEDY)
    got = dict(stream.add([(0, StepRequest(prefixes[0]))]))
    first = stream.batch.kv
    while len(stream):
        got.update(stream.step())
    assert stream.batch.kv is None and sum(kv is first for kv in fast.kv_pool.free) == 1
    got.update(stream.add([(1, StepRequest(prefixes[1]))]))
    assert stream.batch.kv not in fast.kv_pool.free
    while len(stream):
        got.update(stream.step())
    assert sum(kv is first for kv in fast.kv_pool.free) == 1
    for i, p in enumerate(prefixes):
        _same_greedy(eager.model, eager, p, got[i], want[i])


@pytest.mark.slow
def test_a_continuing_row_starts_in_one_forward(engines):
    """A row whose prefix the prefix cache mostly holds (a step continuing the last one) is not prefilled first: its
    join forward encodes the uncached tokens, so the call runs one forward per iteration (a GPU pays an eager
    forward as much as tens of captured steps), and writes the eager path's step."""
    eager, fast = engines
    fast.clear_prefix_cache()
    step1 = fast.generate([StepRequest(Prefix(QUESTIONS[0]))], GREEDY).steps[0][0]
    prefix = Prefix(QUESTIONS[0], (step1,))
    got = fast.generate([StepRequest(prefix)], GREEDY)
    assert got.stats.reused_prefix_tokens > 0
    assert got.stats.forward_passes == got.stats.iterations
    eager.clear_prefix_cache()
    _same_greedy(eager.model, eager, prefix, got.steps[0][0], eager.generate([StepRequest(prefix)], GREEDY).steps[0][0])


@pytest.mark.slow
def test_a_step_after_scored_drafts_starts_without_an_eager_forward(engines, monkeypatch):
    """SemanticSpec's target writes the step after its accepted drafts right after scoring them as one chain: the
    chain's cache holds that prompt (as far as the prompt's tokens are the scored texts' tokens), so the fast path's
    join replays the decode step for its last token instead of an eager forward of the drafts (a GPU pays an eager
    forward as much as tens of captured steps)."""
    eager, fast = engines
    drafts = ["12 * 4 = 48 muffins.\n\n", "48 - 30 = 18.\n\n", "So the answer is 18.\n\n"]
    after = Prefix(QUESTIONS[0], tuple(drafts[:2]))
    fast.clear_prefix_cache()
    fast.score_chain(Prefix(QUESTIONS[0]), drafts, hidden=False)
    eager_forwards = []
    real = fast.runner.forward
    monkeypatch.setattr(fast.runner, "forward", lambda stats, **kw: eager_forwards.append(1) or real(stats, **kw))
    got = fast.generate([StepRequest(after)], GREEDY)
    assert eager_forwards == [] and got.stats.prefill_tokens == 1
    eager.clear_prefix_cache()
    _same_greedy(eager.model, eager, after, got.steps[0][0], eager.generate([StepRequest(after)], GREEDY).steps[0][0])


@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 3])
def test_rows_joined_by_decode_steps_write_the_eager_steps(engines, rows):
    """join_steps: rows starting a batch with a few uncached tokens each are fed one token per decode step (on a GPU
    replays of the captured step instead of an eager forward); each row (their last prompt tokens differ) writes the
    eager path's step for its own prompt."""
    eager, fast = engines
    ids = fast.prefix_ids(Prefix(QUESTIONS[1]))
    prompts = [ids] + [ids[:-1] + [t] for t in (ids[-2], ids[-3])][:rows - 1]
    fast.clear_prefix_cache()
    fast.runner.prefill(ids[:-5], EngineStats())
    specs = [RowSpec(k, p, GREEDY.max_step_tokens) for k, p in enumerate(prompts)]
    batch = FastDecodeBatch(fast.runner, fast.text, GREEDY, pool=fast.kv_pool, decode_step=fast.decode_step,
                            join_steps=8)
    got = dict(batch.add(specs))
    got.update(batch.run())
    assert batch.stats.forward_passes == batch.stats.iterations + 4  # five tokens in five steps, not in a prefill
    assert batch.stats.reused_prefix_tokens == rows * (len(ids) - 5)
    eager.clear_prefix_cache()
    reference = DecodeBatch(eager.runner, eager.text, GREEDY)
    want = dict(reference.add(specs))
    want.update(reference.run())
    for k, p in enumerate(prompts):
        assert_same_greedy(eager.model, p, got[k].token_ids, want[k].token_ids, at_least=4)
        if got[k].token_ids == want[k].token_ids:
            assert got[k].logprob == pytest.approx(want[k].logprob, abs=1e-3)
    if rows > 1:
        assert len({tuple(got[k].token_ids) for k in range(rows)}) > 1  # the rows' prompts matter


def test_decode_step_modes(engines):
    model = engines[1].model  # on the CPU
    assert decode_step.DecodeStep(model, "auto").mode == "none"
    with pytest.raises(ValueError, match="CUDA"):
        decode_step.DecodeStep(model, "cuda_graph")
    with pytest.raises(ValueError, match="one of"):
        decode_step.DecodeStep(model, "graphs")


def test_captures_take_turns_across_threads(monkeypatch):
    """torch.cuda.graph() syncs the device before it captures, which fails while another thread captures (two of
    three engine threads' captures failed so on an H100): `capture_graph` lets one capture run at a time. The CUDA
    calls are doubles that record how many captures are open at once (the real ones: check_decode_graph.py)."""
    import threading

    inside, release, lock = threading.Event(), threading.Event(), threading.Lock()
    opened, most = [0], [0]

    class FakeCapture:  # stands for torch.cuda.graph(...)
        def __init__(self, graph, pool=None, stream=None, capture_error_mode="global"):
            assert capture_error_mode == "thread_local"  # the other threads go on decoding meanwhile

        def __enter__(self):
            with lock:
                opened[0] += 1
                most[0] = max(most[0], opened[0])
            inside.set()
            release.wait(120)  # set by the test (finally): no wall-clock race on a loaded machine

        def __exit__(self, *exc):
            with lock:
                opened[0] -= 1

    asked = threading.Semaphore(0)

    class SeenLock:  # the capture lock, which also says when a thread has come to it
        def __init__(self, real):
            self.real = real

        def __enter__(self):
            asked.release()
            return self.real.__enter__()

        def __exit__(self, *exc):
            return self.real.__exit__(*exc)

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", FakeCapture)
    monkeypatch.setattr(decode_step, "_CAPTURE_LOCK", SeenLock(decode_step._CAPTURE_LOCK))
    outs = []
    threads = [threading.Thread(target=lambda i=i: outs.append(decode_step.capture_graph(lambda: i, None)[1]))
               for i in range(2)]
    threads[0].start()
    try:
        assert inside.wait(60) and asked.acquire(timeout=60)
        inside.clear()
        threads[1].start()
        assert asked.acquire(timeout=60)  # the second thread has come to the lock ...
        assert not inside.wait(0.3) and most[0] == 1  # ... and waits there while the first captures
    finally:
        release.set()
    for t in threads:
        t.join(60)
    assert sorted(outs) == [0, 1] and most[0] == 1 and opened[0] == 0


def _filled_kv(model, slots: int, columns: int, n: int, seed: int) -> static_kv.StaticKV:
    """A StaticKV whose first n columns hold random K/V (seen by every slot), about to write column n."""
    gen = torch.Generator().manual_seed(seed)
    kv = static_kv.StaticKV(model, slots, columns, "cpu", torch.float32)
    for layer in kv.layers:
        layer.keys.copy_(torch.randn(layer.keys.shape, generator=gen))
        layer.values.copy_(torch.randn(layer.values.shape, generator=gen))
    kv.mask[:, :n + 1] = 1
    kv.ids.copy_(torch.randint(0, model.config.vocab_size, (slots, 1), generator=gen))
    kv.pos.fill_(n)
    kv.set_column(n)
    return kv


@pytest.mark.slow
def test_compiled_decode_step_equals_the_eager_step_and_compiles_twice_for_every_buffer(one_thread):
    """decode_graph="compile": inductor's kernels on symbolic buffer sizes. Its step equals the eager step on the
    same buffers (logits and the K/V it writes) for buffers of other slot and column counts, and all of them
    cost two compilations (one slot, several), not one per buffer; an engine decoding with it writes the eager
    fast path's greedy steps."""
    from torch._dynamo.utils import counters

    eager = HFStepEngine("random:llama-tiny", device="cpu", decode="fast", decode_graph="none")
    compiled = HFStepEngine("random:llama-tiny", model=eager.model, tokenizer=eager.tokenizer, decode="fast",
                            decode_graph="compile")
    step, model = compiled.decode_step, eager.model
    assert step.mode == "compile" and not step.graphed  # no capture on the CPU
    before = counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        for i, (slots, columns, n) in enumerate([(1, 256, 5), (1, 512, 300), (2, 256, 9), (4, 768, 40), (8, 256, 3)]):
            got_kv, want_kv = _filled_kv(model, slots, columns, n, i), _filled_kv(model, slots, columns, n, i)
            got, want = step(got_kv), decode_step.DecodeStep(model, "none")(want_kv)
            assert got.shape == want.shape == (slots, model.config.vocab_size)
            assert torch.allclose(got, want, atol=1e-4), (slots, columns, (got - want).abs().max())
            for g, w in zip(got_kv.layers, want_kv.layers):  # the new token's K/V, written at column n
                assert torch.allclose(g.keys[:, :, n], w.keys[:, :, n], atol=1e-5)
                assert torch.allclose(g.values[:, :, n], w.values[:, :, n], atol=1e-5)
    assert step.failed is None
    assert 1 <= counters["stats"]["unique_graphs"] - before <= 2
    params = SamplingParams(temperature=0.0, max_step_tokens=12)
    prefixes = [Prefix(QUESTIONS[0]), Prefix(QUESTIONS[0], ("First.",)), Prefix(QUESTIONS[1])]
    want = eager.generate([StepRequest(p) for p in prefixes], params).steps
    got = compiled.generate([StepRequest(p) for p in prefixes], params).steps
    assert step.failed is None
    for p, (w,), (g,) in zip(prefixes, want, got):
        n = assert_same_greedy(model, eager.prefix_ids(p), g.token_ids, w.token_ids)
        if n == w.num_tokens:
            assert g.logprob == pytest.approx(w.logprob, abs=1e-3)


def test_a_compiled_step_that_fails_midway_falls_back_to_the_eager_step_at_the_same_column(engines):
    model = engines[1].model
    step = decode_step.DecodeStep(model, "compile")

    def fails_midway(ids, pos, mask, cache):
        for layer in cache.layers:
            layer.cumulative_length.add_(1)  # some kernels ran before the failure
        raise RuntimeError("out of memory")

    step._forward = fails_midway
    got_kv, want_kv = _filled_kv(model, 2, 256, 7, 0), _filled_kv(model, 2, 256, 7, 0)
    with torch.inference_mode():
        got, want = step(got_kv), decode_step.DecodeStep(model, "none")(want_kv)
    assert step.failed == "RuntimeError: out of memory" and not step.graphed
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(got_kv.layers[0].keys[:, :, 7], want_kv.layers[0].keys[:, :, 7], atol=1e-6)


@pytest.mark.slow
def test_rows_join_and_leave_a_running_fast_stream(engines):
    """Async LR's pattern: rows join while others decode, one is cancelled; columns outgrow the first
    buffer, so the batch compacts / grows its static buffers on the way."""
    eager, fast = engines
    params = SamplingParams(temperature=0.0, max_step_tokens=40)
    prefixes = [Prefix(QUESTIONS[i % 2], ("Let me think.",) * (i // 2)) for i in range(7)]
    want = [s[0] for s in eager.generate([StepRequest(p) for p in prefixes], params).steps]
    stream = fast.open_stream(params)
    done = dict(stream.add([(0, StepRequest(prefixes[0])), (1, StepRequest(prefixes[1]))]))
    stream.add([(99, StepRequest(Prefix(QUESTIONS[1], ("Cancel me.",))))])
    later = {3: 2, 5: 3, 8: 4, 12: 5, 20: 6}
    for it in range(200):
        if it in later:
            i = later[it]
            done.update(stream.add([(i, StepRequest(prefixes[i]))]))
        if it == 4:
            stream.cancel([99])
        done.update(stream.step())
        if len(done) == 7 and not len(stream):
            break
    assert 99 not in done and sorted(done) == list(range(7))
    for i, p in enumerate(prefixes):
        _same_greedy(eager.model, eager, p, done[i], want[i])


@pytest.mark.slow
def test_seeded_fast_sampling_reproduces_and_seeds_matter(engines):
    _, fast = engines
    params = SamplingParams(temperature=0.8, top_p=0.95, max_step_tokens=16, seed=5)
    reqs = [StepRequest(Prefix(QUESTIONS[0]), 4), StepRequest(Prefix(QUESTIONS[1]), 2, seed=9)]
    a, b = fast.generate(reqs, params), fast.generate(reqs, params)
    ids = lambda g: [[s.token_ids for s in row] for row in g.steps]  # noqa: E731
    assert ids(a) == ids(b)
    assert len({tuple(t) for t in ids(a)[0]}) > 1  # the 4 samples of one request differ
    c = fast.generate([StepRequest(Prefix(QUESTIONS[0]), 4, seed=6)], params)
    assert ids(c)[0] != ids(a)[0]


@pytest.mark.slow
def test_fast_first_tokens_follow_the_models_distribution(engines):
    """Chi-square of 200 one-token samples against the eager path's distribution (filtered_probs of the
    prompt's logits)."""
    eager, fast = engines
    prefix = Prefix(QUESTIONS[0])
    ids = eager.prefix_ids(prefix)
    with torch.inference_mode():
        logits = eager.model(torch.tensor([ids])).logits[0, -1].float()
    # top-p half-way between the mass of the top 5 and the top 6 tokens: a nucleus of 6 with a margin that
    # rounding cannot cross
    cum = torch.softmax(logits, -1).sort(descending=True).values.cumsum(0)
    top_p = float(cum[4] + cum[5]) / 2
    params = SamplingParams(temperature=1.0, top_p=top_p, max_step_tokens=1, seed=123)
    steps = fast.generate([StepRequest(prefix, 200)], params).steps[0]
    probs = filtered_probs(logits, 1.0, top_p)
    support = probs.nonzero().squeeze(1).tolist()
    assert len(support) == 6
    counts = [sum(1 for s in steps if s.token_ids[0] == t) for t in support]
    assert sum(counts) == 200  # nothing drawn outside the nucleus
    assert chi_square_p(counts, [float(probs[t]) for t in support]) > 1e-3
    assert math.isfinite(steps[0].logprob)


# ----------------------------------------------------------------------------- token speculation on the fast path
def _spec_view(engines, method):
    eager, fast = engines
    cfg = TokenSpecConfig(method, num_tokens=4, ngram_size=3, lookahead=LookaheadConfig(window=4, ngram=3))
    return fast.with_token_spec(cfg, assistant=eager if method == "assistant" else None)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "assistant", "lookahead"])
def test_token_speculation_on_the_fast_path_writes_the_eager_greedy_steps(engines, method, monkeypatch):
    """Chains (prompt lookup; SmolLM2 as its own assistant, so its proposals are right but at near-ties) and
    Lookahead Decoding's tries with their window, verified inside the static buffers: nested-prefix rows, then a
    stream that rows join and leave. The buffers start small, so they are compacted or grown while rejected
    proposals' columns are holes."""
    compacted = small_static_buffers(monkeypatch, 32)
    eager, _ = engines
    view = _spec_view(engines, method)
    prefixes = [Prefix(QUESTIONS[0]), Prefix(QUESTIONS[0], ("First, 12 times 4 is 48 muffins.",)), Prefix(QUESTIONS[1])]
    want = [s[0] for s in eager.generate([StepRequest(p) for p in prefixes], GREEDY).steps]
    got = view.generate([StepRequest(p) for p in prefixes], GREEDY)
    for p, (g,), w in zip(prefixes, got.steps, want):
        _same_greedy(eager.model, eager, p, g, w)
    assert got.stats.spec_accepted > 0 and got.stats.generated_tokens == sum(s.num_tokens for (s,) in got.steps)
    if method == "assistant":  # its own greedy tokens, computed on another path: wrong only at a near-tie
        assert 2 * got.stats.spec_accepted >= got.stats.spec_proposed
    stream = view.open_stream(GREEDY)
    done = dict(stream.add([(0, StepRequest(prefixes[0]))]))
    done.update(stream.step())
    done.update(stream.add([(1, StepRequest(prefixes[1])), (9, StepRequest(Prefix(QUESTIONS[1], ("Cancel.",))))]))
    done.update(stream.step())
    stream.cancel([9])
    done.update(stream.add([(2, StepRequest(prefixes[2]))]))
    while len(stream):
        done.update(stream.step())
    assert sorted(done) == [0, 1, 2]
    for i, p in enumerate(prefixes):
        _same_greedy(eager.model, eager, p, done[i], want[i])
    assert stream.take_stats().spec_accepted > 0
    assert any(compacted)  # the columns were reallocated while rows speculated


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "lookahead"])
def test_sampled_speculation_on_the_fast_path_reproduces_and_scores_its_tokens(engines, method):
    """Seeded speculative sampling reproduces; every step's log-probability is its tokens' under the model's own
    distribution (a verified path read from the wrong slot or logits row would not be). The first request's rows
    stop early, so the others no longer sit in the slots numbered like their place among the running rows.
    Lookahead rows whose pool is still empty feed only their window (a side branch) and draw on the device."""
    eager, _ = engines
    view = _spec_view(engines, method)
    params = SamplingParams(temperature=0.7, top_p=0.95, max_step_tokens=24, seed=11)
    reqs = [StepRequest(Prefix(QUESTIONS[0]), 3, None, 3), StepRequest(Prefix(QUESTIONS[1]), 2, seed=4)]
    a, b = view.generate(reqs, params), view.generate(reqs, params)
    ids = lambda g: [[s.token_ids for s in row] for row in g.steps]  # noqa: E731
    assert ids(a) == ids(b) and (a.stats.spec_accepted > 0 or method == "lookahead")
    for req, row in zip(reqs, a.steps):
        prompt = eager.prefix_ids(req.prefix)
        for step in row:
            seq = prompt + list(step.token_ids)
            with torch.inference_mode():
                lsm = torch.log_softmax(eager.model(torch.tensor([seq])).logits[0].float(), -1)
            want = sum(float(lsm[len(prompt) - 1 + j, t]) for j, t in enumerate(step.token_ids))
            assert step.logprob == pytest.approx(want, abs=1e-3)


class _ProposesForOnePrompt(StatelessProposer):
    """A test double: rows of one prompt propose their last token k times; the other rows never propose."""

    def __init__(self, prompt):
        self.prompt = tuple(prompt)

    def propose(self, context, k, stats=None):
        return DraftTree.chain([context[-1]] * k) if tuple(context[:len(self.prompt)]) == self.prompt else DraftTree()


@pytest.mark.slow
def test_a_row_without_proposals_draws_on_the_device_whatever_the_others_propose(engines, monkeypatch):
    """Every token of a row that never proposes is one device draw with its own key and its next draw number,
    in iterations that verify another row's proposal as in plain ones, so its draws never depend on the others."""
    _, fast = engines
    ids = [fast.prefix_ids(Prefix(q)) for q in QUESTIONS]
    calls = []

    def spy(logits, temperature, top_p, keys, counters):
        calls.append(list(zip(keys.tolist(), counters.tolist())))
        return sample_tokens(logits, temperature, top_p, keys, counters)

    monkeypatch.setattr(static_kv, "sample_tokens", spy)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_step_tokens=16, delimiter="\n\n\n\n")
    batch = FastDecodeBatch(fast.runner, fast.text, params, proposer=_ProposesForOnePrompt(ids[0]), spec_tokens=3)
    out = dict(batch.add([RowSpec("a", ids[0], 16, seed=1), RowSpec("b", ids[1], 16, seed=2)]))
    out.update(batch.run())
    assert batch.stats.spec_rounds > 0
    assert [c for call in calls for key, c in call if key == seed_key(2)] == list(range(out["b"].num_tokens))


def test_models_capture_joins_reaches_the_decode_step(monkeypatch, one_thread):
    """models.capture_joins=false keeps the joins' forwards eager where the decode step is captured (CUDA); true
    leaves it to the decode step (bucketed and captured where it captures: not on the CPU)."""
    from specprobe.infer.config import ModelsConfig
    from specprobe.infer.engines import build_engine_pair, hf

    seen = []

    class Recording(decode_step.DecodeStep):
        def __init__(self, model, mode="auto", bucket_chunks=None):
            seen.append(bucket_chunks)
            super().__init__(model, mode, bucket_chunks)

    monkeypatch.setattr(hf, "DecodeStep", Recording)
    for joins in (False, True):
        target, draft = build_engine_pair(ModelsConfig(device="cpu", decode="fast", target="random:llama-tiny",
                                                       draft="random:llama-tiny", capture_joins=joins))
        assert not target.decode_step.bucket_chunks  # the CPU captures nothing: exact-width eager joins
    assert seen == [False, False, None, None]  # the target and the draft (on the same weights), per setting


def test_a_finished_rows_slot_stays_inside_a_learned_position_table(one_thread):
    """Every fast decode step advances every slot's position; a row that finishes near the end of a GPT-2-style
    learned position table must not carry its slot past it while another row decodes on (it raised IndexError)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from specprobe.infer.models import load_tokenizer

    tok = load_tokenizer("random:llama-tiny")
    torch.manual_seed(0)
    table = 96
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=table, vocab_size=len(tok),
                                       bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)).eval()
    prefixes = [Prefix("word " * 30), Prefix("Hi")]
    steps = {}
    for decode in ("eager", "fast"):
        engine = HFStepEngine("random:llama-tiny", model=model, tokenizer=tok, device="cpu", decode=decode,
                              stop_at_eos=False)
        prompts = [engine.prefix_ids(p) for p in prefixes]
        caps = [table - len(prompts[0]) - 1, table - len(prompts[1]) - 2]  # the first ends at the table's end
        assert caps[1] > caps[0] + 8  # the second decodes on well after it
        out = engine.generate([StepRequest(p, 1, i, c) for i, (p, c) in enumerate(zip(prefixes, caps))],
                              SamplingParams(temperature=0.0, max_step_tokens=table)).steps
        steps[decode] = [row[0] for row in out]
    for prompt, eager, fast in zip(prompts, steps["eager"], steps["fast"]):
        n = assert_same_greedy(model, prompt, fast.token_ids, eager.token_ids, at_least=4)
        if n == eager.num_tokens:  # no near-tie: where the row stopped is the same too
            assert fast.stop_reason == eager.stop_reason


def test_a_stream_that_never_empties_keeps_its_free_slots_inside_the_position_table(one_thread):
    """In a stream whose rows come and go (async LR's target stream), a padding slot no row uses advances with
    every step for the stream's whole life: its position is held inside a learned table (it raised IndexError
    after a table's worth of steps)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from specprobe.infer.models import load_tokenizer

    tok = load_tokenizer("random:llama-tiny")
    torch.manual_seed(0)
    table = 64
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=table, vocab_size=len(tok),
                                       bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)).eval()
    engine = HFStepEngine("random:llama-tiny", model=model, tokenizer=tok, device="cpu", decode="fast",
                          stop_at_eos=False)
    # a delimiter a random model does not write: every row runs to its cap, on any CPU's rounding
    stream = engine.open_stream(SamplingParams(temperature=0.0, max_step_tokens=table, delimiter="\n\n\n\n"))
    live, finished, added = set(), [], 0
    for _ in range(4 * table):  # three rows at a time (four slots: one never used), each 12 tokens
        if len(live) < 3:
            out = stream.add([(added, StepRequest(Prefix("Hi" + " x" * (added % 3)), 1, added, 12))])
            live.add(added)
            added += 1
        else:
            out = []
        for key, step in out + stream.step():
            live.discard(key)
            finished.append(step)
    assert len(finished) > 40 and all(s.num_tokens == 12 for s in finished)
