"""What ``--dtype auto`` means on a CPU: bf16 where the CPU multiplies bf16 natively, fp32
elsewhere.

bf16 halves the bytes a decode step reads (weights and K/V), which is what bounds it, but only
pays where the CPU has bf16 dot products (AMX or AVX512-BF16): elsewhere each bf16 value is
widened to fp32 before the same FMAs, and fp32 is as fast with twice the precision. The choice
also needs the kernel library's bf16 GEMM (without it bf16 falls back to torch's matmul, which
is not step-invariant). Logged once at start-up (``executor.dtype``) with its reason.
"""

from __future__ import annotations

import structlog
import torch

from executor_svc.config import envs
from executor_svc.kernels import gemm_bf16, library

log = structlog.get_logger(__name__)

BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def auto_cpu_dtype() -> torch.dtype:
    """bf16 when the CPU has one of ``BF16_CPU_FLAGS`` and the bf16 kernel loads; fp32 else
    (``$LLMSERVE_AUTO_CPU_DTYPE`` overrides)."""
    flags = set(library._cpu_features().split())
    native = [f for f in BF16_CPU_FLAGS if f in flags]
    forced = envs.auto_cpu_dtype()
    if forced in ("float32", "bfloat16"):
        dtype, reason = getattr(torch, forced), "LLMSERVE_AUTO_CPU_DTYPE"
    elif not native:
        dtype, reason = torch.float32, "no AMX or AVX512-BF16 on this CPU"
    elif not gemm_bf16.available():
        dtype, reason = torch.float32, "the CPU kernel library (bf16 GEMM) is not available"
    else:
        dtype, reason = torch.bfloat16, f"the CPU has {', '.join(native)}"
    log.info("executor.dtype", dtype=str(dtype).removeprefix("torch."), auto=True, reason=reason)
    return dtype
