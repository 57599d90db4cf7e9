#!/usr/bin/env python3
"""The CPU kernel library's variants against each other, kernel by kernel, one thread:
SmolLM-135M shapes (9 query / 3 KV heads, head_dim 64, block 16; hidden 576, MLP 1536,
vocabulary 49 152). Run once per variant (``$LLMSERVE_CPU_ISA`` picks it) and compare the
columns; ``--tree`` puts another checkout's ``executor_svc`` first (a before/after run
alternates trees in one shell loop).

    LLMSERVE_CPU_ISA=avx2 taskset -c 1 .venv/bin/python benchmarks/bench_kernel_variants.py
    LLMSERVE_CPU_ISA=avx512 taskset -c 1 .venv/bin/python benchmarks/bench_kernel_variants.py
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path


def timed(fn: Callable[[], object], seconds: float) -> float:
    """Mean ms of fn over about `seconds` (after one warm-up call)."""
    fn()
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--seconds", type=float, default=1.0)
    args = ap.parse_args()
    sys.path.insert(0, args.tree)
    sys.path.insert(1, str(Path(__file__).resolve().parent))
    import importlib

    import torch

    from executor_svc.attention import cpu_ops  # noqa: PLC0415
    from executor_svc.kernels import elementwise, gemm_bf16, library, sampling  # noqa: PLC0415

    # After executor_svc is imported from --tree (the helper puts its own tree first on the path).
    batch = importlib.import_module("bench_cpu_attention").batch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    assert library.available(), "no kernel library"
    t = args.seconds
    cases: list[tuple[str, Callable[[], object]]] = []
    q, kc, vc, table, sl, qsl = batch([512], [512])
    cases.append(("causal prompt attention, 512 tokens", lambda: cpu_ops.paged_attention(
        q, kc, vc, table, sl, qsl, 0.125)))  # fmt: skip
    dq, dkc, dvc, dt, dsl, dqsl = batch([1] * 8, [1024] * 8)
    cases.append(("decode attention, 8 x 1024 keys", lambda: cpu_ops.paged_attention(
        dq, dkc, dvc, dt, dsl, dqsl, 0.125)))  # fmt: skip
    bkc, bvc = dkc.bfloat16(), dvc.bfloat16()
    cases.append(("decode attention, bf16 KV, 8 x 1024 keys", lambda: cpu_ops.paged_attention(
        dq, bkc, bvc, dt, dsl, dqsl, 0.125)))  # fmt: skip
    pkc, pvc = kc.bfloat16(), vc.bfloat16()
    cases.append(("causal prompt attention, bf16 KV, 512 tokens", lambda: cpu_ops.paged_attention(
        q, pkc, pvc, table, sl, qsl, 0.125)))  # fmt: skip
    logits = torch.randn(64, 49152)
    cases.append(("argmax + logsumexp 64 x 49152", lambda: sampling.argmax_logsumexp(logits)))
    gate_up = torch.randn(64, 2 * 1536)
    cases.append(("silu * mul 64 x 1536", lambda: elementwise.silu_mul(gate_up)))
    h, d, nw = torch.randn(64, 576), torch.randn(64, 576), torch.rand(576)
    cases.append(("add + rms_norm 64 x 576", lambda: elementwise.add_rms_norm(h, d, nw, 1e-6)))
    gb, hb, db, nwb = gate_up.bfloat16(), h.bfloat16(), d.bfloat16(), nw.bfloat16()
    cases.append(("silu * mul bf16 64 x 1536", lambda: elementwise.silu_mul(gb)))
    cases.append(
        ("add + rms_norm bf16 64 x 576", lambda: elementwise.add_rms_norm(hb, db, nwb, 1e-6))
    )
    w = gemm_bf16.pack((torch.randn(576, 1536) * 0.05).bfloat16())
    for m in (1, 64):
        x = torch.randn(m, 576).bfloat16()
        cases.append((f"bf16 GEMM {m} x 576 x 1536", lambda x=x: w.linear(x, None)))
    print(f"variant {library.variant()}, tree {args.tree}")
    for name, fn in cases:
        print(f"| {name} | {timed(fn, t):.3f} |", flush=True)


if __name__ == "__main__":
    main()
