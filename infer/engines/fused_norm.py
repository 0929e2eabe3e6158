"""RMSNorm layers run as one fused kernel (`torch.nn.functional.rms_norm`).

transformers writes RMSNorm as a chain of small ops (float32 cast, square, mean, add, rsqrt, two products, cast
back): about eight kernels per norm and two norms a layer (four on models with q/k norms). In a captured decode
step of batch 1 these kernels do almost no work and cost their launch, so a 64-layer model spends about a
thousand launches a token on its norms; on CUDA, `rms_norm` is one kernel (`aten::_fused_rms_norm`). On the CPU
torch runs the same chain inside it, so nothing changes there.

A layer is swapped only after it gave the fused result on a random input with its own weights: a variant such
as Gemma's (1 + weight) scaling fails that check and keeps its own forward. In bf16 the fused kernel rounds once
where transformers rounds twice (before and after the weight), a difference of at most about one unit in the last
place; in float32 the two agree to rounding.
"""

from __future__ import annotations

import logging
import types

import torch

log = logging.getLogger(__name__)

# relative tolerance of the check, by dtype: two roundings against one (bf16 has 8 bits of mantissa)
_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}


def _eps(module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _fused_forward(module, hidden_states: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.rms_norm(hidden_states, module.weight.shape, module.weight, module._fused_eps)


def _candidates(model):
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor) and weight.dim() == 1
                and _eps(module) is not None):
            yield module


def _agrees(module) -> bool:
    """The layer's own forward and the fused one agree on a random input (with the layer's weights)."""
    weight = module.weight
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(4, weight.shape[0], generator=gen) * 3).to(weight.device, weight.dtype)
    with torch.inference_mode():
        ref = type(module).forward(module, x).float()
        fused = _fused_forward(module, x).float()
    tol = _TOLERANCE.get(weight.dtype, 1e-5)
    return ref.shape == fused.shape and bool(((ref - fused).abs() <= tol * (1 + ref.abs())).all())


def set_fused_norms(model, on: bool) -> dict[str, int]:
    """Swap the model's RMSNorm layers to the fused kernel (on) or back to their own forward (off).
    Returns {"fused": n, "kept": n}: layers that now run fused, and RMSNorm-like layers kept because the fused
    kernel does not compute what they do. A decode step captured before the swap keeps the kernels it captured."""
    fused = kept = 0
    for module in _candidates(model):
        if "forward" in vars(module):  # swapped earlier
            del module.forward
        if not on:
            continue
        module._fused_eps = _eps(module)
        if _agrees(module):
            module.forward = types.MethodType(_fused_forward, module)
            fused += 1
        else:
            kept += 1
    if on:
        log.info("fused RMSNorm: %d layers swapped%s", fused, f", {kept} kept (a different formula)" if kept else "")
    return {"fused": fused, "kept": kept}


def fused_norm_count(model) -> int:
    """How many of the model's norm layers run the fused kernel."""
    return sum("forward" in vars(m) for m in _candidates(model))
