"""Matrix products for few-row forwards on the CPU.

A forward of a few tokens reads every weight once and does little arithmetic with it, so it should cost about what
a one-token forward costs. torch's float32 `linear` on the CPU streams the weights at that rate for 1–3 rows but not
from 4 rows on; oneDNN's matmul (`torch.ops.mkldnn._linear_pointwise`, on the same dense weight, no copy) does. Such
forwards are the target's reads at a switch: the exact prefix and the recompute policy's picks with the new tokens,
and every new turn a model reads. docs/RESULTS.md ("Few-row forwards") has the timings.

`use_small_batch_kernels(model)` routes the float32 CPU `nn.Linear` layers of a model through oneDNN for
`SMALL_BATCH_ROWS` rows and through `linear` otherwise; `load_model` does it for the models it loads. The sums
run in another order, so outputs differ from `linear`'s in the last bits (≈ 1e-5 relative).
"""

from __future__ import annotations

import types

import torch

#: rows (tokens × batch) of an input for which the oneDNN product is used (inclusive bounds)
SMALL_BATCH_ROWS = (4, 256)


def small_batch_kernels_available() -> bool:
    """Whether this torch build has oneDNN's linear (CPU builds with mkldnn)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def small_batch_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module``'s output for ``x``: oneDNN's product when ``x`` has `SMALL_BATCH_ROWS` rows, everything is float32
    on the CPU and no gradient is asked for (the oneDNN op has none), `torch.nn.functional.linear` otherwise."""
    low, high = SMALL_BATCH_ROWS
    weight = module.weight
    graded = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if (not graded and low <= x.numel() // max(x.shape[-1], 1) <= high and x.dtype == weight.dtype == torch.float32
            and x.device.type == weight.device.type == "cpu" and weight.is_contiguous()):
        return torch.ops.mkldnn._linear_pointwise(x, weight, module.bias, "none", [], "")
    return torch.nn.functional.linear(x, weight, module.bias)


def _routed(module: torch.nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, types.MethodType) and forward.__func__ is small_batch_linear


def use_small_batch_kernels(model: torch.nn.Module, enabled: bool = True) -> int:
    """Route every float32 CPU `nn.Linear` of ``model`` through `small_batch_linear` (``enabled``) or back to its own
    forward; returns how many layers changed. Layers whose forward something else already replaced (e.g.
    accelerate's device hooks), other dtypes and devices, and builds without oneDNN are left as they are."""
    changed = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear:
            continue
        if enabled and "forward" not in module.__dict__ and small_batch_kernels_available() \
                and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu":
            module.forward = types.MethodType(small_batch_linear, module)
            changed += 1
        elif not enabled and _routed(module):
            del module.forward
            changed += 1
    return changed
