"""SEED: token trees and their verification rule on tiny arrays, the FCFS rounds queue, and
scheduled speculative decoding on tiny random Llamas (greedy exact, sampling lossless), then the
tree-of-thoughts loops on the step engines."""
from __future__ import annotations

import pytest
import torch

from specprobe.infer.decoding.seed import SeedConfig, tot_search
from specprobe.infer.engines.seed_decoding import RoundsQueue, SeedGenerator, tree_shape
from specprobe.infer.engines.sequence_kv import SequenceKV
from specprobe.infer.engines.token_spec import DraftTree, verify_tree


def _tree(k_config, tokens=None, q=None) -> DraftTree:
    parents = tree_shape(k_config)
    return DraftTree(tuple(tokens) if tokens is not None else (0,) * len(parents), parents, q)


def _argmax_rows(argmax: dict[int, int], m: int, vocab: int = 10) -> torch.Tensor:
    """Logits whose argmax after node u (row u + 1; u = -1: the root) is argmax[u]."""
    rows = torch.zeros(m + 1, vocab)
    for u, t in argmax.items():
        rows[u + 1, t] = 1.0
    return rows


def _prob_rows(p: dict[int, torch.Tensor], m: int) -> torch.Tensor:
    """Logits whose softmax after node u is p[u] (temperature 1 gives back p)."""
    return torch.log(torch.stack([p[u] for u in range(-1, m)]))


def _seed(target, draft, k_config, **kw) -> SeedGenerator:
    return SeedGenerator(lambda: SequenceKV(target), lambda: SequenceKV(draft), k_config, **kw)


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


# ----------------------------------------------------------------------------- pure parts
def test_tree_shape_and_tree_attention():
    tree = _tree((2, 2, 1))
    assert tree.parents == (-1, -1, 0, 0, 1, 1, 2, 3, 4, 5) and tree.depths() == [1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    anc = tree.ancestry()
    assert anc[6].nonzero().flatten().tolist() == [0, 2, 6]  # a leaf sees its path only
    assert anc[9].nonzero().flatten().tolist() == [1, 5, 9] and not bool(anc[6, 3])
    assert tree_shape((1, 1, 1)) == (-1, 0, 1) and _tree((1, 1, 1)).is_chain and not tree.is_chain


def test_greedy_tree_verification_follows_the_argmax_path():
    tree = _tree((2, 1), [5, 7, 8, 9])  # nodes 0, 1 after the root; 2 after 0; 3 after 1

    def walk(argmax):
        return verify_tree(tree, _argmax_rows(argmax, 4), 0.0, 1.0, None)

    assert walk({-1: 7, 0: 0, 1: 9, 2: 0, 3: 4}) == ([7, 9, 4], [1, 3, -2])
    assert walk({-1: 7, 0: 0, 1: 2, 2: 0, 3: 4}) == ([7, 2], [1, -2])
    assert walk({-1: 3, 0: 0, 1: 0, 2: 0, 3: 0}) == ([3], [-2])


def test_sampled_tree_verification_is_lossless():
    """Tree (2, 1) drafted from q each trial: the first token is distributed as p at the root and the
    second, given the first, as p after it, although the draft disagrees with the target."""
    q_root = torch.tensor([0.5, 0.3, 0.1, 0.1])
    p_root = torch.tensor([0.1, 0.2, 0.3, 0.4])
    q_after = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.25] * 4, [0.1, 0.1, 0.1, 0.7], [0.4, 0.4, 0.1, 0.1]])
    p_after = torch.tensor([[0.2, 0.2, 0.5, 0.1], [0.6, 0.1, 0.1, 0.2], [0.3, 0.3, 0.2, 0.2], [0.1, 0.1, 0.1, 0.7]])
    gen = torch.Generator().manual_seed(0)
    n = 6000
    first = torch.zeros(4)
    pair = torch.zeros(4, 4)
    from specprobe.infer.engines.token_spec import sample_from

    for _ in range(n):
        c = [sample_from(q_root, gen) for _ in range(2)]
        g = [sample_from(q_after[x], gen) for x in c]
        tokens = c + g
        q = {-1: q_root, 0: q_after[c[0]], 1: q_after[c[1]]}
        p = {-1: p_root, 0: p_after[c[0]], 1: p_after[c[1]], 2: torch.full((4,), 0.25), 3: torch.full((4,), 0.25)}
        out, _ = verify_tree(_tree((2, 1), tokens, q), _prob_rows(p, 4), 1.0, 1.0, gen)
        first[out[0]] += 1
        if len(out) > 1:
            pair[out[0], out[1]] += 1
    assert torch.allclose(first / n, p_root, atol=0.03)
    for x in range(4):
        if pair[x].sum() > 300:  # the second token given the first: p after it
            assert torch.allclose(pair[x] / pair[x].sum(), p_after[x], atol=0.08), x


def test_multi_candidate_rule_and_bonus_token_by_chi_square():
    """Chi-square with the power to see a one-point shift. Two candidates drawn i.i.d. from q, judged in turn
    against the residual max(0, p - q) (q itself is not renormalised): the kept first token follows p. A
    one-token path the target always accepts (q = p) ends with a bonus token drawn from p after the LEAF."""
    from specprobe.infer.engines.token_spec import sample_from

    from _stats import chi_square_p

    q_root = torch.tensor([0.5, 0.3, 0.1, 0.1])
    p_root = torch.tensor([0.1, 0.2, 0.3, 0.4])
    p_after = torch.tensor([[0.2, 0.2, 0.5, 0.1], [0.6, 0.1, 0.1, 0.2], [0.3, 0.3, 0.2, 0.2], [0.1, 0.1, 0.1, 0.7]])
    gen = torch.Generator().manual_seed(1)
    n = 40000
    first = [0] * 4
    for _ in range(n):
        tokens = [sample_from(q_root, gen) for _ in range(2)]
        p = {-1: p_root, 0: p_after[tokens[0]], 1: p_after[tokens[1]]}
        out, _ = verify_tree(_tree((2,), tokens, {-1: q_root}), _prob_rows(p, 2), 1.0, 1.0, gen)
        first[out[0]] += 1
    assert chi_square_p(first, p_root.tolist()) > 1e-3
    # the bonus token: root accepted for sure (q = p there), then drawn from p after the accepted leaf
    bonus = torch.zeros(4, 4)
    for _ in range(12000):
        x = sample_from(p_root, gen)
        out, nodes = verify_tree(_tree((1,), [x], {-1: p_root}), _prob_rows({-1: p_root, 0: p_after[x]}, 1), 1.0,
                                 1.0, gen)
        assert out[0] == x and nodes == [0, -2]
        bonus[x, out[1]] += 1
    for x in range(4):
        assert chi_square_p(bonus[x].long().tolist(), p_after[x].tolist()) > 1e-3, x


def test_rounds_queue_is_fcfs_and_refuses_a_second_proposal_in_flight():
    rq = RoundsQueue()
    assert rq.submit("a", 1) == 0 and rq.submit("b", 2) == 1
    with pytest.raises(RuntimeError, match="while another is waiting"):
        rq.submit("a", 3)
    assert rq.pop()[:2] == (0, "a")
    rq.done("a", 0)
    assert rq.submit("a", 3) == 2
    assert [rq.pop()[1] for _ in range(2)] == ["b", "a"] and rq.pop(timeout=0.01) is None


# ----------------------------------------------------------------------------- tiny models
def _llama(vocab, seed, hidden=32, layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.3)
    return LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def _greedy(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    full = model(torch.tensor([ids])).logits[0, len(prompt) - 1:-1]
    top2 = full.topk(2, -1).values
    return ids[len(prompt):], float((top2[:, 0] - top2[:, 1]).min())


PROMPTS = [[1, 5, 7, 9, 3], [2, 4, 6], [1, 5, 7, 9, 3]]


def _check_schedule(rq: RoundsQueue):
    submits = [t for kind, _, t in rq.log if kind == "submit"]
    verifies = [t for kind, _, t in rq.log if kind == "verify"]
    assert sorted(submits) == sorted(verifies) == list(range(rq.submitted))  # none twice, none dropped
    assert verifies == sorted(verifies)  # first come, first served
    assert rq.verified == rq.submitted and not rq.in_flight and len(rq) == 0


@pytest.mark.slow
@pytest.mark.parametrize("threaded", [False, True])
def test_greedy_seed_writes_the_targets_greedy_tokens_and_schedules_fcfs(threaded):
    target, draft = _llama(48, 0), _llama(48, 1, hidden=16, layers=1)
    refs = [_greedy(target, p, 20) for p in PROMPTS]
    assert min(m for _, m in refs) > 1e-3  # far above float noise between tree and one-token passes
    gen = _seed(target, draft, (2, 2, 1), temperature=0.0, threaded=threaded)
    outs = gen.generate(PROMPTS, [20, 20, 12], [0, 1, 2])
    assert [o[0] for o in outs] == [refs[0][0], refs[1][0], refs[2][0][:12]]
    _check_schedule(gen.queue)
    assert gen.stats.rounds == gen.queue.verified and gen.stats.rounds < 52  # fewer target passes than tokens
    stop = refs[0][0][5]
    outs = _seed(target, draft, (1, 1), threaded=threaded).generate(
        PROMPTS[:1], [20], [0], stop=lambda t: t[-1] == stop)
    assert outs[0][0] == refs[0][0][:refs[0][0].index(stop) + 1]


@pytest.mark.slow
def test_sampled_seed_keeps_the_targets_distribution_per_draft():
    """Two sequences, two tokens each, many seeds: each sequence's tokens follow the target's marginals."""
    vocab = 6
    target, draft = _llama(vocab, 3), _llama(vocab, 4, hidden=16, layers=1)
    prompt = [1, 2, 3]
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt])).logits[0, -1], -1)
        rows = torch.softmax(target(torch.tensor([prompt + [t] for t in range(vocab)])).logits[:, -1], -1)
    p2 = p1 @ rows
    gen = _seed(target, draft, (2, 1), temperature=1.0, draft_temperature=1.0, threaded=False)
    n = 600
    c1, c2 = torch.zeros(vocab), torch.zeros(vocab)
    for s in range(n):
        for out, _ in gen.generate([prompt, prompt], [2, 2], [2 * s, 2 * s + 1]):
            c1[out[0]] += 1
            c2[out[1]] += 1
        _check_schedule(gen.queue)
    assert gen.stats.accepted > 0
    assert torch.allclose(c1 / (2 * n), p1, atol=0.05) and torch.allclose(c2 / (2 * n), p2, atol=0.05)


def test_samples_of_a_prompt_are_seeded_as_every_engine_seeds_them():
    """Sample k of a request seeded s gets base.sample_seed(s, k): with s + k, the second sample of the request
    seeded 1 would be the first of the request seeded 2."""
    from types import SimpleNamespace

    from specprobe.infer.engines import Prefix
    from specprobe.infer.engines.base import sample_seed

    gen = SeedGenerator(lambda: None, lambda: None, (1,), temperature=0.7, draft_temperature=0.7)
    seen = []

    def generate(prompts, caps, seeds, stop=None):
        seen.extend(seeds)
        return [([7], -0.5) for _ in prompts]

    gen.generate = generate
    engine = SimpleNamespace(prefix_ids=lambda pre: [1, 2], info=SimpleNamespace(tokenizer_id="t"),
                             text=SimpleNamespace(finished=lambda tokens, cap, delim: ("x\n\n", "delimiter")))
    steps = gen.generate_steps(engine, [Prefix("a"), Prefix("b")], 2, [4, 4], [1, 2], "\n\n")
    assert seen == [sample_seed(1, 0), sample_seed(1, 1), sample_seed(2, 0), sample_seed(2, 1)]
    assert len(set(seen)) == 4 and [len(s) for s in steps] == [2, 2]


@pytest.mark.slow
def test_threaded_seed_on_engines_writes_the_targets_greedy_steps_and_shares_prompts(one_thread):
    """SEED on two step engines (their locks, their prefix caches), drafting in a thread: every thought is the
    target's greedy step, and the second thought of a prompt starts from the target's prefix cache."""
    from specprobe.infer.engines import HFStepEngine, Prefix, SamplingParams, StepRequest

    from _margins import assert_same_greedy

    target = HFStepEngine("random:llama-20m", device="cpu", stop_at_eos=False)
    draft = HFStepEngine("random:llama-tiny", device="cpu", stop_at_eos=False)
    gen = SeedGenerator.from_engines(target, draft, (2, 1), temperature=0.0, threaded=True)
    prefixes = [Prefix("What is 2 + 3?"), Prefix("Name a prime number.")]
    steps = gen.generate_steps(target, prefixes, 2, [16, 16], [0, 5], "\n\n")
    _check_schedule(gen.queue)
    assert gen.stats.target_forward_passes == gen.stats.rounds + 2  # one prompt prefill per prefix, not per thought
    params = SamplingParams(temperature=0.0, max_step_tokens=16)
    for pre, thoughts in zip(prefixes, steps):
        want = target.generate([StepRequest(pre, 1, 0, 16)], params).steps[0][0]
        for got in thoughts:
            n = assert_same_greedy(target.model, target.prefix_ids(pre), got.token_ids, want.token_ids, at_least=4)
            if n == want.num_tokens:  # no near-tie: the whole step, and so where it stopped, is the same
                assert (got.num_tokens, got.stop_reason) == (want.num_tokens, want.stop_reason)


# ----------------------------------------------------------------------------- tree-of-thoughts loops
@pytest.mark.slow
def test_seed_tot_and_tot_target_on_step_engines(one_thread):
    from specprobe.infer.decoding.common import DecodeOptions
    from specprobe.infer.decoding.specs import BernoulliReward
    from specprobe.infer.engines import HFStepEngine, SamplingParams

    target = HFStepEngine("random:llama-20m", device="cpu", stop_at_eos=False)
    draft = HFStepEngine("random:llama-tiny", device="cpu", stop_at_eos=False)
    opts = DecodeOptions(max_steps=6, max_new_tokens=400, seed=5,
                         target_params=SamplingParams(temperature=0.8, max_step_tokens=4))
    cfg = SeedConfig(thoughts=2, keep=2, depth=3, k_config=(2, 1), threaded=False)
    res = tot_search("What is 2 + 3?", target, draft, BernoulliReward(0.5), opts, cfg, method="seed_tot")
    base = tot_search("What is 2 + 3?", target, draft, BernoulliReward(0.5), opts, cfg, method="tot_target")
    for r in (res, base):
        assert len(r.steps) == 3 and all(s.tokens == 4 for s in r.steps) and r.stats.cycles == 3
        assert [len(c["values"]) for c in r.trace] == [2, 4, 4]  # n thoughts per kept state, b = 2 kept
    assert res.stats.spec_rounds > 0 and res.stats.draft_forward_passes > 0
    with pytest.raises(ValueError, match="sampling draft"):
        tot_search("Q?", target, draft, BernoulliReward(0.5),
                   opts.replace(draft_params=SamplingParams(temperature=0.0, max_step_tokens=4)), cfg)
