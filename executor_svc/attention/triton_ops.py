"""Triton attention ops: KV-cache writes and paged attention over a flattened mixed batch.

Same signatures and semantics as `executor_svc.attention.torch_ops` (see docs/internals.md).
On CUDA the kernels are compiled; without CUDA they run in Triton's interpreter when
TRITON_INTERPRET=1 was set before this module was imported (tests/conftest.py does that).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from executor_svc.attention.metadata import AttentionMetadata
from executor_svc.attention.triton_write_kv import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_device,
    interpreting,
    write_kv,
)
from executor_svc.config import envs, numerics

__all__ = ["write_kv", "paged_attention", "attend"]

_LOG2E = 1.4426950408889634


def _use_fp32_dot(dtype: torch.dtype) -> bool:
    # The interpreter computes bf16 products wrongly, so it always multiplies in fp32. On a GPU
    # half-precision operands go to the tensor cores as they are (fp32 accumulation either way);
    # fp32 inputs use an IEEE fp32 dot so results match the torch reference, not TF32.
    return interpreting() or dtype == torch.float32


# --------------------------------------------------------------------------------------------
# paged_attention
# --------------------------------------------------------------------------------------------


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    partial_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_PAD] fp32, if NUM_SPLITS > 1
    partial_ml_ptr,  # [num_tokens, num_heads, NUM_SPLITS, 2] fp32: running max and sum
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    stride_bts,
    stride_btb,
    QUERY_GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # QUERY_GROUP rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two (>= 16 for tl.dot)
    BLOCK_SIZE: tl.constexpr,  # tokens per KV-cache block
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_N: tl.constexpr,  # KV positions per loop iteration
    FP32_DOT: tl.constexpr,
    NUM_SPLITS: tl.constexpr,  # > 1: each program covers one slice of the context (split-KV)
    MIN_SPLIT_LEN: tl.constexpr,  # no slice is shorter, so short contexts use few programs
):
    # One program = one sequence x one tile of its new query tokens x one KV head (x one
    # context slice). The tile's rows are (token, query head of this KV head) pairs, so every
    # K/V tile loaded from the cache serves the whole GQA group at once.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    tile_start = q_tile * BLOCK_Q
    if tile_start >= q_len:  # the grid is sized for the longest query in the batch
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    num_cached = seq_len - q_len

    ROWS: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, ROWS)
    q_idx = tile_start + rows // GROUP_PAD  # token index within this sequence's chunk
    head_in_group = rows % GROUP_PAD
    head = kv_head * QUERY_GROUP + head_in_group
    row_valid = (q_idx < q_len) & (head_in_group < QUERY_GROUP)
    q_pos = num_cached + q_idx  # absolute position: the causal limit of each row
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < HEAD_DIM
    tok = (q_begin + q_idx).to(tl.int64)

    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(
        query_ptr
        + tok[:, None] * stride_qt
        + head[:, None] * stride_qh
        + dims[None, :] * stride_qd,
        mask=q_mask,
        other=0.0,
    )  # [ROWS, HEAD_PAD]
    if FP32_DOT:
        q = q.to(tl.float32)

    # A finite floor instead of -inf keeps exp2(m_old - m_new) at 1, never NaN, for rows that
    # have seen only masked positions so far (padding rows, or tiles past a row's causal limit).
    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_PAD], dtype=tl.float32)

    # Nothing in this tile attends past its last token; later positions are never loaded.
    kv_end = tl.minimum(seq_len, num_cached + tile_start + BLOCK_Q)
    kv_begin = 0
    if NUM_SPLITS > 1:
        # Slices are whole KV tiles; trailing slices of a short context are empty and only
        # report (max, sum) = (floor, 0), which the reduction weighs as nothing.
        split_len = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        split_len = tl.maximum(split_len, MIN_SPLIT_LEN)
        kv_begin = split * split_len
        kv_end = tl.minimum(kv_end, kv_begin + split_len)
    kv_head_off = kv_head.to(tl.int64)
    for n_start in range(kv_begin, kv_end, BLOCK_N):
        pos = n_start + tl.arange(0, BLOCK_N)
        pos_valid = pos < kv_end
        # Positions resolve to cache slots one by one, so a tile may span several blocks and
        # any block size works. Padding entries of the block table are never read.
        block_id = tl.load(
            block_tables_ptr + seq * stride_bts + (pos // BLOCK_SIZE) * stride_btb,
            mask=pos_valid,
            other=0,
        ).to(tl.int64)
        offset = pos % BLOCK_SIZE
        kv_mask = pos_valid[:, None] & dim_valid[None, :]

        k = tl.load(
            key_cache_ptr
            + block_id[:, None] * stride_kcb
            + offset[:, None] * stride_kcs
            + kv_head_off * stride_kch
            + dims[None, :] * stride_kcd,
            mask=kv_mask,
            other=0.0,
        )  # [BLOCK_N, HEAD_PAD]
        if FP32_DOT:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale  # [ROWS, BLOCK_N] fp32
        causal = (pos[None, :] <= q_pos[:, None]) & pos_valid[None, :]
        s = tl.where(causal, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v = tl.load(
            value_cache_ptr
            + block_id[:, None] * stride_vcb
            + offset[:, None] * stride_vcs
            + kv_head_off * stride_vch
            + dims[None, :] * stride_vcd,
            mask=kv_mask,
            other=0.0,
        )  # [BLOCK_N, HEAD_PAD]
        if FP32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if NUM_SPLITS > 1:
        # Unnormalised partial results; _combine_splits_kernel merges the slices.
        part = (tok * tl.num_programs(1) * QUERY_GROUP + head) * NUM_SPLITS + split  # [ROWS]
        tl.store(
            partial_acc_ptr + part[:, None] * HEAD_PAD + dims[None, :],
            acc,
            mask=row_valid[:, None],
        )
        tl.store(partial_ml_ptr + part * 2, m_i, mask=row_valid)
        tl.store(partial_ml_ptr + part * 2 + 1, l_i, mask=row_valid)
    else:
        # Every real row attends at least to position 0, so l_i > 0 there; the guard covers
        # padding rows, whose results are discarded by the store mask.
        acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr
            + tok[:, None] * stride_ot
            + head[:, None] * stride_oh
            + dims[None, :] * stride_od,
            acc.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )


@triton.jit
def _combine_splits_kernel(
    out_ptr,
    partial_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_PAD] fp32
    partial_ml_ptr,  # [num_tokens, num_heads, NUM_SPLITS, 2] fp32
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = tok * tl.num_programs(1) + head
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_PAD)
    m = tl.load(partial_ml_ptr + (row * NUM_SPLITS + splits) * 2)
    l = tl.load(partial_ml_ptr + (row * NUM_SPLITS + splits) * 2 + 1)  # noqa: E741
    acc = tl.load(partial_acc_ptr + (row * NUM_SPLITS + splits)[:, None] * HEAD_PAD + dims[None, :])
    # Rescale every slice to the global max; slice 0 always holds position 0, so the total
    # weight is positive.
    weight = tl.exp2(m - tl.max(m, axis=0))
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l * weight, axis=0)
    tl.store(
        out_ptr + tok * stride_ot + head * stride_oh + dims * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_kv_splits(
    num_seqs: int, num_kv_heads: int, max_query_len: int, device: torch.device
) -> int:
    """How many context slices each (sequence, KV head) of a decode batch is cut into."""
    # Small decode batches give one program per (sequence, KV head): far fewer than the GPU has
    # SMs, each streaming a long context alone. Slicing the context fills the GPU at the cost
    # of a small reduction. Prefill tiles already give enough programs (and would need large
    # scratch), so only pure decode batches are split.
    if max_query_len != 1 or device.type != "cuda":
        return 1
    num_programs = num_seqs * num_kv_heads
    index = torch.cuda.current_device() if device.index is None else device.index
    splits = triton.next_power_of_2(triton.cdiv(2 * _num_sms(index), num_programs))
    return min(splits, 16) if splits >= 2 else 1


def _attention_config(head_dim: int, group: int, max_query_len: int) -> tuple[int, int, int, int]:
    """(HEAD_PAD, GROUP_PAD, BLOCK_Q, BLOCK_N) for a launch."""
    # tl.dot wants every dimension >= 16 on the GPU; the interpreter does not care, but the
    # same shapes are used there so CPU tests exercise what the GPU runs.
    head_pad = max(16, triton.next_power_of_2(head_dim))
    group_pad = triton.next_power_of_2(group)
    max_rows = 128 if head_pad <= 128 else 64
    min_q = max(1, 16 // group_pad)
    max_q = max(min_q, max_rows // group_pad)
    block_q = min(max(triton.next_power_of_2(max(max_query_len, 1)), min_q), max_q)
    # In the interpreter, small KV tiles make short test contexts cross several loop iterations.
    block_n = 16 if interpreting() else (64 if head_pad <= 128 else 32)
    return head_pad, group_pad, block_q, block_n


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, cached + new tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, cu_seqlens_q
    scale: float,
    *,
    max_query_len: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], dtype of query
    """Causal attention of each sequence's new tokens over its whole paged context.

    Prefill chunks (with or without cached context) and single-token decodes mix freely.
    `max_query_len` (longest query in the batch) sizes the grid; pass it to avoid a device sync.
    """
    assert query.dim() == 3, f"query must be [num_tokens, num_heads, head_dim], got {query.shape}"
    assert key_cache.dim() == 4, (
        f"key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {key_cache.shape}"
    )
    assert value_cache.shape == key_cache.shape, (
        f"value_cache {value_cache.shape} != key_cache {key_cache.shape}"
    )
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    assert cache_head_dim == head_dim, f"cache head_dim {cache_head_dim} != query {head_dim}"
    assert num_heads % num_kv_heads == 0, (
        f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}"
    )
    assert query.dtype in FLOAT_DTYPES, f"unsupported dtype {query.dtype}"
    assert key_cache.dtype == query.dtype and value_cache.dtype == query.dtype, (
        f"query {query.dtype} and caches {key_cache.dtype}/{value_cache.dtype} must share a dtype"
    )
    assert block_tables.dim() == 2, f"block_tables must be 2-D, got {block_tables.shape}"
    num_seqs = block_tables.shape[0]
    assert seq_lens.shape == (num_seqs,), f"seq_lens must be [{num_seqs}], got {seq_lens.shape}"
    assert query_start_loc.shape == (num_seqs + 1,), (
        f"query_start_loc must be [{num_seqs + 1}], got {tuple(query_start_loc.shape)}"
    )
    for name, t in (
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        assert t.dtype in INDEX_DTYPES, f"{name} must be int32, got {t.dtype}"
    # The kernel indexes these two with unit stride.
    assert seq_lens.stride(0) == 1 or num_seqs <= 1, "seq_lens must be contiguous"
    assert query_start_loc.stride(0) == 1, "query_start_loc must be contiguous"
    check_device(
        {"query": query, "key_cache": key_cache, "value_cache": value_cache,
         "block_tables": block_tables, "seq_lens": seq_lens, "query_start_loc": query_start_loc}
    )  # fmt: skip

    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    if max_query_len <= 0:
        return out

    group = num_heads // num_kv_heads
    # Experimental step-invariant mode (LLMSERVE_CUDA_INVARIANT=1, config/envs.py): one tile
    # height and no context split whatever the step holds,
    # so a position's attention is summed over the same KV tiles in the same order in a
    # decode, a chunk or a whole prefill (extra query rows only cost compute).
    fixed = query.is_cuda and numerics.deterministic() and envs.cuda_invariant()
    head_pad, group_pad, block_q, block_n = _attention_config(
        head_dim, group, 1 << 20 if fixed else max_query_len
    )
    num_splits = 1 if fixed else _num_kv_splits(num_seqs, num_kv_heads, max_query_len, query.device)
    partial_acc = partial_ml = out  # unused placeholders when the context is not split
    if num_splits > 1:
        partial_acc = torch.empty(
            (num_tokens, num_heads, num_splits, head_pad), dtype=torch.float32, device=query.device
        )
        partial_ml = torch.empty(
            (num_tokens, num_heads, num_splits, 2), dtype=torch.float32, device=query.device
        )
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q) * num_splits)
    _paged_attention_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        partial_acc,
        partial_ml,
        scale * _LOG2E,
        *query.stride(),
        *out.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *block_tables.stride(),
        QUERY_GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        FP32_DOT=_use_fp32_dot(query.dtype),
        NUM_SPLITS=num_splits,
        MIN_SPLIT_LEN=4 * block_n,
        # A 128 x 128 fp32 accumulator needs 8 warps to stay in registers; fp32 K/V tiles
        # need fewer pipeline stages to fit in shared memory.
        num_warps=8 if block_q * group_pad * head_pad >= 128 * 128 else 4,
        num_stages=2 if query.element_size() == 4 else 3,
    )
    if num_splits > 1:
        _combine_splits_kernel[(num_tokens, num_heads)](
            out,
            partial_acc,
            partial_ml,
            *out.stride(),
            HEAD_DIM=head_dim,
            HEAD_PAD=head_pad,
            NUM_SPLITS=num_splits,
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
    """One layer: K/V write, then attention sized by the host's ``md.max_query_len``. Without
    it ``paged_attention`` reads the longest query off the device: one sync per layer, and no
    CUDA graph could be captured around it."""
    write_kv(key, value, key_cache, value_cache, md.slot_mapping)
    return paged_attention(
        query,
        key_cache,
        value_cache,
        md.block_tables,
        md.seq_lens,
        md.query_start_loc,
        scale,
        max_query_len=md.max_query_len,
    )
