"""The vectorised torch paged attention agrees with the per-token loop and with dense attention."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from executor_svc.attention import AttentionMetadata, get_attention_backend
from executor_svc.attention.torch_ops import paged_attention, paged_attention_naive, write_kv


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 16,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
):
    """A paged cache holding every sequence's full context, scattered over shuffled blocks.

    Returns (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, dense_kv),
    where dense_kv[i] = (k, v) of sequence i as contiguous [seq_len, kvh, d] tensors.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(blocks_per_seq) + 1
    # Padding entries are deliberately out of range: the ops must ignore them.
    block_tables = torch.full((len(seq_lens), max_blocks), 10_000, dtype=torch.int32)
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    key_cache, value_cache = key_cache.to(dtype), value_cache.to(dtype)
    dense_kv = []
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        table = [perm.pop() for _ in range(nb)]
        block_tables[i, :nb] = torch.tensor(table, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(n)]
        )
        write_kv(k, v, key_cache, value_cache, slots)
        dense_kv.append((k, v))
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return (
        query,
        key_cache,
        value_cache,
        block_tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        qsl,
        dense_kv,
    )


def dense_reference(query, qsl, dense_kv, scale):
    """Contiguous causal attention per sequence, K/V repeated for GQA."""
    outs = []
    for i, (k, v) in enumerate(dense_kv):
        q = query[qsl[i] : qsl[i + 1]].float()  # [q_len, H, d]
        q_len, num_heads = q.shape[:2]
        group = num_heads // k.shape[1]
        kr = k.float().repeat_interleave(group, dim=1)
        vr = v.float().repeat_interleave(group, dim=1)
        q_pos = torch.arange(k.shape[0] - q_len, k.shape[0])
        mask = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), kr.transpose(0, 1), vr.transpose(0, 1), attn_mask=mask, scale=scale
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def run_both(batch, scale):
    query, kc, vc, bt, sl, qsl, dense = batch
    fast = paged_attention(query, kc, vc, bt, sl, qsl, scale)
    naive = paged_attention_naive(query, kc, vc, bt, sl, qsl, scale)
    return fast, naive, dense_reference(query, qsl, dense, scale)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_mixed_prefill_and_decode_match_naive_and_dense(block_size):
    # Decodes with contexts just below/at/above block boundaries, a full prefill, two chunks.
    q_lens = [1, 1, 1, 7, 1, 20, 5]
    seq_lens = [block_size, block_size + 1, 3, 7, 2 * block_size - 1, 45, 40]
    batch = make_batch(q_lens, seq_lens, block_size=block_size, seed=block_size)
    scale = 1 / math.sqrt(16)
    fast, naive, dense = run_both(batch, scale)
    assert fast.shape == naive.shape == (sum(q_lens), 4, 16)
    torch.testing.assert_close(naive, dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast, naive, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1), (9, 3)])
def test_decode_only_gqa(num_heads, num_kv_heads):
    seq_lens = [1, 5, 16, 17, 33, 64]
    batch = make_batch(
        [1] * len(seq_lens), seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads
    )
    fast, naive, dense = run_both(batch, 0.25)
    torch.testing.assert_close(naive, dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast, naive, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [24, 40])
def test_odd_head_dim_and_prefill_only(head_dim):
    q_lens, seq_lens = [9, 30, 2], [9, 41, 18]
    batch = make_batch(
        q_lens, seq_lens, num_heads=6, num_kv_heads=3, head_dim=head_dim, block_size=8
    )
    fast, naive, dense = run_both(batch, head_dim**-0.5)
    torch.testing.assert_close(naive, dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast, naive, atol=1e-5, rtol=1e-5)


def test_bfloat16_follows_float32_reference():
    q_lens, seq_lens = [1, 12, 1], [20, 12, 3]
    batch = make_batch(q_lens, seq_lens, dtype=torch.bfloat16)
    query, kc, vc, bt, sl, qsl, dense = batch
    fast = paged_attention(query, kc, vc, bt, sl, qsl, 0.25)
    assert fast.dtype == torch.bfloat16
    torch.testing.assert_close(
        fast.float(), dense_reference(query, qsl, dense, 0.25), atol=2e-2, rtol=2e-2
    )


def test_write_kv_skips_negative_slots_and_writes_in_place():
    key_cache = torch.zeros(3, 4, 2, 8)
    value_cache = torch.zeros(3, 4, 2, 8)
    key = torch.arange(3 * 2 * 8, dtype=torch.float32).view(3, 2, 8) + 1
    value = -key
    write_kv(key, value, key_cache, value_cache, torch.tensor([5, -1, 11]))
    assert torch.equal(key_cache[1, 1], key[0])  # slot 5 = block 1, offset 1
    assert torch.equal(value_cache[2, 3], value[2])  # slot 11 = block 2, offset 3
    assert int((key_cache != 0).any(dim=(2, 3)).sum()) == 2  # the skipped token wrote nothing


def test_backend_selection():
    backend = get_attention_backend("torch", "cpu")
    assert backend.name == "torch" and backend.paged_attention is paged_attention
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash", "cpu")


@pytest.mark.parametrize("q_lens", [[1, 1, 1, 1], [1, 6, 1, 3]])
def test_attend_reuses_per_forward_work_with_identical_results(q_lens):
    """The model's fused entry point equals write_kv + paged_attention, layer after layer."""
    seq_lens = [9, 17, 30, 4]
    query, kc, vc, bt, sl, qsl, _ = make_batch(q_lens, seq_lens, block_size=8)
    g = torch.Generator().manual_seed(7)
    key = torch.randn(sum(q_lens), 2, 16, generator=g)
    value = torch.randn(sum(q_lens), 2, 16, generator=g)
    rows = torch.arange(sum(q_lens))
    seq_of_row = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    pos = sl.long()[seq_of_row] - (qsl[1:].long()[seq_of_row] - rows)
    slots = bt.long()[seq_of_row, pos // 8] * 8 + pos % 8
    slots[0] = -1  # one skipped token: its cached K/V (from make_batch) stays
    md = AttentionMetadata(slots, bt, sl, qsl, max(q_lens), max(seq_lens))
    backend = get_attention_backend("torch", "cpu")
    kc2, vc2 = kc.clone(), vc.clone()
    for _ in range(2):  # the second "layer" runs on the memo the first one left
        got = backend.attend(query, key, value, kc, vc, md, 0.25)
        write_kv(key, value, kc2, vc2, slots)
        want = paged_attention(query, kc2, vc2, bt, sl, qsl, 0.25)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert "torch.has_skips" in md.scratch


def test_decode_buckets_bound_the_padding_and_match_naive():
    from executor_svc.attention.torch_ops import plan_decode

    # One long context among short ones: one padded gather would read 9 x 40 blocks.
    seq_lens = [3, 17, 20, 30, 33, 40, 64, 70, 640]
    batch = make_batch([1] * len(seq_lens), seq_lens, num_heads=6, num_kv_heads=2, seed=3)
    query, key_cache, value_cache, block_tables, lens, qsl = batch[:6]
    plan = plan_decode(block_tables, lens, 16, key_cache.shape[0])
    gathered = sum(b.table.numel() for b in plan.buckets)
    held = sum(-(-n // 16) for n in seq_lens)
    assert len(plan.buckets) > 1 and gathered <= 2 * held
    fast = paged_attention(query, key_cache, value_cache, block_tables, lens, qsl, 0.25)
    naive = paged_attention_naive(query, key_cache, value_cache, block_tables, lens, qsl, 0.25)
    torch.testing.assert_close(fast, naive, atol=1e-5, rtol=1e-5)
    # Similar lengths keep the single gather over all rows.
    uniform = plan_decode(block_tables[:3], lens[:3], 16, key_cache.shape[0])
    assert len(uniform.buckets) == 1 and uniform.buckets[0].rows is None
