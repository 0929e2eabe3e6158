"""Step engines: one interface (`StepEngine`, see `infer.engines.base`), implemented with transformers
(`HFStepEngine`) and vLLM (`infer.engines.vllm_engine.VLLMStepEngine`, imported only when used)."""
from __future__ import annotations

from specprobe.infer.engines.base import (
    DEFAULT_STEP_DELIMITER,
    EngineInfo,
    EngineStats,
    Generation,
    Prefix,
    PromptTooLongError,
    SamplingParams,
    ScoredStep,
    Scoring,
    SerialStream,
    Step,
    StepEngine,
    StepRequest,
    StepStream,
)
from specprobe.infer.engines.hf import HFStepEngine
from specprobe.infer.engines.vllm_engine import VLLMSettings
from specprobe.infer.models import placed_device

__all__ = ["EngineInfo", "EngineStats", "Generation", "Prefix", "PromptTooLongError", "SamplingParams",
           "ScoredStep", "Scoring", "SerialStream", "Step", "StepEngine", "StepRequest", "StepStream",
           "HFStepEngine", "build_engine", "build_engine_pair", "sampling_params", "vllm_settings"]


def vllm_settings(models_cfg, seed: int = 0):
    """VLLMSettings from a ModelsConfig's `vllm` section."""

    v = models_cfg.vllm
    return VLLMSettings(max_model_len=v.max_model_len, tensor_parallel_size=v.tensor_parallel_size,
                        gpu_memory_utilization=v.gpu_memory_utilization, kv_cache_gib=v.kv_cache_gib,
                        enforce_eager=v.enforce_eager, block_size=v.block_size, enable_lora=v.enable_lora,
                        max_lora_rank=v.max_lora_rank, hidden_states=v.hidden_states, seed=seed,
                        chunked_prefill=v.chunked_prefill)


def build_engine(name: str, models_cfg, *, role: str = "target", token_spec=None, share=None,
                 stop_at_eos: bool = True) -> StepEngine:
    """An engine for `name` (the `role` model) on the engine kind, device, dtype, cache and template settings
    of a ModelsConfig. share: an engine of the same kind on the same model whose weights (transformers) or
    vLLM engine this one reuses. token_spec: token speculation fixed at start (vLLM engines only; the
    transformers engine takes it per call with `with_token_spec`)."""
    common = dict(device=models_cfg.resolved_device(role), dtype=models_cfg.dtype, cache_dir=models_cfg.cache_dir,
                  use_chat_template=models_cfg.use_chat_template, system_prompt=models_cfg.system_prompt,
                  stop_at_eos=stop_at_eos)
    if models_cfg.engine_of(role) == "vllm":
        from specprobe.infer.engines.vllm_engine import VLLMStepEngine

        return VLLMStepEngine(name, settings=vllm_settings(models_cfg), token_spec=token_spec, share=share, **common)
    if share is not None:
        common.update(model=share.model, tokenizer=share.tokenizer)
    return HFStepEngine(name, max_batch_rows=models_cfg.max_batch_rows, decode=models_cfg.decode,
                        decode_graph=models_cfg.decode_graph_of(role),
                        stream_priority=models_cfg.target_stream_priority if role == "target" else "normal",
                        fused_norm=models_cfg.fused_norm, merged_linear=models_cfg.merged_linear,
                        capture_joins=models_cfg.capture_joins, **common)


def build_engine_pair(models_cfg, names: tuple[str, str] | None = None, *, token_spec=None,
                      stop_at_eos: bool = True) -> tuple[StepEngine, StepEngine]:
    """(target, draft) for `names` (default: the config's target and draft); when both are the same model on
    the same engine kind and device, the weights (transformers) or the vLLM engine are loaded once and shared."""
    target_name, draft_name = names or (models_cfg.target, models_cfg.draft)
    target = build_engine(target_name, models_cfg, role="target", token_spec=token_spec, stop_at_eos=stop_at_eos)
    same = draft_name == target_name and models_cfg.engine_of("draft") == models_cfg.engine_of("target")
    if same and models_cfg.engine_of("draft") == "hf":  # (a vLLM draft has no draft_device)
        same = placed_device(models_cfg.resolved_device("target")) == placed_device(models_cfg.resolved_device("draft"))
    draft = build_engine(draft_name, models_cfg, role="draft", token_spec=token_spec, stop_at_eos=stop_at_eos,
                         share=target if same else None)
    return target, draft


def sampling_params(sampling_cfg, role: str = "target", delimiter: str = DEFAULT_STEP_DELIMITER, seed: int | None = None) -> SamplingParams:
    """SamplingParams for a role from a SamplingConfig (the draft may run at its own temperature)."""
    temperature = sampling_cfg.temperature
    if role == "draft" and sampling_cfg.draft_temperature is not None:
        temperature = sampling_cfg.draft_temperature
    return SamplingParams(temperature=temperature, top_p=sampling_cfg.top_p,
                          max_step_tokens=sampling_cfg.max_step_tokens, delimiter=delimiter,
                          seed=sampling_cfg.seed if seed is None else seed)
