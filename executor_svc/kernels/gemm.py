"""CPU fp32 matmuls: a step-invariant GEMM of our own (the default), or oneDNN on prepacked weights.

Step-invariant (``numerics.deterministic()``, the default): ``csrc/gemm.cpp`` computes every
output element as one fixed chain, ``bias + sum_k x[m, k] * w[k, n]`` with k ascending, whatever
the number of rows, the other rows or the threads. A sequence's logits then do not depend on how
its tokens were batched: oneDNN's packed linear gives a row other bits at one row than inside
two or more, and MKL's ``torch.matmul`` differs between 1-7 rows and 300, enough to flip a
near-tie. Weights are packed once at load into panels of ``NR`` columns ([N / NR][K][NR], the
last zero-padded; ``PanelWeight``), the layout the kernel streams fastest; plain ``[in, out]``
matrices (tensor-parallel shards, ``LLMSERVE_PREPACK=0``) go through the same kernel with the
same bits (``matmul``).

Off (``LLMSERVE_DETERMINISTIC=0``): oneDNN's matmul on weights reordered once into its blocked
layout (``torch.ops.mkldnn._reorder_linear_weight``, what inductor does when it freezes a
model; ``OneDnnWeight``), which saves the reorder oneDNN does on every call given a plain
matrix; unpacked matrices keep ``models.llama.matmul_io``'s MKL / oneDNN choice.

A packed ``Linear`` gives up its plain weight (one copy in memory); a tied lm_head keeps the
embedding it shares and gets a packed copy. bf16 CPU matrices go to ``gemm_bf16`` (its own
step-invariant kernel); CUDA, fp16 and a missing compiler keep the torch paths.
``LLMSERVE_PREPACK=0`` turns packing off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import structlog
import torch

from executor_svc.config import envs, numerics
from executor_svc.kernels import gemm_bf16, library

log = structlog.get_logger(__name__)
_warned = False


def _load() -> Any:
    """The kernel library when it has the GEMM, or None (no compiler, turned off, or a library
    built ahead of time from sources without it). Asked of ``library`` on every call (a cached
    attribute lookup), so a test switching variants (``library.reset``) reaches this one too."""
    global _warned
    lib = library.load()
    if lib is not None and hasattr(lib, "llmserve_gemm_f32"):
        return lib
    if numerics.deterministic() and not _warned:
        _warned = True
        # fp32 CPU matmuls then take oneDNN / MKL, whose bits depend on the batch's rows.
        log.warning("cpu_gemm.unavailable", hint="matmuls are not step-invariant")
    return None


def available() -> bool:
    """Whether the step-invariant kernel can run here."""
    return _load() is not None


def panel_width() -> int:
    """Columns per panel of the packed layout (the kernel's NR)."""
    lib = _load()
    assert lib is not None, "the CPU kernel library is not available"
    return lib.llmserve_gemm_nr()


def _is_cpu_f32(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32


def _run(x: torch.Tensor, w: torch.Tensor, n: int, ldw: int, bias: torch.Tensor | None):
    """The kernel call; ``w`` packed (``ldw`` = 0) or plain ``[K, N]`` with row stride ``ldw``."""
    assert x.dim() == 2 and _is_cpu_f32(x), (x.shape, x.dtype, x.device)
    assert bias is None or (_is_cpu_f32(bias) and bias.is_contiguous() and bias.shape == (n,))
    if x.stride(1) != 1 or x.stride(0) < x.shape[1]:
        x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.float32)
    rc = _load().llmserve_gemm_f32(
        x.data_ptr(), m, k, max(x.stride(0), k), w.data_ptr(), n, ldw,
        None if bias is None else bias.data_ptr(), y.data_ptr(), n, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"gemm kernel rejected x {tuple(x.shape)} w {tuple(w.shape)} (code {rc})")
    return y


class PackedWeight(Protocol):
    """A weight in the layout one CPU matmul reads; ``Linear`` calls ``linear`` on it."""

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


@dataclass(slots=True, eq=False)
class PanelWeight:
    """An ``[in, out]`` matrix as panels for the step-invariant kernel."""

    panels: torch.Tensor  # [ceil(out / NR), in, NR] fp32, the last panel zero-padded
    out_features: int

    @classmethod
    def pack(cls, w_io: torch.Tensor) -> PanelWeight:
        k, n = w_io.shape
        nr = panel_width()
        num = -(-n // nr)
        padded = torch.zeros(k, num * nr, dtype=torch.float32)
        padded[:, :n] = w_io
        panels = padded.view(k, num, nr).permute(1, 0, 2).contiguous()
        return cls(panels, n)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [rows, in] @ W (+ bias)``, each element in the fixed order (module doc)."""
        assert x.shape[-1] == self.panels.shape[1], (x.shape, self.panels.shape)
        return _run(x, self.panels, self.out_features, 0, bias)


@dataclass(slots=True, eq=False)
class OneDnnWeight:
    """oneDNN's opaque blocked form of an ``[in, out]`` matrix."""

    packed: torch.Tensor

    @classmethod
    def pack(cls, w_io: torch.Tensor) -> OneDnnWeight | None:
        try:
            if not torch.backends.mkldnn.is_available():
                return None
            reorder = torch.ops.mkldnn._reorder_linear_weight
            return cls(reorder(w_io.t().contiguous()))  # oneDNN wants [out, in]
        except (AttributeError, RuntimeError):
            return None

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, bias, "none", [], "")


def pack(w_io: torch.Tensor) -> PackedWeight | None:
    """The packed form of an ``[in, out]`` fp32 CPU matrix for this process's numerics mode
    (module doc); None where packing does not apply (then the caller keeps the plain matrix)."""
    if envs.prepack() and w_io.dim() == 2 and w_io.is_cpu and w_io.dtype == torch.bfloat16:
        return gemm_bf16.pack(w_io)
    if not envs.prepack() or not _is_cpu_f32(w_io) or w_io.dim() != 2:
        return None
    if numerics.deterministic():
        return PanelWeight.pack(w_io) if available() else None
    return OneDnnWeight.pack(w_io)


def matmul(
    x: torch.Tensor, w_io: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``x [rows, in] @ w_io [in, out] (+ bias)`` on a plain matrix with the step-invariant
    kernel, bitwise equal to ``PanelWeight.pack(w_io).linear(x, bias)``; None where it does not
    apply (not fp32 CPU, deterministic numerics off, no kernel), for the caller's own path."""
    if not (
        numerics.deterministic()
        and _is_cpu_f32(x)
        and _is_cpu_f32(w_io)
        and x.dim() == 2
        and w_io.dim() == 2
        and (bias is None or _is_cpu_f32(bias))
        and available()
    ):
        return None
    if w_io.stride(1) != 1 or w_io.stride(0) < w_io.shape[1]:
        w_io = w_io.contiguous()
    return _run(x, w_io, w_io.shape[1], max(w_io.stride(0), w_io.shape[1]), bias)
