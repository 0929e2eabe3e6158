"""Equivalence judges: NLI plumbing on a tiny random DeBERTa-v2, the offline embedding judge on real
MiniLM, and the persistent cache."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import AutoTokenizer, DebertaV2Config, DebertaV2ForSequenceClassification

from specprobe.data_gen.cluster import cluster_samples
from specprobe.data_gen.judges import (
    CachedJudge,
    EmbeddingNumberJudge,
    EquivalenceJudge,
    NLIJudge,
    PairQuery,
    PairTemplate,
    extract_numbers,
    fit_pair,
    label_roles,
    make_judge,
    nli_equivalent,
    position_limit,
)
from specprobe.infer.models import offline_model_folder

STANDARD = {0: "ENTAILMENT", 1: "NEUTRAL", 2: "CONTRADICTION"}
PERMUTED = {0: "contradiction", 1: "neutral", 2: "entailment"}

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread




@pytest.fixture(scope="module")
def tokenizer():
    # No NLI tokenizer ships offline; MiniLM's BERT WordPiece tokenizer is a real one to plumb with.
    return AutoTokenizer.from_pretrained(offline_model_folder("minilm"))


def tiny_nli(tokenizer, id2label, winner: int | None = None, name: str = ""):
    """Random 2-layer DeBERTa-v2 classifier; with `winner`, the logits are the bias and that index wins."""
    config = DebertaV2Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=64, num_labels=len(id2label), id2label=id2label,
                             label2id={v: k for k, v in id2label.items()}, max_position_embeddings=512,
                             pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = DebertaV2ForSequenceClassification(config).eval()
    model.config._name_or_path = name
    if winner is not None:
        with torch.no_grad():
            model.classifier.weight.zero_()
            model.classifier.bias.copy_(torch.nn.functional.one_hot(torch.tensor(winner), len(id2label)) * 10.0)
    return model


def record_inputs(model) -> list[torch.Tensor]:
    """Collect the input_ids of every forward pass."""
    seen: list[torch.Tensor] = []
    model.register_forward_hook(lambda mod, args, kwargs, out: seen.append(kwargs["input_ids"].clone()),
                                with_kwargs=True)
    return seen


# ----------------------------------------------------------------------------------------------- NLI

@pytest.mark.parametrize("id2label, winner, expected", [
    (STANDARD, 0, True),    # entailment at index 0 wins both ways
    (STANDARD, 2, False),   # contradiction at index 2
    (PERMUTED, 0, False),   # index 0 is now contradiction
    (PERMUTED, 2, True),    # entailment moved to index 2
    (PERMUTED, 1, False),   # neutral
])
def test_decision_follows_label_name_not_index(tokenizer, id2label, winner, expected):
    judge = NLIJudge((tiny_nli(tokenizer, id2label, winner), tokenizer))
    pairs = [PairQuery("Q: 3 boxes of 24 eggs?\n\n", "3 * 24 = 72.", "That makes 72 eggs."),
             PairQuery("", "a", "completely different")]
    assert judge.judge(pairs) == [expected, expected]
    assert judge.model_calls == 2


def test_no_entailment_label_is_a_clear_error(tokenizer):
    model = tiny_nli(tokenizer, {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"}, name="my-org/generic-classifier")
    with pytest.raises(ValueError, match="my-org/generic-classifier") as err:
        NLIJudge((model, tokenizer))
    assert "LABEL_0" in str(err.value) and "entailment" in str(err.value)
    # "not_entailment" is not entailment
    with pytest.raises(ValueError, match="no 'entailment' label"):
        label_roles({0: "not_entailment", 1: "neutral"}, "rte-model")


def test_non_strict_needs_neutral_and_contradiction_labels():
    assert label_roles({0: "entailment", 1: "not_entailment"}, "m", strict=True) == ["entailment", "other"]
    with pytest.raises(ValueError, match="strict=True"):
        label_roles({0: "entailment", 1: "not_entailment"}, "m", strict=False)


def test_nli_equivalent_rules():
    E, N, C = "entailment", "neutral", "contradiction"
    assert nli_equivalent(E, E, strict=True)
    for other in [(E, N), (N, E), (E, C), (N, N)]:
        assert not nli_equivalent(*other, strict=True)
    # non-strict: no contradiction either way, and not neutral both ways
    assert nli_equivalent(E, N, strict=False) and nli_equivalent(N, E, strict=False)
    assert nli_equivalent(E, E, strict=False)
    assert not nli_equivalent(N, N, strict=False)
    assert not nli_equivalent(E, C, strict=False) and not nli_equivalent(C, E, strict=False)
    # a model with a fourth class: that class both ways (or with neutral) is not agreement
    assert not nli_equivalent("other", "other", strict=False) and not nli_equivalent("other", N, strict=False)
    assert nli_equivalent(E, "other", strict=False)


def word_inclusion_hook(tokenizer, id2label):
    """Replace the logits by a content rule: premise => hypothesis iff every hypothesis token occurs in
    the premise; contradiction iff exactly one side contains "not". Makes decisions depend on content,
    direction and pair order, so batching, ordering and both directions are really exercised."""
    sep, pad, not_id = tokenizer.sep_token_id, tokenizer.pad_token_id, tokenizer.convert_tokens_to_ids("not")
    index = {v.lower(): k for k, v in id2label.items()}

    def hook(module, args, kwargs, output):
        logits = torch.zeros_like(output.logits)
        for row, ids in enumerate(kwargs["input_ids"].tolist()):
            ids = [i for i in ids if i != pad]
            first_sep = ids.index(sep)
            premise, hypothesis = set(ids[1:first_sep]), set(ids[first_sep + 1:-1])
            if (not_id in premise) != (not_id in hypothesis):
                label = "contradiction"
            elif hypothesis <= premise:
                label = "entailment"
            else:
                label = "neutral"
            logits[row, index[label]] = 1.0
        output.logits = logits
        return output

    return hook


@pytest.mark.parametrize("strict", [True, False])
def test_both_directions_batched_and_order_restored(tokenizer, strict):
    model = tiny_nli(tokenizer, PERMUTED)
    model.register_forward_hook(word_inclusion_hook(tokenizer, PERMUTED), with_kwargs=True)
    seen = record_inputs(model)
    judge = NLIJudge((model, tokenizer), strict=strict, batch_size=3)
    ctx = "question : how many apples ?\n\n"
    pairs = [
        PairQuery(ctx, "red apple", "apple red"),                  # same words: E both ways
        PairQuery(ctx, "red apple", "red apple pie tonight now"),  # a => b neutral, b => a entailment
        PairQuery(ctx, "cat", "dog"),                              # neutral both ways
        PairQuery(ctx, "cat", "not cat"),                          # contradiction
        PairQuery("", "big dog runs fast", "big dog runs"),        # E one way, N the other
    ]
    expected = [True, False, False, False, False] if strict else [True, True, False, False, True]
    assert judge.judge(pairs) == expected
    assert judge.model_calls == 5
    # 10 sequences (both directions) in minibatches of 3 -> 4 forward passes, each of <= 3 rows.
    assert [len(x) for x in seen] == [3, 3, 3, 1]
    assert judge.judge([]) == [] and judge.model_calls == 5


def test_pair_layout_is_context_plus_step_each_side(tokenizer):
    model = tiny_nli(tokenizer, STANDARD, winner=0)
    seen = record_inputs(model)
    NLIJudge((model, tokenizer)).judge([PairQuery("the context.", "step a", "step b")])
    texts = sorted(tokenizer.decode([i for i in row if i != tokenizer.pad_token_id]) for row in torch.cat(seen))
    assert texts == ["[CLS] the context. step a [SEP] the context. step b [SEP]",
                     "[CLS] the context. step b [SEP] the context. step a [SEP]"]


def test_pair_template_for_bert_tokenizer(tokenizer):
    template = PairTemplate.from_tokenizer(tokenizer)
    ids, types = template.build([7, 8], [9])
    assert ids == [tokenizer.cls_token_id, 7, 8, tokenizer.sep_token_id, 9, tokenizer.sep_token_id]
    assert types == [0, 0, 0, 0, 1, 1]
    assert template.num_special == 3


def test_fit_pair_trims_context_from_the_left():
    ctx, a, b = list(range(100)), [1000, 1001], [2000, 2001, 2002]
    kept, a2, b2 = fit_pair(ctx, a, b, budget=25)
    assert (a2, b2) == (a, b)
    assert kept == list(range(90, 100))  # (25 - 5) // 2 = 10 tokens of context, its END
    assert 2 * len(kept) + len(a2) + len(b2) <= 25
    assert fit_pair(ctx, a, b, budget=1000) == (ctx, a, b)
    # steps alone too long: context gone, steps cut from the right, the short one kept whole
    kept, a2, b2 = fit_pair(ctx, [1] * 3, [2] * 50, budget=20)
    assert kept == [] and a2 == [1] * 3 and b2 == [2] * 17


def test_long_context_is_trimmed_from_the_left_keeping_whole_steps(tokenizer):
    model = tiny_nli(tokenizer, STANDARD, winner=0)
    seen = record_inputs(model)
    context = " ".join(f"word{i}" for i in range(400)) + " final clue."
    step_a, step_b = "so the total is twelve apples.", "hence twelve apples in all."
    judge = NLIJudge((model, tokenizer), max_length=64)
    assert judge.judge([PairQuery(context, step_a, step_b)]) == [True]
    ctx_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    a_ids = tokenizer(step_a, add_special_tokens=False)["input_ids"]
    b_ids = tokenizer(step_b, add_special_tokens=False)["input_ids"]
    rows = torch.cat(seen).tolist()
    assert len(rows) == 2
    for row in rows:
        assert len(row) <= 64
        sep = tokenizer.sep_token_id
        first = row[1:row.index(sep)]
        second = row[row.index(sep) + 1:-1]
        for segment in (first, second):
            step = a_ids if segment[-len(a_ids):] == a_ids else b_ids
            assert segment[-len(step):] == step  # the whole step, at the end
            kept = segment[:-len(step)]
            assert kept == ctx_ids[-len(kept):] and len(kept) > 10  # the context's END survives
            assert ctx_ids[-5:] == kept[-5:]
    assert judge.truncated_steps == 0


def test_max_length_past_learned_positions_is_refused(tokenizer):
    # tiny_nli adds learned absolute positions (DeBERTa's position_biased_input): 512 of them
    with pytest.raises(ValueError, match="max_length=600 .*longer than the 512 learned positions.*at most 512"):
        NLIJudge((tiny_nli(tokenizer, STANDARD), tokenizer), max_length=600)
    NLIJudge((tiny_nli(tokenizer, STANDARD), tokenizer), max_length=512)
    # RoBERTa-style positions start past the padding index: 514 rows hold 512
    from transformers import RobertaConfig, RobertaForSequenceClassification
    roberta = RobertaForSequenceClassification(RobertaConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=514, pad_token_id=1, num_labels=3, id2label=STANDARD)).eval()
    assert position_limit(roberta) == 512
    with pytest.raises(ValueError, match="learned positions"):
        NLIJudge((roberta, tokenizer), max_length=513)
    # BART (facebook/bart-large-mnli) keeps its positions in the encoder, two rows past the 1024 it reads
    from transformers import BartConfig, BartForSequenceClassification
    bart = BartForSequenceClassification(BartConfig(
        vocab_size=len(tokenizer), d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, max_position_embeddings=1024))
    assert position_limit(bart) == 1024
    # relative positions only (microsoft/deberta-large-mnli's layout): no table, no limit
    config = DebertaV2Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                             intermediate_size=64, num_labels=3, id2label=STANDARD, max_position_embeddings=512,
                             relative_attention=True, position_biased_input=False)
    relative = DebertaV2ForSequenceClassification(config).eval()
    assert position_limit(relative) is None
    NLIJudge((relative, tokenizer), max_length=1024)


def test_overlong_steps_are_cut_with_a_warning(tokenizer, caplog):
    model = tiny_nli(tokenizer, STANDARD, winner=0)
    seen = record_inputs(model)
    judge = NLIJudge((model, tokenizer), max_length=16)
    with caplog.at_level(logging.WARNING, logger="specprobe.data_gen.judges"):
        judge.judge([PairQuery("ctx", " ".join(["word"] * 20), "eleven")])
    assert all(len(r) <= 16 for r in torch.cat(seen).tolist())
    assert judge.truncated_steps == 1 and "exceed max_length" in caplog.text


# ------------------------------------------------------------------------------- embedding + numbers

def test_extract_numbers():
    assert extract_numbers("It costs $1,000 and 3.50 each.") == {"1000", "3.5"}
    assert extract_numbers("1000 and 3.5") == extract_numbers("1,000 and 3.50")
    assert extract_numbers("The answer is 72.") == {"72"}
    assert extract_numbers("x = -5, so 10-5 = 5") == {"-5", "10", "5"}
    assert extract_numbers("x2 + v1 has no numbers; 0.00 = -0") == {"0"}
    assert extract_numbers("half is .5 or 1/2") == {"0.5", "1", "2"}
    assert extract_numbers("twelve") == frozenset()
    # list markers number the step, they are not quantities (SmolLM2 writes "1. First, ...")
    assert extract_numbers("1. First, we need the total.") == frozenset()
    assert extract_numbers("2) She bakes 4 trays\n3. So 12 * 4 = 48") == {"4", "12", "48"}
    assert extract_numbers("Step 2: 48 muffins") == {"48"}
    assert extract_numbers("48. Then") == frozenset()  # a line opening "N. " reads as a marker (known limit)
    assert extract_numbers("so x = 5. 7 is prime") == {"5", "7"}  # not at a line start: numbers


@pytest.fixture(scope="module")
def embedder(one_thread):
    from specprobe.infer.embedder import SentenceEmbedder

    return SentenceEmbedder("offline:minilm", device="cpu")


@pytest.mark.slow
def test_embedding_judge_with_minilm(embedder):
    judge = EmbeddingNumberJudge(embedder)
    assert judge.name == "embedding:offline:minilm:cos>=0.8:same-numbers"
    pairs = [
        PairQuery("", "So the total is 3 * 4 = 12 apples.", "Therefore, the total number of apples is 3 * 4 = 12."),
        PairQuery("", "Each box holds 24 eggs, so 3 boxes hold 72 eggs.",
                  "Three boxes with 24 eggs each give 72 eggs in total."),
        PairQuery("", "The answer is 72.", "The answer is 48."),
        PairQuery("", "The answer is 72.", "Next, list the 72 prime numbers."),  # same numbers, unrelated
    ]
    assert judge.judge(pairs) == [True, False, False, False]  # pair 2: "Three" is a word, {24,3,72} vs {24,72}
    assert judge.model_calls == 2  # number mismatches never reach the model
    # Cosine alone calls the number change equivalent: the reason for the number check.
    cosine_only = EmbeddingNumberJudge(embedder, require_same_numbers=False)
    assert cosine_only.judge([pairs[2]]) == [True]
    with pytest.raises(ValueError, match="threshold"):
        EmbeddingNumberJudge(embedder, threshold=1.5)


@pytest.mark.slow
def test_paraphrases_with_same_numbers_cluster_together(embedder):
    judge = EmbeddingNumberJudge(embedder)
    samples = ["She has 5 apples and buys 7 more, so she has 12 apples.",
               "The answer is 48.",
               "After buying 7 more apples, she has 5 + 7 = 12 apples.",
               "she has 5 apples and buys 7 more,  so she has 12 apples."]
    assert cluster_samples("Q", samples, judge) == [0, 1, 0, 0]


@pytest.mark.slow
def test_cached_embedding_judge_reuses_decisions(embedder, tmp_path):
    path = tmp_path / "judge.jsonl"
    pairs = [PairQuery("c", "The answer is 72.", "So the answer is 72."),
             PairQuery("c", "The answer is 72.", "The answer is 48.")]
    first = make_judge("embedding", embedder=embedder, cache_path=path)
    assert isinstance(first, CachedJudge) and isinstance(first.inner, EmbeddingNumberJudge)
    decisions = first.judge(pairs)
    assert decisions == [True, False]
    resumed = make_judge("embedding", embedder=embedder, cache_path=path)
    assert resumed.judge(pairs) == decisions
    assert resumed.model_calls == 0 and resumed.hits == 2


def test_make_judge_rejects_unknown_kind():
    with pytest.raises(ValueError, match="'nli', 'embedding'|embedding"):
        make_judge("llm")


# --------------------------------------------------------------------------------------------- cache

class CountingJudge(EquivalenceJudge):
    """Equivalent iff the same length; records every pair it evaluates."""

    def __init__(self, name="len", symmetric=True):
        self.name, self.symmetric, self.model_calls = name, symmetric, 0
        self.seen: list[PairQuery] = []

    def judge(self, items):
        self.seen.extend(items)
        self.model_calls += len(items)
        return [len(q.a) == len(q.b) for q in items]


PAIRS = [PairQuery("ctx", "abc", "xyz"), PairQuery("ctx", "abc", "longer"), PairQuery("other", "abc", "xyz")]


def test_cache_second_run_makes_no_inner_calls(tmp_path):
    path = tmp_path / "sub" / "cache.jsonl"
    inner = CountingJudge()
    cached = CachedJudge(inner, path)
    assert cached.judge(PAIRS) == [True, False, True]
    assert inner.model_calls == 3 and cached.misses == 3 and cached.hits == 0
    assert cached.judge(PAIRS) == [True, False, True]
    assert inner.model_calls == 3 and cached.hits == 3
    # A new process (fresh objects) reading the file.
    inner2 = CountingJudge()
    resumed = CachedJudge(inner2, path)
    assert len(resumed) == 3
    assert resumed.judge(PAIRS) == [True, False, True] and inner2.model_calls == 0


def test_cache_with_lone_surrogates_resumes(tmp_path):
    """Input lines read from JSON can hold a lone surrogate ("\\ud800"); the cache must key, write and
    reload such pairs, and keep pairs that differ only in the surrogate apart."""
    path = tmp_path / "cache.jsonl"
    pairs = [PairQuery("ctx \ud800", "abc", "xyz"), PairQuery("ctx \udfff", "abc", "xyz"),
             PairQuery("ctx", "a\ud83d", "longer")]
    first = CachedJudge(CountingJudge(), path)
    assert first.judge(pairs) == [True, True, False] and first.inner.model_calls == 3
    path.read_text(encoding="utf-8")  # the file itself is valid UTF-8
    inner = CountingJudge()
    resumed = CachedJudge(inner, path)
    assert len(resumed) == 3 and resumed.skipped_lines == 0
    assert resumed.judge(pairs) == [True, True, False] and inner.model_calls == 0


def test_cache_keys_are_order_free_only_for_symmetric_judges():
    sym = CachedJudge(CountingJudge(symmetric=True))
    sym.judge([PairQuery("c", "abc", "xyz"), PairQuery("c", " xyz\n", "abc")])  # swapped + whitespace
    assert sym.inner.model_calls == 1 and sym.hits == 1
    sym.judge([PairQuery("c", "abc", "XYZ")])  # letter case may change the meaning: not a cache hit
    assert sym.inner.model_calls == 2
    asym = CachedJudge(CountingJudge(symmetric=False))
    asym.judge([PairQuery("c", "abc", "xyz"), PairQuery("c", "xyz", "abc")])
    assert asym.inner.model_calls == 2


def test_cache_keys_depend_on_judge_identity_and_context(tmp_path):
    path = tmp_path / "cache.jsonl"
    CachedJudge(CountingJudge(name="judge-A"), path).judge(PAIRS[:1])
    other = CachedJudge(CountingJudge(name="judge-B"), path)
    other.judge(PAIRS[:1])
    assert other.inner.model_calls == 1  # a different judge does not reuse A's decisions
    same = CachedJudge(CountingJudge(name="judge-A"), path)
    same.judge([PairQuery("new context", "abc", "xyz")])
    assert same.inner.model_calls == 1


def test_cache_survives_a_truncated_last_line(tmp_path, caplog):
    path = tmp_path / "cache.jsonl"
    CachedJudge(CountingJudge(), path).judge(PAIRS)
    whole = path.read_text()
    lines = whole.splitlines()
    # Crash mid-write: the last record is cut in half, and a garbage line sits in the middle.
    path.write_text(lines[0] + "\n" + "{not json\n" + lines[1] + "\n" + lines[2][:20])
    inner = CountingJudge()
    with caplog.at_level(logging.WARNING, logger="specprobe.data_gen.judges"):
        resumed = CachedJudge(inner, path)
    assert "truncated" in caplog.text
    assert len(resumed) == 2 and resumed.skipped_lines == 1
    assert resumed.judge(PAIRS) == [True, False, True]
    assert inner.model_calls == 1  # only the lost record is recomputed
    # The re-appended record starts on its own line: every line is valid JSON again, except the garbage.
    records = [ln for ln in path.read_text().splitlines() if ln != "{not json"]
    assert [json.loads(ln)["equivalent"] for ln in records] == [True, False, True]
    assert CachedJudge(CountingJudge(), path).judge(PAIRS) == [True, False, True]


def test_cache_refuses_a_judge_that_answers_fewer_pairs_than_asked(tmp_path):
    class Short(CountingJudge):
        def judge(self, items):
            return super().judge(items)[:-1]

    cached = CachedJudge(Short("short"), tmp_path / "cache.jsonl")
    with pytest.raises(RuntimeError, match="judge 'short' returned 2 decisions for 3 pairs"):
        cached.judge(PAIRS)
    assert len(cached) == 0 and not (tmp_path / "cache.jsonl").exists()  # nothing half-recorded


def test_cache_dedupes_within_a_batch():
    inner = CountingJudge()
    cached = CachedJudge(inner)
    assert cached.judge([PAIRS[0], PAIRS[0], PairQuery("ctx", "abc ", " xyz")]) == [True, True, True]
    assert inner.model_calls == 1 and cached.hits == 2 and cached.misses == 1


def test_cache_hands_decisions_to_another_process_and_takes_theirs(tmp_path):
    """What Ray replicas do: the worker's new decisions (decisions(since)) go to the driver, which
    persists them (merge); a resumed worker is given them and asks its model nothing."""
    worker = CachedJudge(CountingJudge())
    worker.judge(PAIRS[:1])
    known = len(worker)
    worker.judge(PAIRS)
    added = worker.decisions(known)
    assert len(added) == 2 and set(added) | set(worker.decisions(0)) == set(worker.decisions())
    path = tmp_path / "cache.jsonl"
    driver = CachedJudge(CountingJudge(), path)
    assert driver.merge(worker.decisions()) == 3 and driver.merge(added) == 0  # nothing twice
    assert len(path.read_text().splitlines()) == 3
    resumed = CachedJudge(CountingJudge())
    resumed.merge(CachedJudge(CountingJudge(), path).decisions())
    assert resumed.judge(PAIRS) == [True, False, True] and resumed.inner.model_calls == 0
