"""Step-invariant paged attention in plain torch: the torch backend when numerics are
deterministic (the default; see ``executor_svc.config.numerics``).

The SDPA path of ``torch_ops`` pads each sequence to its batch's longest and lets the fused
kernel pick its blocking by shape, so a row's bits can follow its co-runners. Here every query
row is computed by the same sequence of elementwise ops and fixed-order sums whatever else is in
the step:

- dot products and the weighted sum of V are ``cumsum``'s last element: ATen's CPU cumsum adds
  each line in order (in double) whatever the tensor's shape or the thread count, and keys past
  a row's position add an exact zero;
- the row max is exact in any order; ``exp`` and the final division are elementwise (the
  position-independence of torch's vectorised ``exp`` is checked by
  tests/unit/test_invariance_ops.py).

It materialises [tokens, heads, keys, head_dim] products, a chunk of query rows at a time:
slow, and meant for the reference backend and for CPUs without a C++ compiler.
"""

from __future__ import annotations

import torch

# Query rows per chunk are sized so one chunk's products stay under this many elements.
_CHUNK_ELEMENTS = 1 << 22


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Same contract as ``torch_ops.paged_attention``; one sequence at a time."""
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    flat_k = key_cache.view(-1, num_kv_heads, head_dim)
    flat_v = value_cache.view(-1, num_kv_heads, head_dim)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    device = query.device
    for i, seq_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        if start == end:
            continue
        num_blocks = -(-seq_len // block_size)
        offsets = torch.arange(block_size, device=device)
        slots = (block_tables[i, :num_blocks].long()[:, None] * block_size + offsets).reshape(-1)
        slots = slots[:seq_len]
        # [heads, keys, head_dim] and [heads, head_dim, keys]: exact copies, GQA heads repeated.
        k = flat_k.index_select(0, slots).float().repeat_interleave(group, dim=1)
        k = k.permute(1, 0, 2).contiguous()
        v = flat_v.index_select(0, slots).float().repeat_interleave(group, dim=1)
        v = v.permute(1, 2, 0).contiguous()
        key_pos = torch.arange(seq_len, device=device)
        first_pos = seq_len - (end - start)
        rows = max(1, _CHUNK_ELEMENTS // (num_heads * seq_len * head_dim))
        for t0 in range(start, end, rows):
            t1 = min(end, t0 + rows)
            q = query[t0:t1].float() * scale  # [T, H, D]
            scores = (q[:, :, None, :] * k[None]).cumsum(-1)[..., -1]  # [T, H, L]
            pos = torch.arange(t0 - start, t1 - start, device=device) + first_pos
            scores.masked_fill_((key_pos[None, :] > pos[:, None])[:, None, :], float("-inf"))
            p = (scores - scores.amax(dim=-1, keepdim=True)).exp_()  # exp(-inf) = 0
            total = p.cumsum(-1)[..., -1:]  # [T, H, 1]
            acc = (p[:, :, None, :] * v[None]).cumsum(-1)[..., -1]  # [T, H, D]
            out[t0:t1] = (acc / total).to(out.dtype)
    return out
