"""Weight-only quantized matmuls over GGUF blocks (``csrc/quant_gemm.cpp``): the weights stay
in their GGUF block layout in memory; activations and accumulation are fp32.

Each output element is one fixed chain over the weight row's groups of 32 (the C++ file's
header), the same for a decode row and for the same row inside a prefill, so quantized models
keep the step-invariance promise. By default activations are not quantized: with fp32
activations the result is within fp32 rounding of de-quantize-then-matmul, which is what
transformers' GGUF loader computes, the reference greedy outputs are held to. Opt-in
(``LLMSERVE_QUANT_ACT=int8``, or ``act="int8"``): the split types quantize each activation row
to int8 per group of 32, as llama.cpp does, and multiply with integer dot products
(``csrc/quant_act8.cpp``): faster, still one fixed chain per row (step-invariant), but drifting
from that reference by the activations' rounding; the K-quants keep fp32 activations.

``QuantWeight`` is a ``gemm.PackedWeight``: a ``models.llama.Linear`` holding one in ``packed``
runs it instead of its fp32 weight (``models/quant_linear.py`` builds them). It takes GGUF
blocks; the 32-weight types (``SPLIT_TYPES``: Q8_0, Q4_0, Q4_1) it holds in the split layout
(``csrc/quant_split.cpp``: a row's quants, then its scales, then its minimums; the same bytes),
run by their own kernel, the K-quants as GGUF blocks (``csrc/quant_gemm.cpp``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from executor_svc.config import envs
from executor_svc.kernels import library

# ggml type id -> (name, weights per block, bytes per block); every type this build reads.
TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    30: ("BF16", 1, 2),
    8: ("Q8_0", 32, 34),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    12: ("Q4_K", 256, 144),
    14: ("Q6_K", 256, 210),
}
FLOAT_TYPES = frozenset({0, 1, 30})  # de-quantized to fp32 at load, run by the fp32 GEMM
SPLIT_TYPES = frozenset({8, 2, 3})  # held in the split layout (csrc/quant_split.cpp)
TYPE_IDS = {name: tid for tid, (name, _, _) in TYPES.items()}
ACT_INT8 = 0x100  # or'ed into a split type's id for the kernel: int8 activations (quant_common.h)


def type_name(type_id: int) -> str:
    return TYPES[type_id][0] if type_id in TYPES else f"type {type_id}"


def row_bytes(type_id: int, k: int) -> int:
    """Bytes of one row of ``k`` weights of ``type_id`` (``k`` a multiple of its block)."""
    _, block, nbytes = TYPES[type_id]
    if k % block:
        raise ValueError(f"a row of {k} weights is not whole {type_name(type_id)} blocks")
    return k // block * nbytes


def _lib() -> Any:
    lib = library.load()
    if lib is None or not available():  # a library built from older sources lacks the split kernel
        raise RuntimeError(
            "quantized weights need the CPU kernel library (a C++ compiler, or "
            "LLMSERVE_KERNEL_LIB built from these sources); none could be loaded"
        )
    return lib


def available() -> bool:
    lib = library.load()
    return lib is not None and hasattr(lib, "llmserve_quant_gemm_split_f32")


def relayout(type_id: int, data: torch.Tensor, k: int, to_split: bool) -> torch.Tensor:
    """``data`` ([N, row_bytes] uint8 of a ``SPLIT_TYPES`` type) moved from GGUF blocks to the
    split layout (``to_split``) or back; a new tensor."""
    assert data.dtype == torch.uint8 and data.dim() == 2 and data.is_contiguous(), data.shape
    out = torch.empty_like(data)
    rc = _lib().llmserve_quant_relayout(
        type_id, data.data_ptr(), data.shape[0], k, data.shape[1], out.data_ptr(), int(to_split)
    )
    if rc != 0:
        raise ValueError(f"cannot relayout {type_name(type_id)} rows of {k} (code {rc})")
    return out


def dequantize(
    type_id: int,
    data: torch.Tensor,
    k: int,
    rows: torch.Tensor | None = None,
    split: bool = False,
) -> torch.Tensor:
    """The fp32 values of ``data`` ([N, row_bytes] uint8, N rows of ``k`` weights as GGUF blocks,
    or in the split layout when ``split``), or of the rows ``rows`` (int64) only: bit for bit the
    ``gguf`` package's de-quantization."""
    assert data.dtype == torch.uint8 and data.dim() == 2 and data.is_contiguous(), data.shape
    assert data.shape[1] == row_bytes(type_id, k), (data.shape, type_name(type_id), k)
    num = data.shape[0] if rows is None else rows.numel()
    out = torch.empty(num, k, dtype=torch.float32)
    if rows is not None:
        rows = rows.to(torch.int64).contiguous()
    fn = _lib().llmserve_quant_dequant_split_f32 if split else _lib().llmserve_quant_dequant_f32
    rc = fn(
        type_id, data.data_ptr(), data.shape[0], k, data.shape[1],
        None if rows is None else rows.data_ptr(), num, out.data_ptr(), k,
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"cannot de-quantize {type_name(type_id)} rows of {k} (code {rc})")
    return out


@dataclass(slots=True, eq=False)
class QuantWeight:
    """An ``[out, in]`` matrix as GGUF blocks: ``out`` rows of ``in / block`` blocks each, given
    in the GGUF layout and held in the split layout for ``SPLIT_TYPES``."""

    data: torch.Tensor  # [out_features, row_bytes] uint8
    type_id: int
    in_features: int
    # "fp32" or "int8" (split types only; the K-quants always run fp32 activations)
    act: str = field(default_factory=envs.quant_act)
    _fn: Any = field(init=False, repr=False)  # the kernel for this layout (ctypes function)

    def __post_init__(self) -> None:
        assert self.data.dtype == torch.uint8 and self.data.dim() == 2, self.data.shape
        assert self.type_id in TYPES and self.type_id not in FLOAT_TYPES, self.type_id
        assert self.data.shape[1] == row_bytes(self.type_id, self.in_features), (
            self.data.shape,
            type_name(self.type_id),
            self.in_features,
        )
        assert self.act in ("fp32", "int8"), self.act
        if not self.split:
            self.act = "fp32"
        self.data = self.data.contiguous()
        lib = _lib()
        self._fn = lib.llmserve_quant_gemm_f32
        if self.split:
            self.data = relayout(self.type_id, self.data, self.in_features, to_split=True)
            self._fn = lib.llmserve_quant_gemm_split_f32

    @property
    def split(self) -> bool:
        return self.type_id in SPLIT_TYPES

    @property
    def kernel_type(self) -> int:
        """The type id the kernel is called with (``ACT_INT8`` added in the int8 mode)."""
        return self.type_id | (ACT_INT8 if self.act == "int8" else 0)

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` de-quantized, ``[len(ids), in]`` fp32 (an embedding lookup)."""
        return dequantize(self.type_id, self.data, self.in_features, ids, self.split)

    def dequantize(self) -> torch.Tensor:
        """``[out, in]`` fp32 (tests, and references)."""
        return dequantize(self.type_id, self.data, self.in_features, None, self.split)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [rows, in] @ W^T (+ bias)``, each element in the kernel's fixed order."""
        # Checked in few operations: a decode step makes four of these calls per layer.
        m, k = x.shape
        assert k == self.in_features and x.dtype == torch.float32 and x.is_cpu, (x.shape, x.dtype)
        n = self.data.shape[0]
        if bias is not None:
            assert bias.dtype == torch.float32 and bias.shape == (n,), bias
            bias = bias.contiguous()
        ldx = x.stride(0)
        if x.stride(1) != 1 or ldx < k:
            x = x.contiguous()
            ldx = k
        y = torch.empty(m, n, dtype=torch.float32)
        rc = self._fn(
            self.kernel_type, x.data_ptr(), m, k, ldx, self.data.data_ptr(), n, self.data.shape[1],
            None if bias is None else bias.data_ptr(), y.data_ptr(), n, torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(
                f"quantized matmul rejected x {tuple(x.shape)} with {type_name(self.type_id)} "
                f"weights [{n}, {k}] (code {rc})"
            )
        return y
