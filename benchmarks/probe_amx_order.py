"""What order and rounding AMX's TDPBF16PS really has: the amx variant's tile output (tiles for
every row count) against emulations of candidate chains, and against the avx512bf16 variant
(vdpbf16ps), on data whose exponents spread wide enough that every order gives other bits.

Candidates, per output element, fp32 with flush-to-zero (torch.set_flush_denormal):
  odd-first    acc += x[2i+1] w[2i+1], then acc += x[2i] w[2i], each rounded (the module's chain)
  even-first   the same, even element first (what the SDM says for unswapped pairs)
  pair-fused   acc + both products of a pair, rounded once
  tile-fused   acc + the 32 products of one tile step, rounded once
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


def chains(x: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Emulated outputs [M, N] of each candidate chain for bf16 x [M, K] and w [K, N], K even."""
    xf, wf = x.float(), w.float()
    m, k = x.shape
    n = w.shape[1]
    odd, even = torch.zeros(m, n), torch.zeros(m, n)
    pair, tile = torch.zeros(m, n), torch.zeros(m, n)
    for i in range(k // 2):
        p_lo = xf[:, 2 * i, None] * wf[None, 2 * i]  # exact: 8-bit by 8-bit significands
        p_hi = xf[:, 2 * i + 1, None] * wf[None, 2 * i + 1]
        odd = (odd + p_hi) + p_lo
        even = (even + p_lo) + p_hi
        pair = (pair.double() + p_hi.double() + p_lo.double()).float()
    for t in range(0, k, 32):
        step = xf[:, t : t + 32].double() @ wf[t : t + 32].double()
        tile = (tile.double() + step).float()
    return {"odd-first": odd, "even-first": even, "pair-fused": pair, "tile-fused": tile}


def run(lib_variant: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    os.environ["LLMSERVE_CPU_ISA"] = lib_variant
    library.reset()
    assert library.variant() == lib_variant, library.variant()
    if lib_variant == "amx":
        library.load().llmserve_gemm_bf16_amx_set(0, 1)  # tiles for every row count
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
