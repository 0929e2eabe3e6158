"""models.fused_norm: RMSNorm layers swapped to torch's fused rms_norm (`infer.engines.fused_norm`).

The swap must compute what each layer computed (its weight, its eps, over its own last dimension), leave alone a
norm of another formula (Gemma's 1 + weight), undo cleanly, and reach the engines a config builds."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from specprobe.infer.config import ModelsConfig
from specprobe.infer.engines import HFStepEngine, Prefix, build_engine_pair
from specprobe.infer.engines.fused_norm import fused_norm_count, set_fused_norms, setting_of, wants_fused_norms
from specprobe.infer.models import load_model
from specprobe.inputs.config import ConfigError
from specprobe.train.config import load_config


def _randomise_norms(model, seed: int = 0) -> None:
    """Norm weights away from their init of ones, so a swap that drops the weight shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))


def test_a_swapped_norm_computes_its_own_weight_eps_and_dimension():
    norm = LlamaRMSNorm(16, eps=1e-2)  # a large eps, against inputs of its size: a wrong eps shows
    _randomise_norms(norm)
    x = 0.05 * torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1))
    want = norm(x)
    assert set_fused_norms(norm, True) == {"fused": 1, "kept": 0} and fused_norm_count(norm) == 1
    assert "forward" in vars(norm)
    torch.testing.assert_close(norm(x), want, rtol=1e-6, atol=1e-6)
    assert set_fused_norms(norm, False) == {"fused": 0, "kept": 0} and "forward" not in vars(norm)
    assert torch.equal(norm(x), want)


def test_a_norm_of_another_formula_keeps_its_forward():
    """Gemma scales by (1 + weight): the fused kernel would compute something else, so the check refuses it."""
    model = torch.nn.Sequential(GemmaRMSNorm(16), LlamaRMSNorm(16))
    assert set_fused_norms(model, True) == {"fused": 1, "kept": 1}
    assert "forward" not in vars(model[0]) and "forward" in vars(model[1])


def test_a_float32_norm_in_a_bf16_model_keeps_its_forward():
    """transformers returns float32 from a float32 norm fed bf16 activations; the fused kernel would not."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 16).to(torch.bfloat16), LlamaRMSNorm(16))
    assert set_fused_norms(model, True) == {"fused": 0, "kept": 1} and fused_norm_count(model) == 0


def test_only_its_own_swap_is_undone_or_counted():
    """A forward set on the instance by someone else (a device-map hook, a kernel library) is left alone."""
    norm = LlamaRMSNorm(16)
    other = norm.forward
    hook = norm.forward = lambda x: other(x)
    assert fused_norm_count(norm) == 0
    set_fused_norms(norm, False)
    assert set_fused_norms(norm, True) == {"fused": 0, "kept": 1}
    assert vars(norm)["forward"] is hook and fused_norm_count(norm) == 0


def test_bf16_norms_pass_the_check():
    """In bf16 the fused kernel rounds once where transformers rounds twice: within the check's tolerance."""
    norm = LlamaRMSNorm(256).to(torch.bfloat16)
    _randomise_norms(norm)
    assert set_fused_norms(norm, True)["fused"] == 1


@pytest.mark.parametrize("which", ["llama", "qwen3"])
def test_a_fused_model_gives_the_same_logits_and_undoes(which):
    """Every norm of a model is swapped (Qwen3's per-head q/k norms too: four a layer and the final one) and the
    logits stay those of the model's own norms; switching off restores them exactly."""
    if which == "llama":
        model, _ = load_model("random:llama-tiny", device="cpu", dtype="float32")
        per_layer = 2
    else:
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=16)).eval()
        per_layer = 4
    _randomise_norms(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want = model(input_ids=ids).logits
        swapped = set_fused_norms(model, True)
        got = model(input_ids=ids).logits
        assert swapped == {"fused": per_layer * model.config.num_hidden_layers + 1, "kept": 0}
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        set_fused_norms(model, False)
        assert fused_norm_count(model) == 0 and torch.equal(model(input_ids=ids).logits, want)


def test_the_engine_fuses_when_asked_and_scores_as_before(one_thread):
    """HFStepEngine(fused_norm=...) sets the swap on its weights (every engine sharing them sees it); teacher-forced
    log-probabilities do not move."""
    plain = HFStepEngine("random:llama-tiny", device="cpu", decode="fast")
    _randomise_norms(plain.model)
    prefix = Prefix("What is 3 + 4?")
    want = plain.score(prefix, ["It is seven.", "Add them: 7"])
    fused = HFStepEngine("random:llama-tiny", model=plain.model, tokenizer=plain.tokenizer, decode="fast",
                         fused_norm=True)
    assert fused.fused_norms == 5 == fused_norm_count(plain.model)  # 2 layers x 2 + the final norm
    fused.clear_prefix_cache()
    got = fused.score(prefix, ["It is seven.", "Add them: 7"])
    for w, g in zip(want.steps, got.steps):
        torch.testing.assert_close(g.token_logprobs, w.token_logprobs, rtol=1e-5, atol=1e-5)
    HFStepEngine("random:llama-tiny", model=plain.model, tokenizer=plain.tokenizer, decode="fast")
    assert fused_norm_count(plain.model) == 0  # the newest engine's setting holds for the shared weights


def test_models_fused_norm_reaches_both_engines_and_is_refused_for_vllm_alone():
    target, draft = build_engine_pair(ModelsConfig(device="cpu", target="random:llama-tiny",
                                                   draft="random:llama-20m", fused_norm=True))
    assert (target.fused_norms, draft.fused_norms) == (5, 9)
    with pytest.raises(ConfigError, match="models.fused_norm swaps the norms of transformers models"):
        load_config("configs/tiny.yaml", ["models.engine=vllm", "models.fused_norm=true"])
    assert load_config("configs/tiny.yaml", ["models.engine=vllm", "models.draft_engine=hf",
                                             "models.fused_norm=true"]).models.fused_norm


class _WeightsOn:
    """A stand-in for a model whose first parameter sits on `device` (no CUDA here to put one there)."""

    def __init__(self, device: str | None):
        self.device = device

    def parameters(self):
        return iter([] if self.device is None else [type("P", (), {"device": torch.device(self.device)})()])


def test_auto_fuses_on_cuda_only_and_an_explicit_setting_wins():
    assert wants_fused_norms("auto", _WeightsOn("cuda:1")) and wants_fused_norms("auto", _WeightsOn("cuda"))
    assert not wants_fused_norms("auto", _WeightsOn("cpu")) and not wants_fused_norms("auto", _WeightsOn(None))
    assert wants_fused_norms(True, _WeightsOn("cpu")) and not wants_fused_norms(False, _WeightsOn("cuda"))
    with pytest.raises(ValueError, match="fused_norm must be True, False or 'auto', got 'on'"):
        wants_fused_norms("on", _WeightsOn("cpu"))
    # the command lines' words (bench_engine.py, profile_decode.py)
    assert (setting_of("auto"), setting_of("on"), setting_of("off")) == ("auto", True, False)
    with pytest.raises(ValueError, match="'yes' is not one of"):
        setting_of("yes")


def test_the_default_is_auto_and_leaves_a_cpu_engine_unfused(one_thread):
    cfg = load_config("configs/tiny.yaml", [])
    assert cfg.models.fused_norm == "auto"
    assert load_config("configs/tiny.yaml", ["models.fused_norm=false"]).models.fused_norm is False
    with pytest.raises(ConfigError, match=r"models.fused_norm: .maybe. is not a bool or one of \[.auto.\]"):
        load_config("configs/tiny.yaml", ["models.fused_norm=maybe"])
    assert load_config("configs/tiny.yaml", ["models.engine=vllm", "models.fused_norm=auto"]).models.fused_norm == "auto"
    engine = HFStepEngine("random:llama-tiny", device="cpu", decode="fast")
    assert engine.fused_norms == 0
