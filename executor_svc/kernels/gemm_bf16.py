"""CPU bf16 matmuls: a step-invariant GEMM of our own on bf16 weights packed at load.

``csrc/gemm_bf16.cpp`` computes every output element as one fixed chain over k (pairs of k in
ascending order, the odd one first, fp32 accumulation; its header comment), whatever the number
of rows, the other rows or the threads, so a bf16 model keeps the step-invariance guarantee
(config/numerics.py). On a CPU with AVX512-BF16 each pair is one ``vdpbf16ps``; the avx512 and
avx2 variants of the library widen bf16 to fp32 and issue the two FMAs that instruction
performs, with the same bits (``tests/unit/test_gemm_bf16.py`` checks the variants against each
other and against torch). The amx variant runs every row count on AMX tiles (``TDPBF16PS``;
``csrc/gemm_bf16_amx.h``): one fixed order per element too, but that instruction rounds its own
way, so its bits are its own (step-invariant, not equal to the other variants';
tests/unit/test_gemm_amx.py, docs/benchmarks.md "AMX").

Weights are packed once into panels of ``NR`` columns, ``[N / NR][K2s][NR][2]`` bf16
(``Bf16PanelWeight``); K2s is ``K / 2`` rounded up to the library's multiple (whole AMX tiles in
the amx variant, whose padded pairs are bf16 -0). Activations enter as bf16 (fp32 ones are
rounded to bf16 first, as torch's bf16 matmul does); the result is fp32 accumulated, plus the
bias, rounded to the activations' dtype. Taken in both numerics modes: it is faster than torch's bf16 matmul at
decode batch sizes (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from executor_svc.kernels import library

_OUT_DTYPES = (torch.bfloat16, torch.float32)


def _load() -> Any:
    lib = library.load()
    return lib if lib is not None and hasattr(lib, "llmserve_gemm_bf16") else None


def available() -> bool:
    """Whether the bf16 kernel can run here."""
    return _load() is not None


def isa_path() -> str:
    """The instruction path the loaded kernel takes ("amx", "avx512bf16", "avx512f", "avx2"), or
    ""."""
    lib = _load()
    return lib.llmserve_gemm_bf16_path().decode() if lib is not None else ""


@dataclass(slots=True, eq=False)
class Bf16PanelWeight:
    """An ``[in, out]`` bf16 matrix as panels for the step-invariant bf16 kernel."""

    panels: torch.Tensor  # [ceil(out / NR), K2s, NR, 2] bf16, padded (module doc)
    in_features: int
    out_features: int

    @classmethod
    def pack(cls, w_io: torch.Tensor) -> Bf16PanelWeight:
        k, n = w_io.shape
        lib = _load()
        nr = lib.llmserve_gemm_bf16_nr()
        align = (
            lib.llmserve_gemm_bf16_k2_align() if hasattr(lib, "llmserve_gemm_bf16_k2_align") else 1
        )
        num, k2 = -(-n // nr), -(-k // 2)
        k2s = -(-k2 // align) * align
        padded = torch.zeros(2 * k2s, num * nr, dtype=torch.bfloat16)
        padded[:k, :n] = w_io
        # Pairs past K / 2 (whole tiles): -0, whose products leave every accumulator as it is.
        padded[2 * k2 :] = -0.0
        # (k2s, pair, panel, col) -> (panel, k2s, col, pair)
        panels = padded.view(k2s, 2, num, nr).permute(2, 0, 3, 1).contiguous()
        return cls(panels, k, n)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [rows, in] @ W (+ bias)`` in x's dtype (bf16 or fp32), each element in the fixed
        order of the module doc."""
        assert x.dim() == 2 and x.shape[1] == self.in_features, (x.shape, self.in_features)
        assert x.device.type == "cpu" and x.dtype in _OUT_DTYPES, (x.device, x.dtype)
        out_dtype = x.dtype
        k2 = -(-self.in_features // 2)
        if x.dtype != torch.bfloat16:
            x = x.to(torch.bfloat16)
        if self.in_features % 2:
            x = torch.nn.functional.pad(x, (0, 1))
        # A one-row tensor's row stride is arbitrary (torch calls it contiguous whatever it is).
        ldx = x.stride(0) if x.shape[0] > 1 else 2 * k2
        if x.stride(1) != 1 or ldx < 2 * k2 or ldx % 2:
            x, ldx = x.contiguous(), 2 * k2
        if bias is not None:
            bias = bias.to(torch.float32).contiguous()
            assert bias.shape == (self.out_features,), (bias.shape, self.out_features)
        m, n = x.shape[0], self.out_features
        y = torch.empty(m, n, dtype=out_dtype)
        is_f32 = out_dtype == torch.float32
        rc = _load().llmserve_gemm_bf16(
            x.data_ptr(), m, 2 * k2, ldx, self.panels.data_ptr(), n,
            None if bias is None else bias.data_ptr(),
            y.data_ptr() if is_f32 else None, None if is_f32 else y.data_ptr(), n,
            torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"bf16 gemm rejected x {tuple(x.shape)} (code {rc})")
        return y


def pack(w_io: torch.Tensor) -> Bf16PanelWeight | None:
    """The packed form of an ``[in, out]`` bf16 CPU matrix; None where the kernel is missing
    (then the caller keeps the plain matrix and torch's matmul)."""
    if not (w_io.dim() == 2 and w_io.is_cpu and w_io.dtype == torch.bfloat16 and available()):
        return None
    return Bf16PanelWeight.pack(w_io)
