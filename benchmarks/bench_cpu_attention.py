#!/usr/bin/env python3
"""One layer's paged attention on the CPU, one thread: the compiled kernel (backend ``cpu``)
against the torch ops, SmolLM-135M heads (9 query, 3 KV, head_dim 64), block size 16.

Cases: decodes of 64 x 193 and 16 x 513 tokens and a 512-token prefill on a cache holding just
those blocks (hot); decodes of 64 x 193 and 64 x 1089 on a 4 096- or 8 192-block cache (3-6 GB
over 30 layers in a real executor; here one layer, blocks drawn at random, and once more each
sequence's blocks adjacent) with a matmul in between that evicts the caches, as the layers'
weights do in a forward; and the shared-prefix
workload's shapes: 64 decodes whose first 1 024 tokens are the same blocks, and 63 chunks of 32
tokens after that shared 1 024 (the step that admits them).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_cpu_attention.py [--kernel-only] \
        [--cases prefill,shared] [--bf16]

``--bf16``: the cache in bf16 (what a bf16 model keeps; the kernel's bf16-K/V build), the
query in fp32 as the backend hands it over.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor_svc.attention import cpu_ops, torch_ops  # noqa: E402

H, KVH, D, BS = 9, 3, 64, 16


def batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_blocks: int | None = None,
    shared: int = 0,
    contiguous: bool = False,
):
    per = [-(-n // BS) for n in seq_lens]
    num_blocks = num_blocks or sum(per)
    table = torch.zeros(len(seq_lens), max(per), dtype=torch.int32)
    ids = (torch.arange(num_blocks) if contiguous else torch.randperm(num_blocks))[: sum(per)]
    ids = ids.to(torch.int32)
    start = 0
    for i, n in enumerate(per):
        table[i, :n] = ids[start : start + n]
        start += n
    kc, vc = torch.randn(num_blocks, BS, KVH, D), torch.randn(num_blocks, BS, KVH, D)
    if "--bf16" in sys.argv[1:]:
        kc, vc = kc.bfloat16(), vc.bfloat16()
    if shared:  # every sequence's first `shared` blocks are the first sequence's (a system prompt)
        table[1:, :shared] = table[0, :shared]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), H, D)
    return q, kc, vc, table, torch.tensor(seq_lens, dtype=torch.int32), qsl


def timed(fn, between=None, iters: int = 20) -> float:
    fn()
    total = 0.0
    for _ in range(iters):
        if between is not None:
            between()
        start = time.perf_counter()
        fn()
        total += time.perf_counter() - start
    return total / iters * 1e3


def main() -> None:
    torch.set_num_threads(1)
    assert cpu_ops.available(), "no C++ compiler: the cpu backend is not available"
    cases = {
        "decode 64 x 193": ([1] * 64, [193] * 64, None),
        "decode 16 x 513": ([1] * 16, [513] * 16, None),
        "prefill 512": ([512], [512], None),
        "decode 64 x 193, 4096-block cache, evicted": ([1] * 64, [193] * 64, 4096),
        # the same with each sequence's blocks adjacent (the hardware prefetcher follows them)
        "decode 64 x 193, 4096-block cache, evicted, contiguous tables": (
            [1] * 64,
            [193] * 64,
            4096,
            0,
            True,
        ),  # fmt: skip
        "decode 64 x 1089, 8192-block cache, evicted": ([1] * 64, [1089] * 64, 8192),
        "decode 64 x 1089, first 1024 shared": ([1] * 64, [1089] * 64, 8192, 64),
        "chunks 63 x 32 after a shared 1024": ([32] * 63, [1056] * 63, 8192, 64),
    }
    w, x = torch.randn(576, 3072), torch.randn(64, 576)

    def evict() -> None:
        for _ in range(3):
            x @ w

    kernel_only = "--kernel-only" in sys.argv[1:]
    # --cases WORD[,WORD...]: only the cases whose name contains one of the words
    if "--cases" in sys.argv[1:]:
        words = sys.argv[sys.argv.index("--cases") + 1].split(",")
        cases = {k: v for k, v in cases.items() if any(w in k for w in words)}
    print("| case | kernel ms | torch ops ms | kernel GFLOP/s |")
    print("|---|---:|---:|---:|")
    for name, (q_lens, seq_lens, blocks, *shared) in cases.items():
        args = (*batch(q_lens, seq_lens, blocks, *shared), D**-0.5)
        between = evict if blocks else None
        ours = timed(lambda a=args: cpu_ops.paged_attention(*a), between)
        ref = (
            float("nan")
            if kernel_only
            else timed(lambda a=args: torch_ops.paged_attention(*a), between, iters=5)
        )
        flops = sum(
            4 * D * H * q * (n - q + 1 + n) / 2 for q, n in zip(q_lens, seq_lens, strict=True)
        )
        print(f"| {name} | {ours:.2f} | {ref:.2f} | {flops / ours / 1e6:.1f} |")


if __name__ == "__main__":
    main()
