"""RMSNorm layers run as one fused kernel (`torch.nn.functional.rms_norm`).

transformers writes RMSNorm as a chain of small ops (float32 cast, square, mean, add, rsqrt, two products, cast
back): about eight kernels per norm and two norms a layer (four on models with q/k norms). In a captured decode
step of batch 1 these kernels do almost no work and cost their launch, so a 64-layer model spends about a
thousand launches a token on its norms; on CUDA, `rms_norm` is one kernel (`aten::_fused_rms_norm`). On the CPU
torch runs a chain of ops inside it, so the CPU gains no speed.

A layer is swapped only after it gave the fused result, values and dtype, on a random input in the model's dtype
with its own weights: a variant such as Gemma's (1 + weight) scaling, or a norm kept in float32 inside a bf16
model (transformers then returns float32, the fused kernel bf16), fails that check and keeps its own forward. In
bf16 the fused kernel rounds once where transformers rounds twice (before and after the weight), a difference of
at most about one unit in the last place, on the CPU as on CUDA; in float32 the two agree to rounding.
"""

from __future__ import annotations

import logging
import warnings

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


class SwappedForward:
    """`function` bound to `module` as its instance-level forward. A bound method would do, but pickles by its name
    looked up on the module (which has no such attribute), so `torch.save` of a whole swapped model failed; this
    pickles and deep-copies with the module."""

    def __init__(self, function, module):
        self.__func__, self.__self__ = function, module

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)


def runs_forward(module, function) -> bool:
    """Whether the module's instance-level forward is `function` bound to it (a speed swap's, here or in
    merged_linear; not some other instance-level forward: a hook's)."""
    return getattr(vars(module).get("forward"), "__func__", None) is function


def _swapped(module) -> bool:
    return runs_forward(module, _fused_forward)


def _agrees(module, dtype: torch.dtype) -> bool:
    """The layer's own forward and the fused one agree, values and dtype, on a random input of the model's dtype
    (with the layer's weights)."""
    weight = module.weight
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(4, weight.shape[0], generator=gen) * 3).to(weight.device, dtype)
    try:
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's "cannot dispatch to fused" for mixed dtypes: the check says so
            ref, fused = type(module).forward(module, x), _fused_forward(module, x)
    except Exception:  # noqa: BLE001 - a norm whose forward takes other arguments keeps it
        return False
    if ref.dtype != fused.dtype or ref.shape != fused.shape:
        return False
    ref, fused = ref.float(), fused.float()
    tol = _TOLERANCE.get(dtype, 1e-5)  # relative, plus a floor at the output's scale for values near 0
    return bool(((ref - fused).abs() <= tol * (ref.abs() + 0.1 * ref.abs().mean())).all())


def set_fused_norms(model, on: bool) -> dict[str, int]:
    """Swap the model's RMSNorm layers to the fused kernel (on) or back to their own forward (off).
    Returns {"fused": n, "kept": n}: layers that now run fused, and RMSNorm-like layers kept because the fused
    kernel did not compute what they do or because another instance-level forward (a hook's) is set on them. A
    decode step captured before the swap keeps the kernels it captured."""
    fused = kept = undone = 0
    first = next(model.parameters(), None)
    dtype = getattr(model, "dtype", None) or (first.dtype if first is not None else None)  # the layers' inputs'
    for module in _candidates(model):
        if _swapped(module):
            del module.forward
            undone += 1
        if not on:
            continue
        if "forward" in vars(module):  # someone else's (a device-map hook wraps the forward): leave it be
            kept += 1
            continue
        module._fused_eps = _eps(module)
        if _agrees(module, dtype):
            module.forward = SwappedForward(_fused_forward, module)
            fused += 1
        else:
            kept += 1
    if on:
        log.info("fused RMSNorm: %d layers swapped%s", fused,
                 f", {kept} kept (the fused kernel did not agree with their forward, or a hook's forward is set)" if kept else "")
    elif undone:
        log.info("fused RMSNorm: %d layers back to their own forward", undone)
    return {"fused": fused, "kept": kept}


def auto_on_cuda(setting: bool | str, model, option: str) -> bool:
    """A speed swap's setting (models.fused_norm, models.merged_linear) resolved for `model`: True / False as set;
    "auto" swaps where the weights sit on CUDA, where a captured decode step of batch 1 pays each kernel's launch,
    and nowhere else (the CPU gains nothing)."""
    if setting == "auto":
        first = next(model.parameters(), None)
        return first is not None and first.device.type == "cuda"
    if isinstance(setting, bool):
        return setting
    raise ValueError(f"{option} must be True, False or 'auto', got {setting!r}")


def wants_fused_norms(setting: bool | str, model) -> bool:
    """models.fused_norm resolved for `model` (`auto_on_cuda`; on an H100, 113.6 -> 120.7 tok/s on a 7B, 32.3 ->
    33.5 on a 32B: benchmarks/results/gpu_h100/seed1_fused_2026-11-27)."""
    return auto_on_cuda(setting, model, "fused_norm")


def setting_of(word: str, what: str = "fused norms") -> bool | str:
    """A command line's auto / on / off as the setting `auto_on_cuda` takes."""
    settings = {"auto": "auto", "on": True, "off": False}
    if word not in settings:
        raise ValueError(f"{what}: {word!r} is not one of {list(settings)}")
    return settings[word]


def fused_norm_count(model) -> int:
    """How many of the model's norm layers run the fused kernel."""
    return sum(_swapped(m) for m in _candidates(model))
