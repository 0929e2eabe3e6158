"""Step engines: one interface (`StepEngine`, see `infer.engines.base`), implemented with transformers."""
from __future__ import annotations

from infer.engines.base import (EngineInfo, EngineStats, Generation, Prefix, PromptTooLongError, SamplingParams,
                                ScoredStep, Scoring, SerialStream, Step, StepEngine, StepRequest, StepStream)
from infer.engines.hf import HFStepEngine

__all__ = ["EngineInfo", "EngineStats", "Generation", "Prefix", "PromptTooLongError", "SamplingParams",
           "ScoredStep", "Scoring", "SerialStream", "Step", "StepEngine", "StepRequest", "StepStream",
           "HFStepEngine", "build_engine", "build_engine_pair", "sampling_params"]


def build_engine(name: str, models_cfg, **kw) -> HFStepEngine:
    """An engine for `name` with the device, dtype, cache and template settings of a ModelsConfig."""
    return HFStepEngine(
        name, device=models_cfg.resolved_device(), dtype=models_cfg.dtype, cache_dir=models_cfg.cache_dir,
        use_chat_template=models_cfg.use_chat_template, system_prompt=models_cfg.system_prompt,
        max_batch_rows=models_cfg.max_batch_rows, **kw)


def build_engine_pair(models_cfg) -> tuple[HFStepEngine, HFStepEngine]:
    """(target, draft); when both name the same model its weights are loaded once and shared."""
    target = build_engine(models_cfg.target, models_cfg)
    if models_cfg.draft == models_cfg.target:
        draft = build_engine(models_cfg.draft, models_cfg, model=target.model, tokenizer=target.tokenizer)
    else:
        draft = build_engine(models_cfg.draft, models_cfg)
    return target, draft


def sampling_params(sampling_cfg, role: str = "target", delimiter: str = "\n\n", seed: int | None = None) -> SamplingParams:
    """SamplingParams for a role from a SamplingConfig (the draft may run at its own temperature)."""
    temperature = sampling_cfg.temperature
    if role == "draft" and sampling_cfg.draft_temperature is not None:
        temperature = sampling_cfg.draft_temperature
    return SamplingParams(temperature=temperature, top_p=sampling_cfg.top_p,
                          max_step_tokens=sampling_cfg.max_step_tokens, delimiter=delimiter,
                          seed=sampling_cfg.seed if seed is None else seed)
