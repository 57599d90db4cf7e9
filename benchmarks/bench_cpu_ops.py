#!/usr/bin/env python3
"""The CPU kernel library's smaller ops against what they replace, one thread, SmolLM-135M
shapes: whole-prompt causal attention (the paged kernel against torch's fused SDPA on the fresh
K/V), the sampler's argmax + logsumexp over 64 x 49 152 logits, the MLP's silu(gate) * up and
RMSNorm after the residual add, at 1 and 64 rows.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_cpu_ops.py
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cpu_attention import KVH, D, H, batch  # noqa: E402

from executor_svc.attention import cpu_ops  # noqa: E402
from executor_svc.kernels import elementwise, sampling  # noqa: E402


def timed(fn: Callable[[], object], iters: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e3


def row(name: str, ours: float, theirs: float) -> None:
    print(f"| {name} | {ours:.3f} | {theirs:.3f} | {theirs / ours:.2f} |", flush=True)


def main() -> None:
    torch.set_num_threads(1)
    assert cpu_ops.available(), "no C++ compiler: the kernel library is not available"
    print("| case | kernel ms | torch ms | torch / kernel |")
    print("|---|---:|---:|---:|")
    for n in (256, 512, 1024, 2048):
        q, kc, vc, table, sl, qsl = batch([n], [n])
        k, v = torch.randn(n, KVH, D), torch.randn(n, KVH, D)

        def sdpa(q=q, k=k, v=v) -> torch.Tensor:
            return F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=True, scale=D**-0.5, enable_gqa=True,
            )  # fmt: skip

        args = (q, kc, vc, table, sl, qsl, D**-0.5)
        row(f"causal prompt {n} ({H} heads)", timed(lambda a=args: cpu_ops.paged_attention(*a), 5),
            timed(sdpa, 5))  # fmt: skip
    logits = torch.randn(64, 49152)
    row("argmax + logsumexp 64 x 49152", timed(lambda: sampling.argmax_logsumexp(logits), 50),
        timed(lambda: (logits.argmax(-1), torch.logsumexp(logits, -1)), 50))  # fmt: skip
    w = torch.randn(576)
    for rows in (1, 64, 2048):
        gate_up = torch.randn(rows, 2 * 1536)
        row(f"silu * mul {rows} x 1536", timed(lambda g=gate_up: elementwise.silu_mul(g), 200),
            timed(lambda g=gate_up: F.silu(g[:, :1536]) * g[:, 1536:], 200))  # fmt: skip
        x, delta = torch.randn(rows, 576), torch.randn(rows, 576)
        row(f"add + rms_norm {rows} x 576",
            timed(lambda x=x, d=delta: elementwise.add_rms_norm(x, d, w, 1e-5), 200),
            timed(lambda x=x, d=delta: F.rms_norm(x + d, (576,), w, 1e-5), 200))  # fmt: skip


if __name__ == "__main__":
    main()
