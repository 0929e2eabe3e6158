"""Judge LoRA on the real SmolLM2-135M-Instruct: the loss falls in a few steps, the adapter reloads (ours and
the runtime's loader) with the same probabilities, and training reads the answer exactly as the runtime."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specprobe.infer.models import load_model
from specprobe.probes.io import load_tensors
from specprobe.train.config import VerifiersConfig
from specprobe.train.pair_verifiers import PairSet, balanced_pairs, train_judge

SMOL = "offline:smollm2-135m-instruct"
pytestmark = pytest.mark.slow

CONTEXT = "Tom has 3 red and 4 blue marbles. How many marbles does he have?"
PAIRS = [  # (a, b, equivalent)
    ("3 + 4 = 7 marbles.", "He has 7 marbles in total.", True),
    ("Adding 3 and 4 gives 7.", "3 + 4 = 7.", True),
    ("So Tom has 7 marbles.", "The total is 7 marbles.", True),
    ("We add: 3 + 4 = 7.", "Tom owns 7 marbles.", True),
    ("3 + 4 = 7 marbles.", "3 * 4 = 12 marbles.", False),
    ("He has 7 marbles.", "He has 1 marble more blue than red.", False),
    ("The total is 7.", "The total is 9.", False),
    ("Adding gives 7.", "Subtracting gives 1.", False),
]


def pair_set(rows) -> PairSet:
    n = len(rows)
    return PairSet(np.array(["c0"] * n, dtype=object), np.array(["q0"] * n, dtype=object),
                   np.array([r[0] for r in rows], dtype=object), np.array([r[1] for r in rows], dtype=object),
                   np.array([r[2] for r in rows]), np.array(["cluster"] * n, dtype=object), {"c0": CONTEXT})


VCFG = VerifiersConfig(judge_base=SMOL, judge_lora_r=4, judge_lora_alpha=8, judge_lora_layers=2, judge_steps=6,
                       judge_batch_size=4, judge_lr=5e-3, judge_eval_pairs=6, target_precision=0.5)


@pytest.fixture(scope="module", autouse=True)
def threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    pairs = pair_set(PAIRS)
    result = train_judge(pairs, pairs, VCFG, device="cpu", model=load_model(SMOL, device="cpu", dtype="float32"))
    folder = tmp_path_factory.mktemp("ckpt")
    result.save(folder / "judge_lora")
    return result, folder


def test_fit_on_pairs_needs_ten_of_each_class():
    from specprobe.train.pair_verifiers import fit_on_pairs

    scores = np.r_[np.linspace(0.6, 1.0, 12), np.linspace(0.0, 0.5, 12)]
    labels = np.r_[np.ones(12, bool), np.zeros(12, bool)]
    fitted = fit_on_pairs(scores, labels, 0.9, "validation pairs")
    assert fitted.error is None and fitted.fit.met_target and fitted.fit.threshold == pytest.approx(0.6)
    assert fitted.to_dict()["fit_on"] == "validation pairs" and fitted.to_dict()["n_positive"] == 12
    short = fit_on_pairs(scores[3:], labels[3:], 0.9, "validation pairs")
    assert short.fit is None and "9 equivalent and 12 non-equivalent" in short.error


def test_balanced_pairs_are_balanced_and_keep_labels():
    rows = PAIRS + [("a", "b", False)] * 6
    items, labels = balanced_pairs(pair_set(rows), max_pairs=100, seed=3)
    assert labels.sum() == len(labels) - labels.sum() == 4
    truth = {(a, b): eq for a, b, eq in rows} | {(b, a): eq for a, b, eq in rows}
    assert all(truth[(a, b)] == bool(y) for (_, a, b), y in zip(items, labels))


def test_last_position_readout_equals_the_full_logits():
    """judge_answer_logits (training and runtime) runs the LM head on the last position only; the numbers
    equal reading the [yes, no] logits off the full (B, T, vocab) output."""
    from specprobe.infer.judge_prompt import answer_token_ids, encode_judge_batch, judge_answer_logits

    model, tok = load_model(SMOL, device="cpu", dtype="float32")
    batch = [(CONTEXT, a, b) for a, b, _ in PAIRS[:3]]
    yes, no = answer_token_ids(tok)
    with torch.no_grad():
        full = model(**encode_judge_batch(tok, batch, "cpu"), use_cache=False).logits[:, -1, [yes, no]].float()
        torch.testing.assert_close(judge_answer_logits(model, tok, batch), full, rtol=1e-4, atol=1e-4)


def test_loss_falls(trained):
    result, _ = trained
    losses = result.losses
    assert len(losses) == VCFG.judge_steps and all(np.isfinite(losses))
    assert np.mean(losses[-2:]) < 0.6 * np.mean(losses[:2])
    assert set(result.metrics["val"]) == {"verifier", "base", "accept_all"}


def test_threshold_is_fitted_on_validation_pairs_or_says_why_not(trained):
    result, folder = trained
    # 6 validation pairs (judge_eval_pairs) hold 3 equivalent ones: too few to fit, so the default 0.5 is
    # kept and the checkpoint says why
    assert result.fit is None and result.threshold == 0.5
    assert "validation pairs (the LoRA did not train on them)" in result.fitted.error
    assert "fitting needs at least 10 of each" in result.fitted.error
    assert result.metrics["threshold_fit"]["fit_error"] == result.fitted.error
    import json

    meta = json.loads((folder / "judge_lora" / "judge.json").read_text())
    assert meta["fit"] is None and meta["fit_error"] == result.fitted.error


def test_adapter_reloads_with_identical_probabilities(trained):
    from specprobe.infer.judge_prompt import judge_probability
    from specprobe.infer.verifiers import StepContext, VerifyItem, load_verifier

    result, folder = trained
    files = {p.name for p in (folder / "judge_lora").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "judge.json"} <= files
    # the adapter names its base by hub id, not the local cache folder it was loaded from
    adapter = json.loads((folder / "judge_lora" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    card = folder / "judge_lora" / "README.md"
    assert not card.exists() or ".cache" not in card.read_text()
    items = [(CONTEXT, a, b) for a, b, _ in PAIRS]
    want = judge_probability(result.model, result.tokenizer, items)
    runtime = load_verifier(folder, kind="judge", device="cpu")
    assert runtime.threshold == pytest.approx(result.threshold) and runtime.model_id.startswith(SMOL)
    torch.testing.assert_close(judge_probability(runtime.model, runtime.tokenizer, items), want, rtol=0, atol=1e-5)
    verdicts = runtime.verify([VerifyItem(StepContext(CONTEXT), draft=b, target=a) for a, b, _ in PAIRS])
    np.testing.assert_allclose([v.score for v in verdicts], want.numpy(), atol=1e-5)


def test_the_base_loads_in_the_dtype_its_threshold_was_fitted_in(trained, tmp_path):
    """judge.json records the base's dtype; the runtime loads the base in it, not in the device's default (a
    threshold fitted on fp32 probabilities is not applied to bf16 ones), and refuses a dtype it cannot read."""
    import shutil

    from specprobe.infer.checkpoint_format import CheckpointError
    from specprobe.infer.verifiers import load_judge_lora

    _, folder = trained
    assert json.loads((folder / "judge_lora" / "judge.json").read_text())["dtype"] == "float32"
    copy = tmp_path / "judge_lora"
    shutil.copytree(folder / "judge_lora", copy)
    meta = json.loads((copy / "judge.json").read_text())
    (copy / "judge.json").write_text(json.dumps({**meta, "dtype": "bfloat16"}))
    assert next(load_judge_lora(copy, device="cpu").model.parameters()).dtype == torch.bfloat16
    (copy / "judge.json").write_text(json.dumps({**meta, "dtype": "bf-16"}))
    with pytest.raises(CheckpointError, match="'dtype' must be one of"):
        load_judge_lora(copy, device="cpu")


def test_a_stopped_training_continues_from_its_saved_state(tmp_path, monkeypatch):
    """Stopped in its fifth step with a state saved every two, the same training run again continues after step
    4 and ends with the uninterrupted run's losses, adapter and scores (LoRA dropout on: torch's RNG is part of the
    state); the base is not scored again. Other settings start from step 0 and say why."""
    from dataclasses import replace

    from specprobe.infer import judge_prompt
    from specprobe.train import pair_verifiers

    pairs, vcfg = pair_set(PAIRS), replace(VCFG, judge_save_every=2, judge_lora_dropout=0.2)
    fresh = lambda: load_model(SMOL, device="cpu", dtype="float32")  # noqa: E731 (LoRA goes into the model)
    whole = train_judge(pairs, pairs, vcfg, device="cpu", model=fresh())

    real, calls, lines = pair_verifiers.judge_answer_logits, [], []

    def stop_in_fifth_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(pair_verifiers, "judge_answer_logits", stop_in_fifth_step)
        with pytest.raises(KeyboardInterrupt):
            train_judge(pairs, pairs, vcfg, device="cpu", model=fresh(), state_dir=tmp_path, message=lines.append)
    assert lines == [f"judge LoRA: its state after step 4 of 6 is in {tmp_path}; the same command continues from there"]
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["step"] == 4 and [p.name for p in tmp_path.glob("step-*")] == ["step-0000004.safetensors"]
    assert load_tensors(tmp_path / state["file"])["loop.losses"].tolist() == pytest.approx(whole.losses[:4], rel=1e-6)

    def stop_at_once(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:  # stopped again before it saved: the state it continues is still named
        patch.setattr(pair_verifiers, "judge_answer_logits", stop_at_once)
        with pytest.raises(KeyboardInterrupt):
            train_judge(pairs, pairs, vcfg, device="cpu", model=fresh(), state_dir=tmp_path, message=lines.append)
    assert lines[-2:] == [lines[-2], f"judge LoRA: its state after step 4 of 6 is in {tmp_path}; the same command "
                                     "continues from there"] and "resuming after step 4" in lines[-2]

    scored = []
    monkeypatch.setattr(pair_verifiers, "judge_probability",
                        lambda *a, **k: scored.append(len(a[2])) or judge_prompt.judge_probability(*a, **k))
    curve = []
    resumed = train_judge(pairs, pairs, vcfg, device="cpu", model=fresh(), state_dir=tmp_path, message=lines.append,
                          log_fn=curve.append)
    assert lines[-1].startswith(f"judge LoRA: resuming after step 4 of 6 from {tmp_path}")
    assert [c["step"] for c in curve] == list(range(6))  # the logged curve has the earlier run's steps too
    assert len(scored) == 1  # the LoRA's validation pairs only (test pairs not given): the base's came from the state
    np.testing.assert_allclose(resumed.losses, whole.losses, rtol=1e-5)
    assert resumed.metrics["resumed"]["after_step"] == 4 and "resumed" not in whole.metrics
    ours = dict(resumed.model.named_parameters())
    for name, param in whole.model.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(ours[name], param, rtol=1e-5, atol=1e-6)
    assert resumed.metrics["val"]["base"] == whole.metrics["val"]["base"]
    assert json.loads((tmp_path / "state.json").read_text())["step"] == 6

    scored.clear()  # fewer pairs scored after training: the steps stand, only the base is scored again
    fewer = train_judge(pairs, pairs, replace(vcfg, judge_eval_pairs=4), device="cpu", model=fresh(),
                        state_dir=tmp_path, message=lines.append)
    assert lines[-1].startswith(f"judge LoRA: resuming after step 6 of 6 from {tmp_path}")
    assert scored == [4, 4]  # the base's and the LoRA's, on the 4 pairs now asked for (6 before)
    np.testing.assert_allclose(fewer.losses, whole.losses, rtol=1e-5)

    other = train_judge(pairs, pairs, replace(vcfg, judge_lr=1e-3), device="cpu", model=fresh(), state_dir=tmp_path,
                        message=lines.append)
    assert "other pairs or settings (settings.judge_lr: 0.005 -> 0.001)" in lines[-1]
    assert len(other.losses) == 6 and other.losses[0] == pytest.approx(whole.losses[0], rel=1e-5)


def test_a_training_state_round_trips_and_is_refused_where_it_would_not_continue_the_same_run(tmp_path):
    """On a small module (no language model): weights, AdamW moments, RNGs, order and losses come back as saved, a
    NaN loss included (JSON would refuse it); other settings, a device, fewer steps or a damaged file are refused,
    each saying why."""
    from dataclasses import replace

    from specprobe.train.judge_steps import JudgeSteps, LoopState, eval_digests, run_key

    def trained(seed):
        torch.manual_seed(seed)
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        return model, opt

    items, labels = [("c", "a", "b")] * 4, np.array([True, False, True, False])
    key = run_key(VCFG, "float32", "cpu", items, labels)
    scored_on = eval_digests({"val": (items[:2], labels[:2])})
    model, opt = trained(0)
    loop = LoopState.fresh(4, seed=0)
    loop.next_batch(3)
    loop.step, loop.losses = 1, [float("nan")]
    steps = JudgeSteps(tmp_path, 1, key, scored_on)
    steps.base_probs = {"val": np.array([0.25, 0.75])}
    torch.manual_seed(7)
    steps.save(model, opt, loop, 2.0)
    after_save = torch.rand(3)

    earlier, note = JudgeSteps(tmp_path, 1, key).earlier(steps=5)
    assert note.startswith(f"judge LoRA: resuming after step 1 of 5 from {tmp_path}")
    other, other_opt = trained(1)
    back = JudgeSteps.restore(earlier, other, other_opt)
    torch.testing.assert_close(other.weight, model.weight, rtol=0, atol=0)
    for a, b in zip(other_opt.state_dict()["state"].values(), opt.state_dict()["state"].values()):
        torch.testing.assert_close(a["exp_avg_sq"], b["exp_avg_sq"], rtol=0, atol=0)
    torch.testing.assert_close(torch.rand(3), after_save, rtol=0, atol=0)  # torch's generator as it was saved
    assert (back.step, back.pos, back.order.tolist(), back.seconds) == (1, 3, loop.order.tolist(), 2.0)
    assert np.isnan(back.losses[0]) and back.rng.permutation(4).tolist() == loop.rng.permutation(4).tolist()
    assert earlier.base_probs_for(scored_on)["val"].tolist() == [0.25, 0.75]
    assert earlier.base_probs_for(eval_digests({"val": (items[:3], labels[:3])})) is None  # other pairs: score again
    # a state written while judge_eval_pairs and the eval pairs were in the key continues, its base scores kept
    state_path = tmp_path / "state.json"
    current = json.loads(state_path.read_text())
    legacy = dict(current, key={**key, "settings": {**key["settings"], "judge_eval_pairs": 400},
                                "eval_pairs_sha256": scored_on})
    del legacy["eval_pairs_sha256"]
    state_path.write_text(json.dumps(legacy))
    old, note = JudgeSteps(tmp_path, 1, key, scored_on).earlier(steps=5)
    assert note.startswith("judge LoRA: resuming after step 1") and old.base_probs_for(scored_on)["val"].tolist() == \
        [0.25, 0.75]
    state_path.write_text(json.dumps(current))

    assert run_key(replace(VCFG, judge_eval_pairs=7, judge_save_every=9), "float32", "cpu", items, labels) == key
    for other_key, why in ((run_key(replace(VCFG, judge_lr=1.0), "float32", "cpu", items, labels),
                            "settings.judge_lr: 0.005 -> 1.0"),
                           (run_key(VCFG, "float32", "cuda", items, labels), "settings.device: 'cpu' -> 'cuda'"),
                           (run_key(VCFG, "float32", "cpu", items[:3], labels[:3]), "train_pairs_sha256")):
        none, note = JudgeSteps(tmp_path, 1, other_key).earlier(steps=5)
        assert none is None and why in note and "training from step 0" in note
    assert "more than verifiers.judge_steps=0" in JudgeSteps(tmp_path, 1, key).earlier(steps=0)[1]
    (tmp_path / "step-0000001.safetensors").write_bytes(b"cut short")
    none, note = JudgeSteps(tmp_path, 1, key).earlier(steps=5)
    assert none is None and "cannot be read" in note
