"""The transformers step engine on the real offline SmolLM2."""
from collections import OrderedDict

import pytest
import torch

from specprobe.infer.engines import HFStepEngine, Prefix, PromptTooLongError, SamplingParams, StepRequest
from specprobe.infer.engines.base import EngineStats
from specprobe.infer.engines.hf_kv import cache_keyword, output_cache, packing_pays
from specprobe.infer.engines.sequence_kv import SequenceKV
from specprobe.infer.engines.token_spec import draw_tokens
from specprobe.infer.engines.tokens import StepTokenizer, find_step_end

from _margins import assert_same_greedy


def sample(engine, prefixes, n, params):
    return engine.generate([StepRequest(p, n) for p in prefixes], params).steps


def _direct_hidden(engine, prefix, step):
    ids = engine.prefix_ids(prefix) + engine.text.text_ids(step)
    with torch.inference_mode():
        out = engine.model(torch.tensor([ids]), output_hidden_states=True)
    return torch.stack(out.hidden_states, 0)[:, 0].float(), out.logits[0].float(), ids


@pytest.mark.slow
def test_sampled_steps_stop_for_the_reason_they_give(smol_engine, gsm_question):
    prefix = Prefix(gsm_question, ("She makes 12 * 4 = 48 muffins.",))
    params = SamplingParams(seed=3, max_step_tokens=12)  # small cap so some samples hit it
    steps = sample(smol_engine, [prefix, prefix], 6, params)
    assert [len(s) for s in steps] == [6, 6]
    reasons = set()
    for step in steps[0] + steps[1]:
        reasons.add(step.stop_reason)
        assert step.token_ids and step.logprob < 0 and step.tokenizer_id == smol_engine.info.tokenizer_id
        if step.stop_reason == "delimiter":  # the text is the tokens as written, ending in the delimiter
            assert step.text == smol_engine.tokenizer.decode(step.token_ids)
            assert step.text.rstrip(" \n").strip() and step.text.rstrip(" ").endswith("\n\n")
            assert find_step_end(smol_engine.tokenizer.decode(step.token_ids[:-1]), "\n\n") is None
        elif step.stop_reason == "length":
            assert step.num_tokens == 12 and find_step_end(step.text, "\n\n") is None
        else:
            assert step.token_ids[-1] in smol_engine.eos_ids
    assert "length" in reasons  # a 12-token cap truncates some of 12 samples of this prompt


@pytest.mark.slow
def test_sampling_is_reproducible_and_prefix_reuse_changes_nothing(smol_engine, gsm_question):
    prefix = Prefix(gsm_question)
    params = SamplingParams(seed=11, max_step_tokens=16)
    smol_engine.clear_prefix_cache()
    first = smol_engine.generate([StepRequest(prefix, 4)], params)
    again = smol_engine.generate([StepRequest(prefix, 4)], params)  # prefix now served from the KV cache
    assert first.stats.reused_prefix_tokens == 0 and again.stats.reused_prefix_tokens == len(smol_engine.prefix_ids(prefix))
    assert again.stats.prefill_tokens == 0 and first.stats.prefill_tokens > 0
    smol_engine.clear_prefix_cache()
    cold = smol_engine.generate([StepRequest(prefix, 4)], params).steps[0]
    assert [s.token_ids for s in first.steps[0]] == [s.token_ids for s in again.steps[0]] == [s.token_ids for s in cold]
    other = sample(smol_engine, [prefix], 4, SamplingParams(seed=12, max_step_tokens=16))[0]
    assert [s.token_ids for s in other] != [s.token_ids for s in cold]


@pytest.mark.slow
def test_sampled_logprob_is_the_models_log_probability(smol_engine, gsm_question):
    prefix = Prefix(gsm_question)
    step = sample(smol_engine, [prefix], 1, SamplingParams(seed=5, max_step_tokens=10))[0][0]
    ids = smol_engine.prefix_ids(prefix)
    with torch.inference_mode():
        logits = smol_engine.model(torch.tensor([ids + step.token_ids])).logits[0].float()
    lp = torch.log_softmax(logits[len(ids) - 1:-1], -1).gather(-1, torch.tensor(step.token_ids)[:, None]).sum()
    assert step.logprob == pytest.approx(float(lp), abs=1e-3)


@pytest.mark.slow
def test_greedy_step_matches_generate(smol_engine, gsm_question):
    prefix = Prefix(gsm_question)
    step = sample(smol_engine, [prefix], 2, SamplingParams(temperature=0, max_step_tokens=20))[0]
    assert step[0].token_ids == step[1].token_ids  # greedy rows agree
    ids = smol_engine.prefix_ids(prefix)
    out = smol_engine.model.generate(torch.tensor([ids]), max_new_tokens=step[0].num_tokens, do_sample=False)
    assert_same_greedy(smol_engine.model, ids, step[0].token_ids, out[0, len(ids):].tolist())


@pytest.mark.slow
def test_pooled_hidden_states_match_direct_computation(smol_engine, gsm_question):
    prefix = Prefix(gsm_question, ("First, 12 * 4 = 48.",))
    steps = ["Then 48 - 30 = 18.\n\n", "So 18 muffins are left.\n\n", "The answer is 18."]
    scored = smol_engine.score(prefix, steps).steps
    n_layers = smol_engine.info.num_layers
    for step, result in zip(steps, scored):
        assert result.mean_hidden.shape == (n_layers + 1, smol_engine.info.hidden_size) == (31, 576)
        hidden, logits, ids = _direct_hidden(smol_engine, prefix, step)
        n = result.num_tokens
        torch.testing.assert_close(result.mean_hidden, hidden[:, -n:].mean(1), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(result.last_hidden, hidden[:, -1], atol=1e-4, rtol=1e-4)
        lp = torch.log_softmax(logits[-n - 1:-1], -1).gather(-1, torch.tensor(ids[-n:])[:, None]).squeeze(-1)
        torch.testing.assert_close(result.token_logprobs, lp, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_scoring_a_batch_equals_scoring_one_by_one(smol_engine, gsm_question):
    prefix = Prefix(gsm_question)
    steps = ["12 * 4 = 48 muffins.\n\n", "She bakes 48 muffins in total, then sells 30 of them.\n\n", "48\n\n"]
    batch = smol_engine.score(prefix, steps, layers=[0, 15, -1]).steps
    for step, together in zip(steps, batch):
        alone = smol_engine.score(prefix, [step], layers=[0, 15, -1]).steps[0]
        assert together.mean_hidden.shape == (3, 576)
        torch.testing.assert_close(together.mean_hidden, alone.mean_hidden, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(together.token_logprobs, alone.token_logprobs, atol=1e-4, rtol=1e-4)


def test_packing_pays_when_it_attends_no_more_than_padded_rows():
    assert packing_pays(309, [14, 27, 40, 14, 27, 40, 14, 27])  # 203 * 512 <= 8 * 40 * 349: a long prefix, uneven steps
    assert not packing_pays(38, [40] * 16)  # 640 * 678 > 16 * 40 * 78: many equal steps after a short prefix
    assert packing_pays(5, [7])  # one step: the same forward
    assert packing_pays(2000, [10, 40, 25, 5])  # a long prefix: uneven steps pad less than they see of each other
    assert not packing_pays(2000, [40] * 16)  # equal steps never attend less packed (T^2 > R w^2)


@pytest.mark.slow
def test_packed_scoring_equals_padded_rows(smol_engine, gsm_question):
    """score_packed (the steps end to end in one row under a 4-D mask, the prefix's KV read once) gives what
    score_rows (the prefix's cache repeated over right-padded rows) gives, for steps of different lengths, in one
    forward each once the prefix is cached."""
    runner = smol_engine.runner
    ids = smol_engine.prefix_ids(Prefix(gsm_question))
    steps = [smol_engine.text.text_ids(s) for s in ("12 * 4 = 48 muffins.\n\n", "48\n\n",
                                                    "She bakes 48 muffins in total, then sells 30 of them.\n\n")]
    assert len({len(s) for s in steps}) == 3
    runner.prefill(ids, EngineStats())
    packed_stats, rows_stats = EngineStats(), EngineStats()
    packed = runner.score_packed(ids, steps, True, [0, 15, 30], packed_stats)
    rows = runner.score_rows(ids, steps, True, [0, 15, 30], rows_stats)
    assert packed_stats.forward_passes == rows_stats.forward_passes == 1
    assert packed_stats.prefill_tokens == rows_stats.prefill_tokens == sum(map(len, steps))
    for p, r, s in zip(packed, rows, steps):
        assert p.token_ids == r.token_ids == s and p.token_logprobs.shape == (len(s),)
        torch.testing.assert_close(p.token_logprobs, r.token_logprobs, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(p.mean_hidden, r.mean_hidden, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(p.last_hidden, r.last_hidden, atol=1e-4, rtol=1e-4)
    plain = runner.score_packed(ids, steps, False, [], EngineStats())
    assert all(p.mean_hidden is None and p.last_hidden is None for p in plain)
    for p, r in zip(plain, rows):
        torch.testing.assert_close(p.token_logprobs, r.token_logprobs, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_score_chain_conditions_each_step_on_the_ones_before(smol_engine, gsm_question):
    prefix = Prefix(gsm_question)
    steps = ["12 * 4 = 48.\n\n", "48 - 30 = 18.\n\n"]
    chain = smol_engine.score_chain(prefix, steps).steps
    second = smol_engine.score(prefix.extend(steps[0]), [steps[1]]).steps[0]
    torch.testing.assert_close(chain[1].mean_hidden, second.mean_hidden, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(chain[1].token_logprobs, second.token_logprobs, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_score_chain_encodes_a_few_uncached_prefix_tokens_in_its_own_forward_and_caches_the_chain(smol_engine,
                                                                                                 gsm_question):
    """A prefix whose cache lacks a few tokens (a step past the last chain) is completed in the steps' forward (one
    forward, not a prefill and a scoring pass) and cached as a prefill caches it; the whole chain is cached too: a
    prefix through the chain's steps reuses all of it but the one token that gives its logits. The scores equal
    those of a call that finds its prefix cached and of one whose prefix a prefill encoded. A long uncached prefix
    still gets its own prefill forward."""
    prefix, steps = Prefix(gsm_question), ["12 * 4 = 48.\n\n", "48 - 30 = 18.\n\n", "So 18 muffins are left.\n\n"]
    middle, longer = prefix.extend(steps[0]), prefix.extend(steps[0]).extend(steps[1])
    smol_engine.clear_prefix_cache()
    first = smol_engine.score_chain(prefix, steps[:1])
    n_prefix, n_middle = len(smol_engine.prefix_ids(prefix)), len(smol_engine.prefix_ids(middle))
    n_longer = len(smol_engine.prefix_ids(longer))
    assert n_prefix > 64 and first.stats.forward_passes == 2  # too many uncached tokens to merge
    cold = smol_engine.score_chain(longer, steps[2:])  # the first chain holds `middle`: steps[1] is merged
    step_tokens = len(cold.steps[0].token_ids)
    assert cold.stats.forward_passes == 1 and cold.stats.reused_prefix_tokens == n_middle
    assert cold.stats.prefill_tokens == n_longer - n_middle + step_tokens
    warm = smol_engine.score_chain(longer, steps[2:])  # the cold call cached `longer` exactly (and its chain)
    assert warm.stats.forward_passes == 1 and warm.stats.reused_prefix_tokens == n_longer
    smol_engine.clear_prefix_cache()
    alone = smol_engine.score(longer, steps[2:]).steps[0]  # its prefix encoded by a prefill forward
    for other in (warm.steps[0], alone):
        torch.testing.assert_close(cold.steps[0].token_logprobs, other.token_logprobs, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(cold.steps[0].mean_hidden, other.mean_hidden, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(cold.steps[0].last_hidden, other.last_hidden, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_a_step_after_scored_drafts_reuses_their_chain(smol_engine, gsm_question):
    """SemanticSpec's target scores the drafts as one chain, then (after a rejection) writes the step that follows
    the accepted ones: that step's prompt is read from the chain's cache, all but its last token (none when no
    draft was accepted: the context the chain encoded a part of is cached exactly), and the step is the one the
    target writes from a cold cache."""
    question, drafts = Prefix(gsm_question), ["12 * 4 = 48.\n\n", "48 - 30 = 18.\n\n", "So 18 are left.\n\n"]
    params = SamplingParams(temperature=0.0, max_step_tokens=12)
    smol_engine.clear_prefix_cache()
    smol_engine.generate([StepRequest(question)], params)  # caches the question's prompt
    context = question.extend("Each tray holds 12.\n\n")  # its last step uncached: the chain's forward encodes it
    smol_engine.score_chain(context, drafts, hidden=False)
    first = smol_engine.generate([StepRequest(context)], params)  # the first draft rejected
    assert (first.stats.prefill_tokens, first.stats.reused_prefix_tokens) == (0, len(smol_engine.prefix_ids(context)))
    after = context.extend(drafts[0]).extend(drafts[1])
    got = smol_engine.generate([StepRequest(after)], params)
    n_after = len(smol_engine.prefix_ids(after))
    assert got.stats.reused_prefix_tokens == n_after - 1
    assert got.stats.prefill_tokens == 1  # the drafts are not encoded again
    smol_engine.clear_prefix_cache()
    want = smol_engine.generate([StepRequest(after)], params)
    assert_same_greedy(smol_engine.model, smol_engine.prefix_ids(after), got.steps[0][0].token_ids,
                       want.steps[0][0].token_ids, at_least=4)


@pytest.mark.slow
def test_bad_prompts_are_clear_errors(smol_engine):
    with pytest.raises(ValueError, match="empty prompt"):
        smol_engine.format_prefix("   ")
    with pytest.raises(ValueError, match="empty prompt"):
        Prefix("  ")
    saved = smol_engine.info.max_length
    smol_engine.info.max_length = 32
    try:
        with pytest.raises(PromptTooLongError, match="context window"):
            sample(smol_engine, [Prefix("word " * 40)], 1, SamplingParams())
        with pytest.raises(PromptTooLongError, match="context window"):
            smol_engine.check_fits(Prefix("word " * 40))
    finally:
        smol_engine.info.max_length = saved
    with pytest.raises(ValueError, match="out of range"):
        smol_engine.score(Prefix("Hi"), ["x"], layers=[99])


def test_nucleus_sampling_keeps_only_the_top_mass():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    draws = {draw_tokens([], logits, 1.0, 0.7, gen)[0] for _ in range(200)}
    assert draws == {0, 1}  # 0.5 + 0.3 reaches 0.7; tokens 2 and 3 are cut
    assert draw_tokens([], logits, 0.0, 0.7, gen) == [0]


def test_find_step_end_skips_leading_blank_lines():
    assert find_step_end("\n\nabc\n\nrest", "\n\n") == 7
    assert find_step_end("\n\n", "\n\n") is None
    assert find_step_end("no delimiter", "\n\n") is None


def test_random_engine_builds_from_a_named_size():
    engine = HFStepEngine("random:llama-tiny", device="cpu")
    assert engine.info.num_layers == 2 and engine.info.hidden_size == 64
    out = sample(engine, [Prefix("Hello")], 2, SamplingParams(seed=0, max_step_tokens=5))
    assert all(s.num_tokens <= 5 for s in out[0])


class _ForwardTaking(torch.nn.Module):
    """A model whose forward takes its KV cache by `cache` (transformers' newer name), around one that may not."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)

    def forward(self, input_ids=None, cache=None, **kw):
        self.calls.append((cache is not None, "past_key_values" in kw))
        return self.inner(input_ids=input_ids, **kw, **({cache_keyword(self.inner): cache} if cache is not None else {}))


class _Peft(torch.nn.Module):
    """A wrapper whose forward passes everything on, with the model behind `get_base_model()` (PEFT's)."""

    def __init__(self, holder):
        super().__init__()
        self.holder = holder

    def forward(self, *args, **kwargs):
        return self.holder.inner(*args, **kwargs)

    def get_base_model(self):
        return self.holder.inner


def test_cache_keyword_follows_the_forward_signature():
    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kw):
            return None

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, **kw):
            return None

    class Holder(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

    assert cache_keyword(Old()) == "past_key_values" and cache_keyword(New()) == "cache"
    assert cache_keyword(_Peft(Holder(New()))) == "cache"  # through get_base_model()
    assert cache_keyword(_Peft(Holder(Old()))) == "past_key_values"
    assert cache_keyword(torch.nn.DataParallel(New())) == "cache"  # its `module`
    assert cache_keyword(torch.nn.Sequential()) == "past_key_values"  # forward(input): nothing to go by

    class Endless(torch.nn.Module):  # a wrapper that hands out a new wrapper each time
        def forward(self, *args, **kwargs):
            return None

        def get_base_model(self):
            return Endless()

    assert cache_keyword(Endless()) == "past_key_values"  # gives up after a few, does not loop
    assert output_cache(OrderedDict(logits=0, cache="new")) == "new"
    assert output_cache(OrderedDict(logits=0, past_key_values="old")) == "old"
    assert output_cache(OrderedDict(logits=0)) is None
    from transformers.modeling_outputs import CausalLMOutputWithPast

    fields = CausalLMOutputWithPast.__dataclass_fields__
    name = "cache" if "cache" in fields else "past_key_values"
    assert output_cache(CausalLMOutputWithPast(logits=torch.zeros(1), **{name: "kv"})) == "kv"


@pytest.mark.parametrize("decode", ["eager", "fast"])
def test_a_model_taking_cache_decodes_and_scores_as_before(decode):
    """transformers 5.24 takes the forward's KV cache as `cache` (`past_key_values` warns, and goes in 5.40): the
    engine passes its cache under whichever name the model takes, on both decode paths, in scoring and in the
    one-sequence KV of Lookahead Decoding and SEED."""
    plain = HFStepEngine("random:llama-tiny", device="cpu", decode=decode)
    model = _ForwardTaking(plain.model)
    assert cache_keyword(model) == "cache"
    renamed = HFStepEngine("random:llama-tiny", model=model, tokenizer=plain.tokenizer, device="cpu", decode=decode)
    greedy = SamplingParams(temperature=0, max_step_tokens=8)
    prefixes = [Prefix("Hello"), Prefix("Hello", ("One step",))]
    want = sample(plain, prefixes, 1, greedy)
    got = sample(renamed, prefixes, 1, greedy)
    assert [s[0].token_ids for s in got] == [s[0].token_ids for s in want]
    steps = [s[0].text for s in want]
    for score in ("score", "score_chain"):
        got_scores = getattr(renamed, score)(prefixes[0], steps).steps
        want_scores = getattr(plain, score)(prefixes[0], steps).steps
        assert [s.logprob for s in got_scores] == pytest.approx([s.logprob for s in want_scores], abs=1e-5)
    ids = plain.prefix_ids(prefixes[1])
    seqs = SequenceKV(plain.model), SequenceKV(model)
    for seq in seqs:
        seq.start(ids)
        seq.forward(ids)
    want_next, got_next = (seq.forward(ids + [7, 8])[0] for seq in seqs)  # two tokens after the cached ones
    assert torch.allclose(got_next, want_next, atol=1e-5)
    assert any(with_cache for with_cache, _ in model.calls)  # decoding fed a cache back
    assert not any(old for _, old in model.calls)  # and never under the old name


def test_generated_steps_are_prefixes_by_their_own_ids():
    """A generated step in a prefix contributes its own token ids (never re-tokenised); a given step
    is followed by the delimiter; a step of another tokenizer is encoded from its text."""
    engine = HFStepEngine("random:llama-tiny", device="cpu", use_chat_template=False)
    step = sample(engine, [Prefix("Hello")], 1, SamplingParams(seed=0, max_step_tokens=6))[0][0]
    head = engine.prefix_ids(Prefix("Hello"))
    assert engine.prefix_ids(Prefix("Hello", (step,))) == head + step.token_ids
    assert engine.prefix_ids(Prefix("Hello", ("Given step",))) == head + engine.text.text_ids("Given step\n\n")
    foreign = type(step)(step.text, [1, 2, 3], step.stop_reason, step.logprob, "another-tokenizer")
    assert engine.prefix_ids(Prefix("Hello", (foreign,))) == head + engine.text.text_ids(step.text)
    assert engine.format_prefix("Hello", [step, "Given"]) == "Hello\n\n" + step.text + "Given\n\n"


def test_the_stop_rule_is_one_function():
    engine = HFStepEngine("random:llama-tiny", device="cpu", use_chat_template=False)
    tok, text = engine.tokenizer, engine.text
    ids = text.text_ids("Add them.\n\nThen")
    cut = next(i for i in range(1, len(ids) + 1) if "\n\n" in tok.decode(ids[:i]))
    assert text.finished(ids[:cut - 1], 50, "\n\n") is None
    assert text.finished(ids[:cut], 50, "\n\n") == (tok.decode(ids[:cut]), "delimiter")
    assert text.finished(ids[:2], 2, "\n\n") == (tok.decode(ids[:2]), "length")
    eos = next(iter(engine.eos_ids))
    assert text.finished(ids[:2] + [eos], 50, "\n\n") == (tok.decode(ids[:2]), "eos")
    assert text.finished(text.text_ids("\n\n"), 50, "\n\n") is None  # no content yet: not a step


_CORPUS = ["Add 3 and 4 to get 7. Then multiply by 2 and so on.", "So the answer is 14 ## next we check it.",
           "First, the total is 12 - the rest follows. Done."] * 20


def _small_tokenizer(style: str):
    """A small BPE tokenizer trained here. "sentencepiece": as Llama 2 and Mistral ship theirs, spaces become "▁",
    unknown characters fall back to <0xNN> byte tokens of the vocabulary, and the decoder strips the leading space
    of what it decodes, so a token decoded on its own loses its space. "byte-level": as GPT-2, Qwen and Llama 3.
    "wordpiece": as BERT, a lone continuation token keeps its "##"."""
    import json
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if style == "wordpiece":  # characters only: a word is its first letter, then "##" + each further letter
        chars = string.ascii_letters + string.digits + string.punctuation
        vocab = {t: i for i, t in enumerate(["[UNK]", "</s>", *chars, *(f"##{c}" for c in chars)])}
        tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.BertPreTokenizer(), decoders.WordPiece()
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="[UNK]")
    tok = Tokenizer(models.BPE())
    if style == "byte-level":
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["</s>"],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    tok.pre_tokenizer = pre_tokenizers.Metaspace("▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"]))
    trained = json.loads(tok.to_str())["model"]  # the byte tokens join the vocabulary as ordinary tokens
    vocab = dict(trained["vocab"])
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok.model = models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("style", ["sentencepiece", "byte-level"])
@pytest.mark.parametrize("delimiter", ["\n\n", "\n", " ##", ". ", "\n- "])
def test_the_fast_paths_cheap_delimiter_test_never_misses_a_step_end(style, delimiter):
    """The fast path decodes only where `next_tail` says a step may end. It must say so at every token where the
    exact rule (a full decode) ends the step, also where lone tokens lose their spaces, and not at most other
    tokens (else it would spare nothing)."""
    tok = _small_tokenizer(style)
    text = StepTokenizer(tok, use_chat_template=False)
    assert text.cheap_test_holds(delimiter)
    for body in ("Add 3 and 4 to get 7", "So the answer is 14", "First, the total is 12"):
        ids = text.text_ids(f"{body}{delimiter}Then multiply by 2 and so on. Done")
        if style == "sentencepiece":
            assert "".join(text.piece(t) for t in ids) != tok.decode(ids)  # lone tokens do lose spaces here
        tail, ends, yes = "", 0, 0
        for i, t in enumerate(ids):
            tail, may_end = text.next_tail(tail, t, delimiter)
            yes += may_end
            if text.finished(ids[:i + 1], 10**6, delimiter) and not text.finished(ids[:i], 10**6, delimiter):
                ends += 1
                assert may_end, f"missed the step end at token {i} of {tok.convert_ids_to_tokens(ids)}"
        assert ends == 1
        assert yes <= len(ids) // 2


def test_the_cheap_delimiter_test_is_off_where_lone_tokens_add_text():
    """A WordPiece decoder writes a lone continuation token with its "##", so a delimiter that such tokens spell
    never shows in the pieces: the fast path must run the exact rule at every token instead."""
    tok = _small_tokenizer("wordpiece")
    wordpiece = StepTokenizer(tok, use_chat_template=False)
    ids = wordpiece.text_ids("doneEND")
    assert tok.decode(ids) == "doneEND" and "".join(wordpiece.piece(t) for t in ids) == "d##o##n##e##E##N##D"
    assert not wordpiece.cheap_test_holds("END")
    assert wordpiece.cheap_test_holds(".")
    assert not StepTokenizer(_small_tokenizer("byte-level"), use_chat_template=False).cheap_test_holds("\u3002")


def test_engine_modules_import_one_way():
    """No import cycle inside infer/engines (hf -> hf_kv -> tokens/token_spec -> base), and the runtime
    reaches the transformers engine only through the interface module."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    graph = {}
    for path in (root / "infer" / "engines").glob("*.py"):
        tree = ast.parse(path.read_text())
        deps = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        deps |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        graph[f"specprobe.infer.engines.{path.stem}"] = {d for d in deps if d.startswith("specprobe.infer.engines.")}
    done = set()

    def visit(mod, stack):
        assert mod not in stack, f"import cycle: {' -> '.join(stack + [mod])}"
        if mod in done:
            return
        for dep in graph.get(mod, ()):
            visit(dep, stack + [mod])
        done.add(mod)

    for mod in graph:
        visit(mod, [])
    for path in (root / "infer" / "decoding").glob("*.py"):
        text = path.read_text()
        assert "specprobe.infer.engines.hf" not in text, f"{path.name} reaches into the transformers engine"
