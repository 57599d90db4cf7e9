"""What order and rounding AMX's TDPBF16PS really has: the amx variant's tile output (tiles for
every row count) against emulations of candidate chains, and against the avx512bf16 variant
(vdpbf16ps), on data whose exponents spread wide enough that every order gives other bits.

Candidates, per output element, fp32 with flush-to-zero (torch.set_flush_denormal):
  odd-first    acc += x[2i+1] w[2i+1], then acc += x[2i] w[2i], each rounded (the module's chain)
  even-first   the same, even element first (what the SDM's pseudo-code says for TDPBF16PS)
  pair-sum     the pair's two products summed and rounded, then added and rounded
  pair-fused   acc + both products of a pair, rounded once (-rz: rounded toward zero)
  tile-fused   acc + the 32 products of one tile step, rounded once (-rz: toward zero)
and two denormal cases: a product below fp32's normal range (flushed?) and a bf16 denormal input
(taken as zero?).

    LLMSERVE_CPU_ISA=amx python benchmarks/probe_amx_order.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor_svc.kernels import gemm_bf16, library  # noqa: E402


def _rz(d: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 rounded toward zero."""
    f = d.float()
    over = f.double().abs() > d.abs()
    return torch.where(over, torch.nextafter(f, torch.zeros_like(f)), f)


def chains(x: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Emulated outputs [M, N] of each candidate chain for bf16 x [M, K] and w [K, N], K even."""
    xf, wf = x.float(), w.float()
    m, k = x.shape
    zero = torch.zeros(m, w.shape[1])
    out = {name: zero for name in ("odd-first", "even-first", "pair-sum", "pair-fused")}
    out |= {"pair-fused-rz": zero, "tile-fused": zero, "tile-fused-rz": zero}
    for i in range(k // 2):
        p_lo = xf[:, 2 * i, None] * wf[None, 2 * i]  # exact: 8-bit by 8-bit significands
        p_hi = xf[:, 2 * i + 1, None] * wf[None, 2 * i + 1]
        both = p_hi.double() + p_lo.double()  # exact
        out["odd-first"] = (out["odd-first"] + p_hi) + p_lo
        out["even-first"] = (out["even-first"] + p_lo) + p_hi
        out["pair-sum"] = out["pair-sum"] + both.float()
        out["pair-fused"] = (out["pair-fused"].double() + both).float()
        out["pair-fused-rz"] = _rz(out["pair-fused-rz"].double() + both)
    for t in range(0, k, 32):
        step = xf[:, t : t + 32].double() @ wf[t : t + 32].double()
        out["tile-fused"] = (out["tile-fused"].double() + step).float()
        out["tile-fused-rz"] = _rz(out["tile-fused-rz"].double() + step)
    return out


def run(lib_variant: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    os.environ["LLMSERVE_CPU_ISA"] = lib_variant
    library.reset()
    assert library.variant() == lib_variant, library.variant()
    return gemm_bf16.pack(w).linear(x.float(), None)


def main() -> None:
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    g = torch.Generator().manual_seed(0)
    m, k, n = 16, 96, 32
    spread = lambda *s: torch.randn(*s, generator=g) * 2.0 ** torch.randint(-12, 13, s, generator=g)  # noqa: E731
    x, w = spread(m, k).bfloat16(), spread(k, n).bfloat16()
    want = chains(x, w)
    names = [v for v in ("amx", "avx512bf16") if v in library.supported_variants()]
    got = {name: run(name, x, w) for name in names}
    for name, out in got.items():
        same = {c: f"{(out == ref).float().mean().item():.3f}" for c, ref in want.items()}
        print(f"{name:10s} share of elements equal to each chain: {same}")
    if len(got) == 2:
        agree = (got["amx"] == got["avx512bf16"]).float().mean().item()
        print(f"amx == avx512bf16 on {agree:.3f} of elements")
    # Denormals: a product 2^-140 (below 2^-126), and a bf16 denormal input 2^-130 times 2^10.
    for label, xv, wv in (
        ("tiny product", 2.0**-70, 2.0**-70),
        ("denormal input", 2.0**-130, 1024.0),
    ):
        xs = torch.zeros(1, 32, dtype=torch.bfloat16)
        ws = torch.zeros(32, 16, dtype=torch.bfloat16)
        xs[0, 0], ws[0, 0] = xv, wv
        torch.set_flush_denormal(False)
        exact = float(xs[0, 0].double() * ws[0, 0].double())
        torch.set_flush_denormal(True)
        outs = {name: run(name, xs, ws)[0, 0].item() for name in names}
        print(f"{label}: exact {exact:.3g}, " + ", ".join(f"{k} {v:.3g}" for k, v in outs.items()))


if __name__ == "__main__":
    main()
