"""The model's fused elementwise ops over ``csrc/elementwise.cpp`` (fp32) and
``csrc/elementwise_bf16.cpp`` (bf16 rows, fp32 inside, rounded where the bf16 reference rounds):
SiLU-and-multiply (the MLP) and residual add + RMSNorm; and the embedding lookup of a
[hidden, vocab] table. Each returns None for inputs it does not take (not fp32 / bf16 CPU rows
with unit column stride, or no library), and the caller keeps its torch path."""

from __future__ import annotations

import torch

from executor_svc.kernels import library

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _rows_ok(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in _SUFFIX and t.dim() == 2 and t.stride(1) == 1


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for fp32 or bf16 CPU rows [gate | up] ([n, 2 * i] -> [n, i]) in one pass (torch
    takes three: silu, then the product); None when the library cannot take the input."""
    if not (_rows_ok(gate_up) and gate_up.shape[1] % 2 == 0):
        return None
    lib = library.load()
    if lib is None:
        return None
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    rc = getattr(lib, f"llmserve_silu_mul_{_SUFFIX[gate_up.dtype]}")(
        gate_up.data_ptr(), rows, inter, gate_up.stride(0), out.data_ptr(), torch.get_num_threads()
    )
    return out if rc == 0 else None


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """RMSNorm of ``x + delta`` (of ``x`` when delta is None) over fp32 or bf16 CPU rows
    [n, dim], in one pass: returns (x + delta, normed), the sum being x itself when delta is None; None when the
    library cannot take the inputs (then the caller uses torch)."""
    if not (
        _rows_ok(x)
        and (delta is None or (_rows_ok(delta) and delta.shape == x.shape))
        and (delta is None or delta.dtype == x.dtype)
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and weight.shape == (x.shape[1],)
    ):
        return None
    lib = library.load()
    if lib is None:
        return None
    rows, dim = x.shape
    out = torch.empty(rows, dim, dtype=x.dtype)
    total = x if delta is None else torch.empty(rows, dim, dtype=x.dtype)
    rc = getattr(lib, f"llmserve_add_rms_norm_{_SUFFIX[x.dtype]}")(
        x.data_ptr(), x.stride(0), None if delta is None else delta.data_ptr(),
        0 if delta is None else delta.stride(0), weight.data_ptr(), rows, dim, eps,
        None if delta is None else total.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return (total, out) if rc == 0 else None


def gather_columns(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
    """``table.index_select(1, ids).t().contiguous()`` ([rows, cols] -> [len(ids), rows]) for
    an fp32 or bf16 CPU table with unit column stride and int64 CPU ids: the embedding lookup,
    the table's rows shared among the threads (torch's runs on one, element by element). None
    when the library cannot take the inputs or an id is out of range (torch's path raises)."""
    if not (_rows_ok(table) and ids.device.type == "cpu" and ids.dtype == torch.int64):
        return None
    lib = library.load()
    if lib is None or not hasattr(lib, "llmserve_gather_cols") or ids.dim() != 1:
        return None
    ids = ids.contiguous()
    rows, cols = table.shape
    out = torch.empty(ids.shape[0], rows, dtype=table.dtype)
    rc = lib.llmserve_gather_cols(
        table.data_ptr(), rows, cols, table.stride(0), table.element_size(), ids.data_ptr(),
        ids.shape[0], out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out if rc == 0 else None
