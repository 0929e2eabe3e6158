"""SequenceKV, the KV cache of the one-sequence tree-attention decoders (SEED, LookaheadDecoder): the mask layout on
tiny shapes, and on a tiny random Llama in float32 that a block forward with tree attention computes what
plain forwards of each path compute, across blocks, dropped blocks, grown buffers and reused prefixes."""
from __future__ import annotations

import pytest
import torch

from specprobe.infer.engines.sequence_kv import SequenceKV, forward_layout
from specprobe.infer.engines.token_spec import DraftTree


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


def test_forward_layout_fresh_tokens_then_a_block():
    # 3 committed, 2 fresh (causal), a block of 2 whose second token sees the first
    lay = forward_layout(3, 2, 0, torch.tensor([[True, False], [True, True]]))
    assert lay.shape == (4, 7)
    assert lay[0].tolist() == [True] * 4 + [False] * 3 and lay[1].tolist() == [True] * 5 + [False] * 2
    assert lay[2].tolist() == [True] * 6 + [False] and lay[3].tolist() == [True] * 7


def test_forward_layout_block_after_speculative_columns_and_its_checks():
    # no fresh token; 2 speculative columns cached; a block of 1 that sees the second of them only
    lay = forward_layout(3, 0, 2, torch.tensor([[False, True, True]]))
    assert lay.tolist() == [[True, True, True, False, True, True]]
    with pytest.raises(ValueError, match="allowed of shape"):
        forward_layout(3, 0, 2, torch.ones(1, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="drop_speculative"):
        forward_layout(3, 1, 2, torch.ones(1, 3, dtype=torch.bool))


def _tiny_llama(vocab: int = 40, seed: int = 0, positions: int = 128):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions)
    return LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def _plain_last(model, ids) -> torch.Tensor:
    return model(torch.tensor([list(ids)])).logits[0, -1].float()


@torch.no_grad()
def test_tree_blocks_compute_what_plain_forwards_of_each_path_compute():
    model = _tiny_llama()
    kv = SequenceKV(model)
    ids = [3, 9, 4, 1, 7]
    tree = DraftTree.trie([[5, 6], [5, 8], [2]])  # nodes: 5, 6 (after 5), 8 (after 5), 2
    paths = {0: [5], 1: [5, 6], 2: [5, 8], 3: [2]}
    cur, block = kv.forward(ids, tree.tokens, tree.ancestry(), [len(ids) - 1 + d for d in tree.depths()])
    assert torch.allclose(cur, _plain_last(model, ids), atol=1e-4)
    for node, path in paths.items():
        assert torch.allclose(block[node], _plain_last(model, ids + path), atol=1e-4), node
    assert (kv.committed, kv.speculative) == (5, 4)
    # a second block after the first (SEED's next draft level): node 1's child sees the path 5, 6 only
    seen = torch.tensor([[True, True, False, False, True]])
    _, deeper = kv.forward(ids, [11], seen, [len(ids) + 2])
    assert torch.allclose(deeper[0], _plain_last(model, ids + [5, 6, 11]), atol=1e-4)
    with pytest.raises(ValueError, match="drop_speculative"):  # new committed tokens need the block gone
        kv.forward(ids + [5], [], None, [])
    kv.drop_speculative()
    assert (kv.committed, kv.speculative) == (5, 0)
    cur, _ = kv.forward(ids + [5, 6])  # accepted tokens are fed again as committed tokens
    assert torch.allclose(cur, _plain_last(model, ids + [5, 6]), atol=1e-4)


@torch.no_grad()
def test_start_reuses_the_shared_prefix_and_refuses_a_foreign_sequence():
    model = _tiny_llama()
    kv = SequenceKV(model)
    kv.forward([3, 9, 4, 1, 7])
    kv.start([3, 9, 4, 8, 8, 2])  # shares 3 tokens: they stay cached, the rest is fed
    assert kv.committed == 3
    cur, _ = kv.forward([3, 9, 4, 8, 8, 2])
    assert torch.allclose(cur, _plain_last(model, [3, 9, 4, 8, 8, 2]), atol=1e-4)
    kv.start([3, 9, 4, 8, 8, 2])  # the same sequence again: one token is left to feed for its logits
    assert kv.committed == 5
    with pytest.raises(ValueError, match="extend the committed tokens"):
        kv.forward([1, 2, 3, 4, 5, 6])
    kv.start([6])
    assert kv.committed == 0


@torch.no_grad()
def test_sequences_of_one_prompt_share_the_engines_prefix_cache():
    """An engine's SequenceKVs start from its prompt-prefix cache: the second sequence of a prompt (SEED's next
    thought) encodes nothing, and both compute what a plain forward computes."""
    from specprobe.infer.engines import HFStepEngine

    engine = HFStepEngine("random:llama-tiny", device="cpu")
    ids = list(range(5, 30))
    first, second = engine.sequence_kv(), engine.sequence_kv()
    first.start(ids)
    second.start(ids)
    assert (first.prefill_passes, first.committed) == (1, len(ids) - 1)
    assert (second.prefill_passes, second.committed) == (0, len(ids) - 1)  # a cache hit
    want = engine.model(torch.tensor([ids])).logits[0, -1].float()
    for kv in (first, second):
        cur, _ = kv.forward(ids)
        assert torch.allclose(cur, want, atol=1e-4)
    first.forward(ids + [7])  # one sequence growing leaves the other and the cached prefix alone
    cur, _ = second.forward(ids + [9])
    assert torch.allclose(cur, engine.model(torch.tensor([ids + [9]])).logits[0, -1].float(), atol=1e-4)
    third = engine.sequence_kv()
    third.start(ids)
    cur, _ = third.forward(ids)
    assert third.prefill_passes == 0 and torch.allclose(cur, want, atol=1e-4)
    other = ids[:3] + [40, 41, 42, 43]  # another prompt with a common head: from the prefix cache, not re-fed
    third.start(other)
    assert (third.prefill_passes, third.committed) == (1, len(other) - 1)
    cur, _ = third.forward(other)
    assert torch.allclose(cur, engine.model(torch.tensor([other])).logits[0, -1].float(), atol=1e-4)


@torch.no_grad()
def test_a_sequence_outgrowing_its_buffers_keeps_its_columns():
    """The one-slot buffers start at one column block; a longer sequence (with a block pending) grows them and
    still computes what plain forwards compute, before and after the growth."""
    model = _tiny_llama(seed=1, positions=1024)
    kv = SequenceKV(model)
    ids = [int(t) for t in torch.randint(0, 40, (250,))]
    cur, _ = kv.forward(ids)
    first = kv._kv.columns
    assert torch.allclose(cur, _plain_last(model, ids), atol=1e-4)
    tree = DraftTree.trie([[5, 6], [2]])
    _, block = kv.forward(ids, tree.tokens, tree.ancestry(), [len(ids) - 1 + d for d in tree.depths()])
    kv.drop_speculative()
    longer = ids + [int(t) for t in torch.randint(0, 40, (20,))]
    cur, block = kv.forward(longer, tree.tokens, tree.ancestry(), [len(longer) - 1 + d for d in tree.depths()])
    assert kv._kv.columns > first  # it grew past the first block
    assert torch.allclose(cur, _plain_last(model, longer), atol=1e-4)
    assert torch.allclose(block[1], _plain_last(model, longer + [5, 6]), atol=1e-4)
    assert torch.allclose(block[2], _plain_last(model, longer + [2]), atol=1e-4)


def test_models_without_plain_full_attention_layers_are_refused_with_the_reason(tmp_path):
    """Tree attention runs on static full-attention buffers: a sliding-window model is refused when its
    SequenceKV is made (not half-way through a decode); the transformers engine refuses it when built (its first
    step failed: it crops, joins and keeps rows' caches); SEED on an engine without tree attention is refused
    before anything runs."""
    import copy
    import dataclasses

    from transformers import MistralConfig, MistralForCausalLM

    from specprobe.infer.engines import HFStepEngine
    from specprobe.infer.engines.seed_decoding import SeedGenerator

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=40, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=128, sliding_window=8)).eval()
    with pytest.raises(NotImplementedError, match="plain full-attention"):
        SequenceKV(model)
    plain = HFStepEngine("random:llama-tiny", device="cpu")
    with pytest.raises(ValueError, match=r"DynamicSlidingWindowLayer caches .* Use models.engine: vllm"):
        HFStepEngine("mistral-windowed", model=model, tokenizer=plain.tokenizer, device="cpu")
    folder = tmp_path / "mistral-config-only"  # by name: refused from its config, before weights or tokenizer load
    model.config.save_pretrained(folder)
    with pytest.raises(ValueError, match=r"mistral-config-only: its attention keeps DynamicSlidingWindowLayer"):
        HFStepEngine(str(folder), device="cpu")
    from specprobe.infer.models import load_model_config

    # a GGUF model (converted whole) or a random: size (the tokenizer's size) is checked once loaded instead
    assert load_model_config("random:llama-tiny") is None and load_model_config("offline:smollm2-135m-instruct") is None
    assert load_model_config(str(folder)).sliding_window == 8
    flat = copy.copy(plain)
    flat.capabilities = dataclasses.replace(plain.capabilities, tree_attention=False)
    assert plain.capabilities.tree_attention
    with pytest.raises(ValueError, match="tree attention"):
        SeedGenerator.from_engines(flat, plain, (2, 1))


@torch.no_grad()
def test_buffers_growing_between_two_forwards_keep_the_first_ones_columns():
    """SEED's drafter feeds the context, then a tree level, with no drop in between: when the level needs more
    columns than the buffers have, the growth keeps every column the first forward wrote."""
    model = _tiny_llama(seed=2, positions=1024)
    kv = SequenceKV(model)
    ids = [int(t) for t in torch.randint(0, 40, (254,))]
    kv.forward(ids)
    tree = DraftTree.trie([[5, 6], [2]])  # 3 nodes: 257 columns, past the first 256
    _, block = kv.forward(ids, tree.tokens, tree.ancestry(), [len(ids) - 1 + d for d in tree.depths()])
    for node, path in {0: [5], 1: [5, 6], 2: [2]}.items():
        assert torch.allclose(block[node], _plain_last(model, ids + path), atol=1e-4), node
