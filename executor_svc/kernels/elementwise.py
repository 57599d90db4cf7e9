"""The model's fused elementwise ops over ``csrc/elementwise.cpp``: SiLU-and-multiply (the MLP)
and residual add + RMSNorm. Each returns None for inputs it does not take (not fp32 CPU rows
with unit column stride, or no library), and the caller keeps its torch path."""

from __future__ import annotations

import torch

from executor_svc.kernels import library


def _rows_ok(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 2 and t.stride(1) == 1


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for fp32 CPU rows [gate | up] ([n, 2 * i] -> [n, i]) in one pass (torch
    takes three: silu, then the product); None when the library cannot take the input."""
    if not (_rows_ok(gate_up) and gate_up.shape[1] % 2 == 0):
        return None
    lib = library.load()
    if lib is None:
        return None
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=torch.float32)
    rc = lib.llmserve_silu_mul_f32(
        gate_up.data_ptr(), rows, inter, gate_up.stride(0), out.data_ptr(), torch.get_num_threads()
    )
    return out if rc == 0 else None


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """RMSNorm of ``x + delta`` (of ``x`` when delta is None) over fp32 CPU rows [n, dim], in one
    pass: returns (x + delta, normed), the sum being x itself when delta is None; None when the
    library cannot take the inputs (then the caller uses torch)."""
    if not (
        _rows_ok(x)
        and (delta is None or (_rows_ok(delta) and delta.shape == x.shape))
        and weight.dtype == torch.float32
        and weight.is_contiguous()
        and weight.shape == (x.shape[1],)
    ):
        return None
    lib = library.load()
    if lib is None:
        return None
    rows, dim = x.shape
    out = torch.empty(rows, dim, dtype=torch.float32)
    total = x if delta is None else torch.empty(rows, dim, dtype=torch.float32)
    rc = lib.llmserve_add_rms_norm_f32(
        x.data_ptr(), x.stride(0), None if delta is None else delta.data_ptr(),
        0 if delta is None else delta.stride(0), weight.data_ptr(), rows, dim, eps,
        None if delta is None else total.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return (total, out) if rc == 0 else None
