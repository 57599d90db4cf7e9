"""Prepacked oneDNN weights for CPU fp32 matmuls.

oneDNN's matmul reads its weight in a blocked layout of its own. Given a plain matrix it
reorders it on every call; packed once at load (``torch.ops.mkldnn._reorder_linear_weight``,
what torch's inductor does when it freezes a model), it skips that copy. On the benchmark's model
(one thread, AMD EPYC with AVX-512; ``benchmarks/profile_step.py``, docs/benchmarks.md) the
layer matmuls run at ~180-200 GFLOP/s packed against ~120-150 unpacked and ~55-80 for
``torch.mm`` (MKL), for 16 to 2 048 rows; one row is memory-bound and about equal.

The packed tensor is opaque (only oneDNN's linear reads it), so a packed ``Linear`` gives up its
plain weight (no second copy in memory); a tied lm_head keeps the embedding it shares and gets
a packed copy. ``LLMSERVE_PREPACK=0`` turns this off.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from executor_svc.models.llama import Linear


def _pack_fn():
    try:
        if not torch.backends.mkldnn.is_available():
            return None
        return torch.ops.mkldnn._reorder_linear_weight
    except (AttributeError, RuntimeError):
        return None


def pack(w_io: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed form of an ``[in, out]`` fp32 CPU matrix, or None where not possible."""
    fn = _pack_fn()
    if fn is None or w_io.device.type != "cpu" or w_io.dtype != torch.float32:
        return None
    try:
        return fn(w_io.t().contiguous())  # oneDNN wants [out, in]
    except RuntimeError:
        return None


def linear_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
    """``x [rows, in] @ W (+ bias)`` with W packed by ``pack``."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def prepack_model(model: nn.Module) -> int:
    """Pack every ``Linear`` and the lm_head of a CPU fp32 model in place; returns how many."""
    if os.environ.get("LLMSERVE_PREPACK", "1") == "0":
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.packed is None:
            packed = pack(module.weight.data)
            if packed is not None:
                module.packed = packed
                module.weight.data = module.weight.data.new_empty(0)
                count += 1
    lm_head = getattr(model, "lm_head", None)
    if isinstance(lm_head, torch.Tensor) and getattr(model, "packed_lm_head", 1) is None:
        packed = pack(lm_head.data)
        if packed is not None:
            model.packed_lm_head = packed
            count += 1
    return count
