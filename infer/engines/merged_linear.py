"""Linear layers that read the same input run as one matrix product (`models.merged_linear`).

An attention layer projects its input three times (q_proj, k_proj, v_proj) and a gated MLP twice (gate_proj,
up_proj). With grouped-query attention the key and value projections are small, and at batch 1 each small product
reads its weights well below the memory bandwidth and pays its launch and a split-K reduction: in a captured 7B
decode step on an H100, k_proj and v_proj took ~14 µs a layer for 7 MB of weights that ~3 TB/s reads in 2.5 µs
(benchmarks/results/gpu_h100/fast_2026-11-25/profile_qwen2-7b.txt). vLLM and gpt-fast store such weights as one
matrix; here the model keeps its modules and its state_dict keys instead:

- a group's weights (and biases) are concatenated into one tensor, a non-persistent buffer of the parent module
  (so `.to()` moves it), and each member's weight becomes a view of its rows (no second copy of the weights);
- the first member called on an input computes the whole product and keeps it; the others, called on the same
  tensor (the same object, not written since: see `_Group.output`), return their columns of it; called on another input they compute
  their own product. So a result never depends on the order or the number of calls, only the kernel count does;
  the kept product is dropped once every member took its part.

Only plain `nn.Linear` members are merged (a LoRA or quantised layer keeps its own forward), and with gradients on
every member computes its own product, so training through a merged model still reaches each weight. A model stays
merged only if, in a forward on a short random input, every member's columns of the merged product equal its own
product to its dtype's rounding. The check is per member, not on the logits: in bf16 the merged product's other
blocking moves each output by up to an ulp, and a deep random-weight model (the 32B shape) amplifies that past any
logits tolerance, while a member handed stale columns (its input written in place since) is off by its whole size.
"""

from __future__ import annotations

import logging
import math
import threading

import torch
import torch.nn.functional as F
from torch import nn

from specprobe.infer.engines.fused_norm import SwappedForward, auto_on_cuda, runs_forward

log = logging.getLogger(__name__)

# member names of the groups that read one input: attention's projections, a gated MLP's two up-projections
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# the check's tolerance by dtype: a member's largest difference from its own product, over that product's largest
# magnitude. Another blocking of the same terms moves an output by about an ulp of it (bf16: up to 2**-7 of its
# size; reduced-precision split-K reductions a little more). With TF32 matmuls on, float32 would need ~1e-3
_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}


class _Kept:
    """One thread's merged product of a group, with the input it was computed on, and while the merge is checked,
    [the largest relative difference of a member's columns from its own product, the members checked] (None
    otherwise)."""

    def __init__(self):
        self.audit: list | None = None
        self.clear()

    def clear(self) -> None:
        self.input, self.version, self.outputs, self.left = None, -1, None, 0


class _Group:
    """The merged product of one group's members, kept per thread (two engines on the same weights decode from two
    threads in async Lookahead Reasoning) for the input it was computed on."""

    def __init__(self, parent: nn.Module, buffer: str, has_bias: bool, sizes: list[int]):
        self.parent, self.buffer, self.has_bias, self.sizes = parent, buffer, has_bias, sizes
        self._local = threading.local()
        self._traced = _Kept()  # while dynamo traces: its state at trace time only (the compiled code has none)

    def __getstate__(self) -> dict:  # a thread's kept product does not travel (copy.deepcopy, pickle)
        return {k: v for k, v in vars(self).items() if k not in ("_local", "_traced")}

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state)
        self._local, self._traced = threading.local(), _Kept()

    def kept(self) -> _Kept:
        if torch.compiler.is_compiling():
            return self._traced
        kept = getattr(self._local, "kept", None)
        if kept is None:
            kept = self._local.kept = _Kept()
        return kept

    def output(self, index: int, x: torch.Tensor, kept: _Kept) -> torch.Tensor:
        """Member `index`'s columns of the product on x, kept in `kept` (this thread's: `kept()`)."""
        # an inference-mode tensor (the engines decode in inference mode) keeps no version counter, nor does dynamo
        # trace one: the same object is then taken as the same values (the merge's check, member by member, catches
        # a forward that writes its input between its members' calls)
        version = -1 if torch.compiler.is_compiling() or x.is_inference() else x._version
        if kept.outputs is None or kept.input is not x or kept.version != version:
            merged = getattr(self.parent, self.buffer)
            bias = getattr(self.parent, self.buffer + "_bias") if self.has_bias else None
            kept.outputs = F.linear(x, merged, bias).split(self.sizes, dim=-1)
            kept.input, kept.version, kept.left = x, version, len(self.sizes)
        y = kept.outputs[index]
        kept.left -= 1
        if kept.left <= 0:  # every member took its part: keep no activations past the call
            kept.clear()
        return y


def _member_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and module.weight.requires_grad:
        return F.linear(x, module.weight, module.bias)
    group = module._merged_group
    kept = group.kept()
    y = group.output(module._merged_index, x, kept)
    if kept.audit is not None:  # the merge is being checked (never while dynamo traces): its own product beside
        own = F.linear(x, module.weight, module.bias).float()
        error = ((y.float() - own).abs().max() / own.abs().max().clamp_min(1e-30)).item()
        kept.audit[0] = max(kept.audit[0], error if math.isfinite(error) else math.inf)  # max() drops a NaN
        kept.audit[1] += 1
    return y


def _swapped(module) -> bool:
    return runs_forward(module, _member_forward)


def _groups(model):
    """(parent, member names, members) of each group whose members are all plain linear layers on one input size,
    dtype and device, all with a bias or all without, none with an instance-level forward (a hook's) of its own."""
    for parent in model.modules():
        for names in GROUPS:
            members = [getattr(parent, name, None) for name in names]
            if not all(type(m) is nn.Linear for m in members):
                continue
            if any("forward" in vars(m) and not _swapped(m) for m in members):
                continue
            first = members[0].weight
            if any(m.in_features != members[0].in_features or m.weight.dtype != first.dtype
                   or m.weight.device != first.device or (m.bias is None) != (members[0].bias is None)
                   for m in members):
                continue
            yield parent, names, members


def _buffer_name(names: tuple[str, ...]) -> str:
    return "_merged_" + "_".join(n.removesuffix("_proj") for n in names)


def _merge(parent: nn.Module, names: tuple[str, ...], members: list[nn.Linear]) -> None:
    buffer = _buffer_name(names)
    with torch.no_grad():
        weight = torch.cat([m.weight for m in members])
        bias = torch.cat([m.bias for m in members]) if members[0].bias is not None else None
    parent.register_buffer(buffer, weight, persistent=False)
    if bias is not None:
        parent.register_buffer(buffer + "_bias", bias, persistent=False)
    group = _Group(parent, buffer, bias is not None, [m.out_features for m in members])
    start = 0
    for index, m in enumerate(members):
        rows = slice(start, start + m.out_features)
        start = rows.stop
        m.weight = nn.Parameter(weight[rows], requires_grad=m.weight.requires_grad)  # a view: one copy in memory
        if bias is not None:
            m.bias = nn.Parameter(bias[rows], requires_grad=m.bias.requires_grad)
        m._merged_group, m._merged_index = group, index  # plain attributes (a _Group is not a module)
        m.forward = SwappedForward(_member_forward, m)


def _unmerge(parent: nn.Module, names: tuple[str, ...], members: list[nn.Linear]) -> bool:
    if not any(_swapped(m) for m in members):
        return False
    for m in members:
        if _swapped(m):
            del m.forward
        vars(m).pop("_merged_group", None)
        vars(m).pop("_merged_index", None)
    buffer = _buffer_name(names)
    for name in (buffer, buffer + "_bias"):
        if hasattr(parent, name):
            delattr(parent, name)  # the members' weights stay views of the same values
    return True


def _audited_forward(model, groups, ids: torch.Tensor) -> list[tuple[float, int]]:
    """Per group, in one forward on ids (in this thread): the largest relative difference of a member's merged
    columns from its own product, and how many member calls were checked."""
    kept = [members[0]._merged_group.kept() for _, _, members in groups]
    for k in kept:
        k.audit = [0.0, 0]
    try:
        with torch.inference_mode():
            model(input_ids=ids)
        return [tuple(k.audit) for k in kept]
    finally:
        for k in kept:
            k.audit = None


def _shares_buffer(parent: nn.Module, names: tuple[str, ...], members: list[nn.Linear]) -> bool:
    """Whether each member's weight is still a view of the group's merged buffer (a deep copy or `.to()` of the
    model copies them apart: the copy then holds its weights twice until merged again)."""
    buffer = getattr(parent, _buffer_name(names), None)
    return buffer is not None and all(m.weight.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
                                      for m in members)


def set_merged_linear(model, on: bool) -> dict[str, int]:
    """Merge each group of linear layers that read one input (`GROUPS`) into one product (on), or undo it (off).
    Returns {"merged": n, "kept": n}: groups that now run merged, and groups left as they were because a member's
    merged columns differed from its own product on the check's input (a forward that writes its input in place
    between its members' calls, say) or the check could not run.
    Merge before any decode step is captured on these weights (the engines do, when built): merging frees the
    members' old weights, which such a capture would still read; undoing keeps them (the views hold the storage).
    Moving the model (`.to()`) or copying it after merging copies each member's view apart; merging it again (an
    engine built on the copy does) makes them views again."""
    groups = list(_groups(model))
    if on and groups and all(_swapped(m) and _shares_buffer(*g) for g in groups for m in g[2]):
        return {"merged": len(groups), "kept": 0}  # already merged (an engine on shared weights)
    undone = sum(_unmerge(*g) for g in groups)
    if not on:
        if undone:
            log.info("merged linear layers: %d groups back to their own products", undone)
        return {"merged": 0, "kept": 0}
    if not groups:
        return {"merged": 0, "kept": 0}
    first = groups[0][2][0].weight
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)
    try:
        ids = torch.randint(0, max(vocab, 1), (1, 8), generator=torch.Generator().manual_seed(0)).to(first.device)
        for g in groups:
            _merge(*g)
        audits = _audited_forward(model, groups, ids)
    except Exception as err:  # noqa: BLE001 - a model this check cannot run keeps its own products
        log.info("merged linear layers: not merged (the check could not run: %s)", err)
        for g in groups:
            _unmerge(*g)
        return {"merged": 0, "kept": len(groups)}
    tol = _TOLERANCE.get(first.dtype, 1e-4)
    error = max((e for e, calls in audits if calls), default=0.0)
    if error > tol:
        log.warning("merged linear layers: a member's columns of the merged product differ from its own product by "
                    "%.2g of its size on the check's input (tolerance %.0e); %d groups keep their own products",
                    error, tol, len(groups))
        for g in groups:
            _unmerge(*g)
        return {"merged": 0, "kept": len(groups)}
    unchecked = [g for g, (_, calls) in zip(groups, audits) if not calls]
    for g in unchecked:  # not called on the check's input (in this thread, uncompiled): unchecked, so not merged
        _unmerge(*g)
    merged = len(groups) - len(unchecked)
    log.info("merged linear layers: %d groups run as one product each%s", merged,
             f"; {len(unchecked)} not called by the check's forward keep their own products" if unchecked else "")
    return {"merged": merged, "kept": len(unchecked)}


def wants_merged_linear(setting: bool | str, model) -> bool:
    """models.merged_linear resolved for `model` (`fused_norm.auto_on_cuda`: auto merges for weights on CUDA)."""
    return auto_on_cuda(setting, model, "merged_linear")


def merged_linear_count(model) -> int:
    """How many of the model's groups of linear layers run as one product."""
    return sum(_swapped(members[0]) for _, _, members in _groups(model))
