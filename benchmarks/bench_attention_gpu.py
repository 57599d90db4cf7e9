"""Decode attention on CUDA: the Triton kernel against the torch reference.

    .venv/bin/python benchmarks/bench_attention_gpu.py [--dtype bf16] [--heads 32 --kv-heads 8]

Each batch has `batch` sequences of `context` tokens, one new query token each, spread over
shuffled cache blocks. Reports median milliseconds per call and the Triton kernel's effective
K/V read bandwidth.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_decode_batch(
    batch: int,
    context: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
) -> tuple:
    """Arguments of paged_attention for `batch` decodes over `context` cached tokens."""
    device = torch.device("cuda")
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    key_cache = torch.randn(
        num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
    )
    value_cache = torch.randn_like(key_cache)
    # Shuffled so consecutive positions of a sequence live in scattered blocks, as in serving.
    block_tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int()
    query = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
    return query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, head_dim**-0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024, 2048])
    args = parser.parse_args()

    if not torch.cuda.is_available():
        sys.exit("bench_attention_gpu: no CUDA device found; this benchmark needs a GPU.")

    import triton.testing

    from executor_svc.attention import torch_ops, triton_ops

    dtype = DTYPES[args.dtype]
    print(
        f"# {torch.cuda.get_device_name()}  {args.dtype}  heads={args.heads} "
        f"kv_heads={args.kv_heads} head_dim={args.head_dim} block_size={args.block_size}"
    )
    print(
        f"{'batch':>5} {'context':>7} {'torch ms':>9} {'triton ms':>9} {'speedup':>7} {'GB/s':>7}"
    )
    for batch in args.batches:
        for context in args.contexts:
            inputs = make_decode_batch(
                batch,
                context,
                args.heads,
                args.kv_heads,
                args.head_dim,
                args.block_size,
                dtype,
            )
            # The model runner knows max_query_len on the host, so the Triton op needs no device
            # sync; the torch reference synchronises internally (part of its cost).
            run_torch = functools.partial(torch_ops.paged_attention, *inputs)
            run_triton = functools.partial(triton_ops.paged_attention, *inputs, max_query_len=1)
            torch_ms = triton.testing.do_bench(run_torch)
            triton_ms = triton.testing.do_bench(run_triton)
            max_err = (run_triton().float() - run_torch().float()).abs().max().item()
            assert max_err < 5e-2, (
                f"results differ (max abs error {max_err}) at {batch=} {context=}"
            )
            kv_bytes = (
                2 * batch * context * args.kv_heads * args.head_dim * inputs[1].element_size()
            )
            print(
                f"{batch:>5} {context:>7} {torch_ms:>9.3f} {triton_ms:>9.3f} "
                f"{torch_ms / triton_ms:>6.2f}x {kv_bytes / triton_ms / 1e6:>7.0f}"
            )


if __name__ == "__main__":
    main()
