"""models.merged_linear: the linear layers that read one input run as one product (`infer.engines.merged_linear`).

A merged model must compute what it computed (same logits, same decoded tokens on every decode path), keep its
modules and checkpoint keys, run fewer products (counted in the compiled graph), give a member called on another
input that input's product, leave training untouched, refuse a forward that breaks its assumption, undo cleanly,
and reach the engines a config builds."""
from __future__ import annotations

import copy
import pickle
import types

import pytest
import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

from specprobe.infer.config import ModelsConfig
from specprobe.infer.engines import HFStepEngine, Prefix, StepRequest, build_engine_pair, merged_linear
from specprobe.infer.engines.base import SamplingParams
from specprobe.infer.engines.fused_norm import setting_of
from specprobe.infer.engines.merged_linear import merged_linear_count, set_merged_linear, wants_merged_linear
from specprobe.inputs.config import ConfigError
from specprobe.train.config import load_config

from _margins import TIE_TOL, margins


def _qwen2(layers: int = 2) -> Qwen2ForCausalLM:
    """Grouped-query attention with q/k/v biases (two key-value heads for four query heads) and a gated MLP."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    with torch.no_grad():  # biases away from their init of zeros, so a bias sliced wrong shows
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape))
    return model


def _ids(model, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))


def test_a_merged_model_gives_its_logits_keeps_its_keys_and_undoes():
    model = _qwen2()
    ids = _ids(model)
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.inference_mode():
        want = model(input_ids=ids).logits
    assert set_merged_linear(model, True) == {"merged": 4, "kept": 0} and merged_linear_count(model) == 4
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.data_ptr() == attn._merged_q_k_v.data_ptr() + 64 * 64 * 4  # a view, after q's rows
    state = model.state_dict()
    assert state.keys() == keys.keys() and all(torch.equal(state[k], keys[k]) for k in keys)
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        assert attn.q_proj._merged_group.kept().outputs is None  # every member took its part: no activation kept
    assert set_merged_linear(model, True) == {"merged": 4, "kept": 0}  # an engine on shared weights: unchanged
    assert set_merged_linear(model, False) == {"merged": 0, "kept": 0} and merged_linear_count(model) == 0
    assert not any(name.startswith("_merged") for name, _ in attn.named_buffers())
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)


def test_members_return_their_own_columns_for_any_input_and_call_order():
    model = _qwen2(1)
    attn = model.model.layers[0].self_attn
    names = ("q_proj", "k_proj", "v_proj")
    own = {n: (getattr(attn, n).weight.clone(), getattr(attn, n).bias.clone()) for n in names}
    set_merged_linear(model, True)
    x, y = torch.randn(3, 64), torch.randn(3, 64)
    with torch.inference_mode():
        # v before q, a second input in between, a member twice: each call is its own input's product
        calls = [("v_proj", x), ("q_proj", y), ("q_proj", x), ("k_proj", x), ("v_proj", y), ("k_proj", y)]
        for name, inp in calls:
            w, b = own[name]
            torch.testing.assert_close(getattr(attn, name)(inp), inp @ w.T + b, rtol=1e-6, atol=1e-6)
    x = torch.randn(3, 64)  # outside inference mode the version counter is checked: an in-place write is seen
    attn.q_proj(x)
    x.mul_(2)
    torch.testing.assert_close(attn.k_proj(x), x @ own["k_proj"][0].T + own["k_proj"][1], rtol=1e-6, atol=1e-6)


def test_the_compiled_graph_runs_one_product_per_group():
    """What merging is for: 4 products a layer where there were 7 (q, k, v, o, gate, up, down), plus the head."""
    def products(model) -> int:
        found = []

        def backend(gm, example_inputs):
            found.extend(n for n in gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target))
            return gm.forward
        torch._dynamo.reset()
        with torch.inference_mode():
            torch.compile(model, backend=backend, fullgraph=True)(input_ids=_ids(model))
        return len(found)

    model = _qwen2()
    assert products(model) == 2 * 7 + 1
    set_merged_linear(model, True)
    assert products(model) == 2 * 4 + 1


def test_training_through_a_merged_model_reaches_every_weight():
    model = _qwen2(1)
    set_merged_linear(model, True)
    for p in model.parameters():
        p.requires_grad_(True)
    model.train()
    model(input_ids=_ids(model), labels=_ids(model)).loss.backward()
    attn = model.model.layers[0].self_attn
    for layer in (attn.q_proj, attn.k_proj, attn.v_proj, model.model.layers[0].mlp.up_proj):
        assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


def test_members_fed_other_inputs_stay_exact_and_an_input_written_in_place_is_refused(caplog):
    """A layer that runs its key projection on another tensor gets that tensor's product (merged, and exact). A
    layer that writes its input in place between its members' calls, in inference mode (no version counter there),
    would get the columns of the old values: the check sees a member's columns differ from its own product and
    refuses the merge."""
    model = _qwen2(1)
    attn = model.model.layers[0].self_attn
    original = type(attn).forward

    def scaled_keys(self, hidden_states, *args, **kwargs):
        self.q_proj(hidden_states)
        self.seen = self.k_proj(hidden_states * 2)  # another tensor
        return original(self, hidden_states, *args, **kwargs)

    attn.forward = types.MethodType(scaled_keys, attn)
    ids = _ids(model)
    with torch.inference_mode():
        want, want_seen = model(input_ids=ids).logits, attn.seen
    assert set_merged_linear(model, True)["merged"] == 2
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(attn.seen, want_seen, rtol=1e-5, atol=1e-5)
    set_merged_linear(model, False)

    def written_in_place(self, hidden_states, *args, **kwargs):
        self.q_proj(hidden_states)
        hidden_states.mul_(2)  # the same object, other values
        return original(self, hidden_states, *args, **kwargs)

    attn.forward = types.MethodType(written_in_place, attn)
    with torch.inference_mode():
        want = model(input_ids=ids).logits
    assert set_merged_linear(model, True) == {"merged": 0, "kept": 2} and merged_linear_count(model) == 0
    assert "differ from its own product by" in caplog.text
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)


def test_layers_it_cannot_merge_keep_their_own_forward():
    model = _qwen2(1)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    hook = types.MethodType(lambda self, x: nn.Linear.forward(self, x), attn.k_proj)
    attn.k_proj.forward = hook  # an instance-level forward of someone else's (a device-map hook)

    class Lora(nn.Linear):  # not a plain nn.Linear (PEFT's LoRA layer, a quantised layer)
        pass

    lora = Lora(64, 96, bias=False)
    lora.load_state_dict(mlp.up_proj.state_dict())
    mlp.up_proj = lora
    assert set_merged_linear(model, True) == {"merged": 0, "kept": 0} and merged_linear_count(model) == 0
    assert vars(attn.k_proj)["forward"] is hook


def test_a_model_whose_check_cannot_run_is_left_alone():
    class Wrapped(nn.Module):  # a forward that does not take input_ids
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)

        def forward(self, x):
            return self.q_proj(x)

    model = Wrapped()
    assert set_merged_linear(model, True) == {"merged": 0, "kept": 1} and merged_linear_count(model) == 0
    assert "forward" not in vars(model.q_proj) and not list(model.buffers())


@pytest.mark.parametrize("graph", ["none", "compile"])
def test_the_fast_path_decodes_and_scores_as_before_when_merged(one_thread, graph):
    """The same greedy steps, seeded samples and teacher-forced log-probabilities on the eager path and on the fast
    path's decode step (eager on static buffers, and compiled), merged or not. (A seeded sample could differ only
    where its uniform draw falls within rounding of a boundary of the cumulative distribution.)"""
    base = HFStepEngine("random:llama-tiny", device="cpu", decode="eager")
    prefixes = [Prefix("What is 3 + 4?"), Prefix("What is 3 + 4?", ("First add.",))]
    greedy, sampled = SamplingParams(temperature=0.0, max_step_tokens=10), SamplingParams(max_step_tokens=10, seed=3)

    def run(engine):
        engine.clear_prefix_cache()
        out = engine.generate([StepRequest(p, 2) for p in prefixes], greedy).steps
        for prefix, row in zip(prefixes, out):  # no near-tie: equal greedy steps below are not float luck
            assert min(margins(base.model, base.prefix_ids(prefix), row[0].token_ids)) > TIE_TOL
        steps = [[s.text for s in row] for row in out]
        samples = [[s.text for s in row] for row in engine.generate([StepRequest(p, 3) for p in prefixes], sampled).steps]
        scores = engine.score(prefixes[1], ["It is seven.", "Add them: 7"])
        return steps, samples, [s.token_logprobs for s in scores.steps]

    plain = run(HFStepEngine("random:llama-tiny", model=base.model, tokenizer=base.tokenizer, decode="fast",
                             decode_graph=graph, merged_linear=False))
    merged_engine = HFStepEngine("random:llama-tiny", model=base.model, tokenizer=base.tokenizer, decode="fast",
                                 decode_graph=graph, merged_linear=True)
    assert merged_engine.merged_linears == 4 == merged_linear_count(base.model)  # 2 layers x (q/k/v, gate/up)
    merged = run(merged_engine)
    assert merged_engine.decode_step.failed is None  # compiled (or eager) through the merged members
    assert merged[:2] == plain[:2] and run(base)[0] == plain[0]
    for want, got in zip(plain[2], merged[2]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_models_merged_linear_reaches_both_engines_defaults_to_auto_and_is_refused_for_vllm_alone(one_thread):
    target, draft = build_engine_pair(ModelsConfig(device="cpu", target="random:llama-tiny",
                                                   draft="random:llama-20m", merged_linear=True))
    assert (target.merged_linears, draft.merged_linears) == (4, 8)  # llama-20m: 4 layers
    cfg = load_config("configs/tiny.yaml", [])
    assert cfg.models.merged_linear == "auto"
    assert load_config("configs/tiny.yaml", ["models.merged_linear=false"]).models.merged_linear is False
    with pytest.raises(ConfigError, match=r"models.merged_linear: .maybe. is not a bool or one of \[.auto.\]"):
        load_config("configs/tiny.yaml", ["models.merged_linear=maybe"])
    with pytest.raises(ConfigError, match="models.merged_linear merges the linear layers of transformers models"):
        load_config("configs/tiny.yaml", ["models.engine=vllm", "models.merged_linear=true"])
    assert HFStepEngine("random:llama-tiny", device="cpu", decode="fast").merged_linears == 0  # auto: off on the CPU


class _WeightsOn:
    def __init__(self, device: str):
        self.device = device

    def parameters(self):
        return iter([type("P", (), {"device": torch.device(self.device)})()])


def test_auto_merges_on_cuda_only_and_the_command_words_name_the_option():
    assert wants_merged_linear("auto", _WeightsOn("cuda:0")) and not wants_merged_linear("auto", _WeightsOn("cpu"))
    assert wants_merged_linear(True, _WeightsOn("cpu")) and not wants_merged_linear(False, _WeightsOn("cuda"))
    with pytest.raises(ValueError, match="merged_linear must be True, False or 'auto', got 'on'"):
        wants_merged_linear("on", _WeightsOn("cpu"))
    with pytest.raises(ValueError, match="merged linear: 'yes' is not one of"):
        setting_of("yes", "merged linear")


def test_each_thread_keeps_its_own_merged_product():
    """Async Lookahead Reasoning with one model as draft and target: two engines on the same weights run forwards
    from two threads at once (torch releases the GIL inside each product). A product one thread keeps for its next
    members is its own: another thread neither sees nor replaces it."""
    import threading

    model = _qwen2(1)
    set_merged_linear(model, True)
    attn = model.model.layers[0].self_attn
    group = attn.q_proj._merged_group
    x = torch.randn(2, 64)
    with torch.inference_mode():
        attn.q_proj(x)  # k and v still to take theirs
        seen = []

        def other():
            with torch.inference_mode():
                seen.append(group.kept().outputs is None)
                attn.q_proj(torch.randn(2, 64))  # this thread's own product, k and v pending here too

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert seen == [True] and group.kept().input is x
        w, b = attn.k_proj.weight, attn.k_proj.bias
        torch.testing.assert_close(attn.k_proj(x), x @ w.T + b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("dtype", "noise", "merged"), [(torch.bfloat16, 5e-3, True), (torch.bfloat16, 0.1, False),
                                                       (torch.float32, 5e-3, False), (torch.float32, 1e-6, True),
                                                       (torch.float32, float("nan"), False)])
def test_the_merge_is_checked_member_by_member_to_its_dtypes_rounding(monkeypatch, caplog, dtype, noise, merged):
    """The check compares each member's columns with its own product, so what it tolerates is one product's
    rounding in the weights' dtype (a bf16 ulp is 2**-8 of a value), not a tolerance on logits that a deep model's
    amplification of the same rounding can exceed (the random-weight 32B's did on an H100). Columns off by a
    relative `noise` stand in for another kernel's blocking."""
    model = _qwen2().to(dtype)
    exact = merged_linear._Group.output

    def off_by(self, index, x, kept):
        return exact(self, index, x, kept) * (1 + noise)

    monkeypatch.setattr(merged_linear._Group, "output", off_by)
    result = set_merged_linear(model, True)
    assert result == ({"merged": 4, "kept": 0} if merged else {"merged": 0, "kept": 4})
    assert merged_linear_count(model) == result["merged"]
    assert ("differ from its own product" in caplog.text) is not merged
    assert all(g[2][0]._merged_group.kept().audit is None for g in merged_linear._groups(model) if merged)


def test_a_merged_model_copies_and_pickles_and_its_copy_merges_again():
    """check_decode_graph.py's three-thread case deep-copies a merged model (an H100 run failed there on the
    thread-local product). A copy's weights are copies of the views, apart from its merged buffer: merging the copy
    again (an engine built on it does) makes them views again, with the same logits."""
    model = _qwen2()
    set_merged_linear(model, True)
    ids = _ids(model)
    with torch.inference_mode():
        want = model(input_ids=ids).logits
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        attn = twin.model.layers[0].self_attn
        assert attn.k_proj._merged_group.parent is attn  # the copy's group belongs to the copy
        assert attn.k_proj.weight.data_ptr() != attn._merged_q_k_v.data_ptr() + 64 * 64 * 4  # copied apart
        assert set_merged_linear(twin, True) == {"merged": 4, "kept": 0}
        assert attn.k_proj.weight.data_ptr() == attn._merged_q_k_v.data_ptr() + 64 * 64 * 4  # views again
        with torch.inference_mode():
            torch.testing.assert_close(twin(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)


def test_a_group_the_checks_forward_never_calls_is_not_merged(caplog):
    """A merge is kept only where the check saw it: a layer whose forward skips its projections on the check's
    input leaves its group unchecked, so that group keeps its own products."""
    model = _qwen2()
    mlp = model.model.layers[1].mlp
    mlp.forward = types.MethodType(lambda self, x: torch.zeros_like(x), mlp)  # gate/up/down never called
    with caplog.at_level("INFO"):
        assert set_merged_linear(model, True) == {"merged": 3, "kept": 1}
    assert merged_linear_count(model) == 3 and "1 not called by the check's forward" in caplog.text
    assert "forward" not in vars(mlp.gate_proj) and not hasattr(mlp, "_merged_gate_up")
