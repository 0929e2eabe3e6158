"""Verifiers behind one interface, and loading them from checkpoints built here with the probes API."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specprobe.infer.engines import HFStepEngine, Prefix
from specprobe.infer.judge_prompt import (
    PREFILL,
    PROMPT_VERSION,
    answer_token_ids,
    build_judge_prompt,
    judge_answer_logits,
    judge_probability,
)
from specprobe.infer.verifiers import (
    AcceptAll,
    BernoulliVerifier,
    CheckpointError,
    ExactMatch,
    StepContext,
    VerifyItem,
    build_verifier,
    load_verifier,
    normalize_exact,
)
from specprobe.probes.acceptance import semantic_accept_prob

from _probe_fixtures import make_probe

CTX = StepContext("What is 6 * 7?", ("We multiply the numbers.\n\n",))


@pytest.fixture(scope="module")
def tiny():
    return HFStepEngine("random:llama-tiny", device="cpu", use_chat_template=False)


@pytest.fixture(scope="module")
def small():
    return HFStepEngine("random:llama-20m", device="cpu", use_chat_template=False)




def write_probe_checkpoint(folder, target_engine, draft_engine, p_bias=-0.85, q_bias=0.4):
    """Probes whose outputs hover around sigmoid(bias): p ~ 0.3, q ~ 0.6, so min(1, p/q) ~ 0.5."""
    make_probe(target_engine, p_bias, 0).save(folder, "probe_target")
    make_probe(draft_engine, q_bias, 1).save(folder, "probe_draft")
    return folder


# ----------------------------------------------------------------------------- simple verifiers
def test_exact_match_normalises_case_and_whitespace():
    v = ExactMatch()
    assert normalize_exact("  The Answer\n is 42. ") == "theansweris42."
    got = v.verify([VerifyItem(CTX, "6*7 = 42\n\n", "6 * 7 = 42"), VerifyItem(CTX, "6*7=42", "6*7=43")])
    assert [g.accepted for g in got] == [True, False]
    assert v.score(CTX, "A B", "ab") == 1.0 and v.score("ctx", "a", "b") == 0.0
    with pytest.raises(ValueError, match="target's own step"):
        v.verify([VerifyItem(CTX, "x")])


def test_bernoulli_is_seeded_per_decision_and_has_rate_alpha():
    v = BernoulliVerifier(0.3)
    items = [VerifyItem(CTX, "x", seed=s) for s in range(4000)]
    first, again = v.verify(items), v.verify(items[::-1])[::-1]
    assert [a.accepted for a in first] == [b.accepted for b in again]  # order does not matter, the seed does
    rate = np.mean([a.accepted for a in first])
    assert abs(rate - 0.3) < 4 * np.sqrt(0.3 * 0.7 / 4000)
    assert all(a.prob == 0.3 for a in first)
    with pytest.raises(ValueError):
        BernoulliVerifier(1.5)


def test_accept_reject_all_and_factory_errors():
    assert build_verifier("accept_all").verify([VerifyItem(CTX, "x")])[0].accepted
    assert not build_verifier("reject_all").verify([VerifyItem(CTX, "x")])[0].accepted
    assert AcceptAll().score(CTX, "anything") == 1.0
    with pytest.raises(ValueError, match="unknown verifier"):
        build_verifier("magic")
    with pytest.raises(CheckpointError, match="checkpoint"):
        build_verifier("probe")
    with pytest.raises(ValueError, match="llm_judge_model"):
        build_verifier("llm_judge")


# ----------------------------------------------------------------------------- probe pair
def test_probe_pair_loads_checks_and_applies_min_p_over_q(tmp_path, tiny, small):
    write_probe_checkpoint(tmp_path, small, tiny)
    v = load_verifier(tmp_path, "probe", target_engine=small, draft_engine=tiny)
    assert v.needs_features and not v.needs_target_step
    # features given explicitly: the decision probability is exactly min(1, p/q)
    prefix = Prefix(CTX.question, CTX.steps)
    tf = small.score(prefix, ["6 * 7 = 42.\n\n"]).steps[0].mean_hidden
    df = tiny.score(prefix, ["6 * 7 = 42.\n\n"]).steps[0].mean_hidden
    verdict = v.verify([VerifyItem(CTX, "6 * 7 = 42.\n\n", None, df, tf, seed=3)])[0]
    p, q = float(v.p(tf[None])[0]), float(v.q(df[None])[0])
    assert 0.2 < p < 0.4 and 0.5 < q < 0.7
    assert verdict.prob == pytest.approx(semantic_accept_prob(p, q)) and verdict.detail["p"] == pytest.approx(p)
    # without features the bound engines compute them: same probability
    assert v.score(CTX, "6 * 7 = 42.\n\n") == pytest.approx(verdict.prob, abs=1e-5)
    # the draw is reproducible from its seed
    items = [VerifyItem(CTX, "6 * 7 = 42.\n\n", None, df, tf, seed=s) for s in range(200)]
    a, b = v.verify(items), v.verify(items)
    assert [x.accepted for x in a] == [x.accepted for x in b] and 0 < sum(x.accepted for x in a) < 200


def test_probe_checkpoint_for_another_model_is_a_clear_error(tmp_path, tiny, small):
    write_probe_checkpoint(tmp_path, small, tiny)
    with pytest.raises(CheckpointError, match=r"probe_target .*random:llama-20m.*4 layers / hidden size 256.*2 layers"):
        load_verifier(tmp_path, "probe", target_engine=tiny, draft_engine=tiny)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no probe_target.*train the probes"):
        load_verifier(tmp_path / "empty", "probe")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_verifier(tmp_path / "missing", "probe")


def test_probe_for_another_org_with_the_same_model_name_is_refused(tmp_path, tiny):
    """Identity is the full model id (and revision), or a local folder of the same name, never only the last path
    component of another organisation's id."""
    from dataclasses import replace

    from specprobe.infer.verifiers import check_probe_model

    write_probe_checkpoint(tmp_path, tiny, tiny)
    meta = json.loads((tmp_path / "probe_target.json").read_text())
    spec_key = next(k for k in meta if isinstance(meta[k], dict) and "model_id" in meta[k])
    meta[spec_key]["model_id"] = "other-org/" + tiny.info.model_id  # same last component, other weights
    (tmp_path / "probe_target.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"probe_target does not fit .*trained on 'other-org/random:llama-tiny'.* is a different model"):
        load_verifier(tmp_path, "probe", target_engine=tiny, draft_engine=tiny)
    assert load_verifier(tmp_path, "probe", target_engine=tiny, draft_engine=tiny, allow_model_mismatch=True)
    spec = make_probe(tiny, 0.0).spec
    check_probe_model(spec, tiny.info.model_id.upper() + "/", None)  # case and a trailing slash do not matter
    check_probe_model(spec, "/models/" + tiny.info.model_id, None)  # a local copy of it, as probe-train accepts
    with pytest.raises(CheckpointError, match="the full id counts, or a local folder of the same name"):
        check_probe_model(spec, "other-org/" + tiny.info.model_id, None)
    pinned = replace(spec, revision="abc123")
    check_probe_model(pinned, tiny.info.model_id, None)  # unknown engine revision: nothing to compare
    check_probe_model(pinned, tiny.info.model_id, "abc123")
    with pytest.raises(CheckpointError, match="at revision abc123, but the engine runs revision def456"):
        check_probe_model(pinned, tiny.info.model_id, "def456")


def test_probe_q_near_zero_is_guarded(tmp_path, tiny):
    write_probe_checkpoint(tmp_path, tiny, tiny, p_bias=0.0, q_bias=-40.0)  # q clamps to 1e-6
    v = load_verifier(tmp_path, "probe", target_engine=tiny, draft_engine=tiny)
    assert v.score(CTX, "Some step.\n\n") == 1.0


# ----------------------------------------------------------------------------- embedding threshold
def test_embedding_threshold_from_checkpoint(tmp_path):
    (tmp_path / "embedding_threshold.json").write_text(json.dumps(
        {"kind": "embedding_threshold", "embedding_model": "offline:minilm", "threshold": 0.9,
         "fit": {"chosen": {"threshold": 0.9}}}))
    v = load_verifier(tmp_path, "embedding")
    got = v.verify([VerifyItem(CTX, "So 6 times 7 is 42.", "So 6 times 7 is 42."),
                    VerifyItem(CTX, "The weather is nice today.", "So 6 times 7 is 42.")])
    assert [g.accepted for g in got] == [True, False] and got[0].score == pytest.approx(1.0, abs=1e-5)
    (tmp_path / "embedding_threshold.json").write_text(json.dumps({"threshold": 0.9}))
    with pytest.raises(CheckpointError, match="embedding model"):
        load_verifier(tmp_path, "embedding")
    # fitted with an embedder at a local path this machine lacks: runtime.checkpoint_embedding_model names it
    (tmp_path / "embedding_threshold.json").write_text(json.dumps(
        {"embedding_model": str(tmp_path / "gone" / "minilm"), "threshold": 0.9}))
    moved = build_verifier("embedding", checkpoint=tmp_path, embedding_model="offline:minilm",
                           judge_base="random:llama-tiny")  # (the judge's override is not the embedder's)
    assert [g.accepted for g in moved.verify([VerifyItem(CTX, "So 6 times 7 is 42.", "So 6 times 7 is 42.")])] == [True]
    # a file of a later format version is refused by name, not read as if it were this one
    (tmp_path / "embedding_threshold.json").write_text(json.dumps(
        {"format": "specprobe.embedding_threshold", "format_version": 2, "embedding_model": "offline:minilm",
         "threshold": 0.9}))
    with pytest.raises(CheckpointError, match=r"embedding_threshold.json: field 'format_version' is 2; this "
                                              r"specprobe reads version 1"):
        load_verifier(tmp_path, "embedding")


# ----------------------------------------------------------------------------- judges
def test_judge_prompt_and_answer_tokens():
    from specprobe.infer.models import load_tokenizer

    tok = load_tokenizer("offline:smollm2-135m-instruct")
    prompt = build_judge_prompt(tok, "Q: what is 6*7?\n\nWe multiply.", "6*7 = 42.", "Six times seven is 42.")
    assert prompt.endswith(PREFILL) and "6*7 = 42." in prompt and "Six times seven is 42." in prompt
    assert "We multiply." in prompt and "<|im_start|>assistant" in prompt
    yes, no = answer_token_ids(tok)
    assert yes != no and tok.decode([yes]).startswith("al") and tok.decode([no]).startswith("un")
    long_ctx = "x" * 5000
    assert len(build_judge_prompt(tok, long_ctx, "a", "b")) < 3000  # context cut from the left


def test_judge_probability_is_one_forward_and_padding_safe(tiny):
    batch = [("ctx", "a short step", "another short step"),
             ("a much longer context " * 10, "a step with many more words in it than the other", "b")]
    both = judge_probability(tiny.model, tiny.tokenizer, batch)
    alone = torch.cat([judge_probability(tiny.model, tiny.tokenizer, [b]) for b in batch])
    assert both.shape == (2,) and ((both > 0) & (both < 1)).all()
    assert torch.allclose(both, alone, atol=1e-5)  # left padding + position ids do not change the answer
    logits = judge_answer_logits(tiny.model, tiny.tokenizer, batch[:1])  # the training entry point
    assert logits.shape == (1, 2) and logits.requires_grad
    assert torch.allclose(torch.softmax(logits.detach(), -1)[:, 0], both[:1], atol=1e-5)


def test_llm_judge_reuses_a_loaded_engine(tiny):
    v = build_verifier("llm_judge", llm_judge_engine=tiny, threshold=0.0)
    assert v.needs_target_step
    got = v.verify([VerifyItem(CTX, "6*7 = 42", "42")])[0]
    assert got.accepted and 0 < got.score < 1  # threshold 0 accepts everything it scores


def test_judge_lora_checkpoint_round_trip(tmp_path, tiny):
    from peft import LoraConfig, get_peft_model

    from specprobe.infer.models import load_model

    base, tok = load_model("random:llama-tiny", device="cpu")
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights=False))
    folder = tmp_path / "judge_lora"
    peft_model.save_pretrained(folder)
    yes, no = answer_token_ids(tok)
    meta = {"base_model": "random:llama-tiny", "prompt_version": PROMPT_VERSION, "threshold": 0.4,
            "answer_tokens": {"yes": yes, "no": no}}
    (folder / "judge.json").write_text(json.dumps(meta))
    v = load_verifier(tmp_path, "judge")
    assert v.threshold == 0.4 and v.name == "judge"
    batch = [("ctx", "6*7 = 42", "42")]
    expected = judge_probability(peft_model, tok, batch)
    assert v.verify([VerifyItem(StepContext("ctx"), "42", "6*7 = 42")])[0].score == pytest.approx(float(expected[0]), abs=1e-5)
    (folder / "judge.json").write_text(json.dumps({**meta, "prompt_version": PROMPT_VERSION + 1}))
    with pytest.raises(CheckpointError, match="prompt version"):
        load_verifier(tmp_path, "judge")
    (folder / "judge.json").write_text(json.dumps({**meta, "answer_tokens": {"yes": 1, "no": 2}}))
    with pytest.raises(CheckpointError, match="answer tokens"):
        load_verifier(tmp_path, "judge")
    # trained on a base at a local path this machine lacks: runtime.checkpoint_judge_base names where it is
    (folder / "judge.json").write_text(json.dumps({**meta, "base_model": str(tmp_path / "gone" / "base")}))
    with pytest.raises(Exception, match="gone"):
        load_verifier(tmp_path, "judge")
    moved = build_verifier("judge", checkpoint=tmp_path, judge_base="random:llama-tiny",
                           embedding_model="offline:nope")  # (the embedder's override is not the judge's)
    assert moved.verify([VerifyItem(StepContext("ctx"), "42", "6*7 = 42")])[0].score == pytest.approx(
        float(expected[0]), abs=1e-5)
    (folder / "judge.json").write_text(json.dumps({**meta, "format": "specprobe.judge_lora", "format_version": 2}))
    with pytest.raises(CheckpointError, match="judge.json: field 'format_version' is 2"):
        load_verifier(tmp_path, "judge")
