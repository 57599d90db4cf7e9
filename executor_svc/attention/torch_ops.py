"""Paged-attention reference ops in plain torch: the CPU backend and the oracle for Triton.

Layout (see docs/internals.md): the cache is ``[num_blocks, block_size, num_kv_heads, head_dim]``
per layer; ``slot = block_id * block_size + offset``. A batch is flattened: sequence ``i`` owns
query rows ``query_start_loc[i] : query_start_loc[i + 1]`` and those rows are the *last* ``q_len``
positions of its ``seq_lens[i]`` tokens, whose K/V are already in the cache.

With step-invariant numerics on (``executor_svc.config.numerics``, the default) ``paged_attention``
and ``attend`` go to ``torch_invariant``: every row computed the same way whatever its
co-runners. Off, ``paged_attention`` is vectorised: decode rows (one query token) of all sequences are handled by
one gather + one ``scaled_dot_product_attention``, and the remaining (prefill / chunked-prefill) sequences by one
padded gather + one masked ``scaled_dot_product_attention``. ``paged_attention_naive`` is the
obviously-correct per-sequence, per-token loop used by tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

import executor_svc.attention.torch_invariant as torch_invariant
from executor_svc.config import numerics

if TYPE_CHECKING:
    from executor_svc.attention.metadata import AttentionMetadata


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = skip
) -> None:
    """Store each token's K/V at its slot; tokens with slot -1 are not written."""
    assert key.shape == value.shape and key.dim() == 3
    assert key_cache.shape == value_cache.shape and key_cache.shape[2:] == key.shape[1:]
    assert slot_mapping.shape == (key.shape[0],)
    _write_kv(key, value, key_cache, value_cache, slot_mapping, bool((slot_mapping < 0).any()))


def _write_kv(key, value, key_cache, value_cache, slot_mapping, has_skips: bool) -> None:
    num_kv_heads, head_dim = key.shape[1:]
    slots = slot_mapping.long()
    # Boolean indexing copies K and V, so it only runs when some slot really is -1.
    if has_skips:
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    # A flat view shares storage with the cache, so index_copy_ writes in place.
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value.to(value_cache.dtype))


def _gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [n, max_num_blocks]
    num_blocks: int,
) -> torch.Tensor:  # [n, num_blocks * block_size, num_kv_heads, head_dim]
    """Contiguous K or V of the first ``num_blocks`` logical blocks of each sequence."""
    return _gather(cache, _clamped_table(block_tables, num_blocks, cache.shape[0]))


def _clamped_table(block_tables: torch.Tensor, num_blocks: int, num_cache_blocks: int):
    # Padding entries are arbitrary (possibly -1 or out of range); their positions are masked,
    # so any in-range block will do.
    return block_tables[:, :num_blocks].long().clamp(0, num_cache_blocks - 1)  # [n, nb]


def _gather(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    gathered = cache.index_select(0, table.reshape(-1))  # [n * nb, block_size, kvh, d]
    return gathered.view(table.shape[0], table.shape[1] * cache.shape[1], *cache.shape[2:])


# Decode batches whose padded gather (every sequence padded to the longest) would read more than
# this many times the blocks they hold are split into buckets of similar length.
_BUCKET_WASTE = 1.5


@dataclass(slots=True)
class DecodeBucket:
    """Sequences of a decode batch attended together, padded to the longest of them."""

    rows: torch.Tensor | None  # [m] int64 rows of the batch; None = all of them, in order
    table: torch.Tensor  # [m, num_blocks] int64, in range
    valid: torch.Tensor  # [m, 1, 1, num_blocks * block_size] bool: position < seq_len


@dataclass(slots=True)
class DecodePlan:
    """What decode attention derives from the metadata alone; the same for every layer.

    The gather pads every sequence of a bucket to the bucket's longest context, so a batch
    mixing short and long contexts (a 2k-token sequence among 200-token ones) would read the
    cache as if every sequence were long: it is split by powers of two of the block count, which
    bounds the padding to 2x at a few more, smaller attention calls.
    """

    buckets: list[DecodeBucket]


def _bucket(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    rows: torch.Tensor | None,
    num_blocks: int,
    block_size: int,
    num_cache_blocks: int,
) -> DecodeBucket:
    if rows is not None:
        block_tables, seq_lens = block_tables[rows], seq_lens[rows]
    pos = torch.arange(num_blocks * block_size, device=seq_lens.device)
    valid = pos[None, :] < seq_lens[:, None].to(pos.dtype)  # [m, L]
    return DecodeBucket(
        rows=rows,
        table=_clamped_table(block_tables, num_blocks, num_cache_blocks),
        valid=valid[:, None, None, :],
    )


def plan_decode(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, num_cache_blocks: int
) -> DecodePlan:
    lens = seq_lens.tolist()
    blocks = [-(-n // block_size) for n in lens]
    max_blocks = max(blocks)
    if len(blocks) * max_blocks <= _BUCKET_WASTE * sum(blocks):
        # Similar lengths (the common case): one gather and one attention call.
        return DecodePlan(
            [_bucket(block_tables, seq_lens, None, max_blocks, block_size, num_cache_blocks)]
        )
    groups: dict[int, list[int]] = {}
    for i, b in enumerate(blocks):
        groups.setdefault((b - 1).bit_length(), []).append(i)  # ceil(log2(blocks))
    buckets = []
    for members in groups.values():
        rows = torch.tensor(members, dtype=torch.long, device=seq_lens.device)
        num_blocks = max(blocks[i] for i in members)
        buckets.append(
            _bucket(block_tables, seq_lens, rows, num_blocks, block_size, num_cache_blocks)
        )
    return DecodePlan(buckets)


def _decode_attention(
    query: torch.Tensor,  # [n, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
) -> torch.Tensor:  # [n, num_heads, head_dim]
    if len(plan.buckets) == 1 and plan.buckets[0].rows is None:
        return _decode_bucket(query, key_cache, value_cache, plan.buckets[0], scale)
    out = torch.empty_like(query)
    for bucket in plan.buckets:
        out[bucket.rows] = _decode_bucket(
            query[bucket.rows], key_cache, value_cache, bucket, scale
        ).to(out.dtype)
    return out


def _decode_bucket(
    query: torch.Tensor,  # [m, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    bucket: DecodeBucket,
    scale: float,
) -> torch.Tensor:  # [m, num_heads, head_dim]
    n, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    k = _gather(key_cache, bucket.table)  # [m, L, kvh, d]
    v = _gather(value_cache, bucket.table)
    # GQA without repeating K/V: the `group` query heads sharing a KV head become that head's
    # query rows, so SDPA sees [m, kvh, group, d] against [m, kvh, L, d]. The transposed K/V
    # are strided views of the gather (no copy); the fused kernel reads them as they are.
    out = F.scaled_dot_product_attention(
        query.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=bucket.valid,
        scale=scale,
    )  # [m, kvh, group, d]
    return out.reshape(n, num_heads, head_dim)


def _prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim] (all tokens of the batch)
    row_seq: torch.Tensor,  # [m] indices of the sequences to handle
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,  # [num_seqs]
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written in place
) -> None:
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    device = query.device
    starts = query_start_loc[row_seq].long()
    q_lens = query_start_loc[row_seq + 1].long() - starts
    lens = seq_lens[row_seq].long()
    max_q = int(q_lens.max())
    num_blocks = -(-int(lens.max()) // block_size)
    k = _gather_context(key_cache, block_tables[row_seq], num_blocks)  # [m, L, kvh, d]
    v = _gather_context(value_cache, block_tables[row_seq], num_blocks)

    # Padded query [m, max_q]: rows past q_len read some valid row (clamped) and are dropped.
    j = torch.arange(max_q, device=device)
    valid_q = j[None, :] < q_lens[:, None]  # [m, max_q]
    rows = (starts[:, None] + j[None, :]).clamp(max=query.shape[0] - 1)
    q = query[rows]  # [m, max_q, H, d]
    q_pos = lens[:, None] - q_lens[:, None] + j[None, :]  # [m, max_q]
    k_pos = torch.arange(k.shape[1], device=device)
    # Causal within the sequence and never past its length. Position 0 is always allowed, so no
    # row is fully masked (that would give NaN).
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (
        k_pos[None, None, :] < lens[:, None, None]
    )
    attn = F.scaled_dot_product_attention(
        q.transpose(1, 2),  # [m, H, max_q, d]
        k.transpose(1, 2),  # [m, kvh, L, d]
        v.transpose(1, 2),
        attn_mask=mask[:, None],  # [m, 1, max_q, L]
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )  # [m, H, max_q, d]
    attn = attn.transpose(1, 2)  # [m, max_q, H, d]
    out[rows[valid_q]] = attn[valid_q].to(out.dtype)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of every query token over its sequence's paged K/V (GQA aware)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert key_cache.shape[3] == head_dim and value_cache.shape == key_cache.shape
    assert query_start_loc.shape == (num_seqs + 1,) and block_tables.shape[0] == num_seqs
    if num_tokens == 0:
        return torch.empty_like(query)
    if numerics.deterministic():
        return torch_invariant.paged_attention(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale
        )
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    is_decode = q_lens == 1
    if bool(is_decode.all()):
        # The steady state of serving: one token per sequence, rows already in sequence order.
        plan = plan_decode(block_tables, seq_lens, key_cache.shape[1], key_cache.shape[0])
        return _decode_attention(query, key_cache, value_cache, plan, scale).to(query.dtype)

    out = torch.empty_like(query)
    decode_seqs = is_decode.nonzero().squeeze(1)
    if decode_seqs.numel() > 0:
        rows = query_start_loc[decode_seqs].long()
        plan = plan_decode(
            block_tables[decode_seqs],
            seq_lens[decode_seqs],
            key_cache.shape[1],
            key_cache.shape[0],
        )
        out[rows] = _decode_attention(query[rows], key_cache, value_cache, plan, scale).to(
            query.dtype
        )
    prefill_seqs = (q_lens > 1).nonzero().squeeze(1)
    if prefill_seqs.numel() > 0:
        _prefill_attention(
            query,
            prefill_seqs,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            out,
        )
    return out


def attend(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """``write_kv`` then ``paged_attention`` for one layer, for the model's forward.

    Same results; what depends only on the metadata (any skipped slot? the decode plan) is
    computed by the first layer and kept in ``md.scratch`` for the others. At batch 1 that is
    a dozen small ops per layer, a few percent of a CPU decode step.
    """
    scratch = md.scratch
    has_skips = scratch.get("torch.has_skips")
    if has_skips is None:
        has_skips = scratch["torch.has_skips"] = bool((md.slot_mapping < 0).any())
    _write_kv(key, value, key_cache, value_cache, md.slot_mapping, has_skips)
    if md.max_query_len != 1 or numerics.deterministic():
        return paged_attention(
            query, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc, scale
        )
    plan = scratch.get("torch.decode_plan")
    if plan is None:
        plan = scratch["torch.decode_plan"] = plan_decode(
            md.block_tables, md.seq_lens, key_cache.shape[1], key_cache.shape[0]
        )
    return _decode_attention(query, key_cache, value_cache, plan, scale).to(query.dtype)


def paged_attention_naive(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as ``paged_attention``, one sequence and one query token at a time (tests)."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    for i in range(seq_lens.shape[0]):
        seq_len = int(seq_lens[i])
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        slots = [
            int(block_tables[i, p // block_size]) * block_size + p % block_size
            for p in range(seq_len)
        ]
        k = key_cache.reshape(-1, num_kv_heads, head_dim)[slots].float()  # [seq_len, kvh, d]
        v = value_cache.reshape(-1, num_kv_heads, head_dim)[slots].float()
        for t in range(start, end):
            pos = seq_len - (end - start) + (t - start)
            for h in range(num_heads):
                kh = k[: pos + 1, h // group]  # [pos + 1, d]
                vh = v[: pos + 1, h // group]
                scores = (kh @ query[t, h].float()) * scale
                out[t, h] = (torch.softmax(scores, dim=0) @ vh).to(query.dtype)
    return out
