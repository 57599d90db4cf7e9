"""Triton attention kernels against the torch reference ops.

Without CUDA, tests/conftest.py sets TRITON_INTERPRET=1 so the kernels run in Triton's
interpreter on the CPU: shapes stay tiny. Tests marked `gpu` run the compiled kernels at
realistic sizes and skip without a CUDA device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch

pytest.importorskip("triton")

from executor_svc.attention import torch_ops, triton_ops  # noqa: E402

CPU = torch.device("cpu")
# Loose enough for one rounding of the output in half precision, tight enough to catch a
# wrong mask, a wrong block or a softmax that drops a tile.
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@dataclass
class Batch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim], K of the new tokens
    value: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    scale: float

    def attention_args(self) -> tuple:
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
        )


def make_batch(
    seqs: list[tuple[int, int]],  # (num_cached_tokens, num_new_tokens) per sequence
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: torch.device = CPU,
    seed: int = 0,
) -> Batch:
    """A flattened batch whose cached context is already in a paged cache.

    Physical blocks are shuffled so a sequence's blocks are neither contiguous nor ordered, and
    block-table padding holds -1 so that reading it would fault rather than pass silently.
    """
    gen = torch.Generator().manual_seed(seed)
    num_blocks_per_seq = [math.ceil((c + n) / block_size) for c, n in seqs]
    num_blocks = sum(num_blocks_per_seq) + 3  # spare blocks must stay untouched
    max_num_blocks = max(num_blocks_per_seq) + 1
    perm = torch.randperm(num_blocks, generator=gen).tolist()

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    key_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)
    value_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)
    block_tables = torch.full((len(seqs), max_num_blocks), -1, dtype=torch.int32)
    slots = []
    for i, ((num_cached, num_new), nb) in enumerate(zip(seqs, num_blocks_per_seq, strict=True)):
        block_tables[i, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
        perm = perm[nb:]
        for pos in range(num_cached, num_cached + num_new):
            slots.append(int(block_tables[i, pos // block_size]) * block_size + pos % block_size)
    num_tokens = len(slots)
    q_lens = torch.tensor([n for _, n in seqs], dtype=torch.int32)
    return Batch(
        query=randn(num_tokens, num_heads, head_dim),
        key=randn(num_tokens, num_kv_heads, head_dim),
        value=randn(num_tokens, num_kv_heads, head_dim),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32, device=device),
        query_start_loc=torch.cat([q_lens.new_zeros(1), q_lens.cumsum(0).int()]).to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        scale=head_dim**-0.5,
    )


def run_step(batch: Batch, ops) -> torch.Tensor:
    """One attention layer step with `ops`: write the new K/V, then attend (on copies)."""
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
    ops.write_kv(batch.key, batch.value, key_cache, value_cache, batch.slot_mapping)
    return ops.paged_attention(
        batch.query,
        key_cache,
        value_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        batch.scale,
    )


def reference_step(batch: Batch) -> torch.Tensor:
    # The naive loop computes in fp32 one token and one head at a time: the clearest oracle.
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
    torch_ops.write_kv(batch.key, batch.value, key_cache, value_cache, batch.slot_mapping)
    return torch_ops.paged_attention_naive(
        batch.query,
        key_cache,
        value_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        batch.scale,
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(
        actual.float(), expected.float(), atol=ATOL[expected.dtype], rtol=ATOL[expected.dtype]
    )


# --------------------------------------------------------------------------------------------
# write_kv
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_kv_stores_every_token_at_its_slot(dtype: torch.dtype) -> None:
    batch = make_batch([(0, 5), (11, 3), (7, 1)], head_dim=40, block_size=8, dtype=dtype)
    expected_k, expected_v = batch.key_cache.clone(), batch.value_cache.clone()
    torch_ops.write_kv(batch.key, batch.value, expected_k, expected_v, batch.slot_mapping)
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()

    triton_ops.write_kv(batch.key, batch.value, key_cache, value_cache, batch.slot_mapping)

    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)
    flat_k = key_cache.view(-1, *key_cache.shape[2:])
    assert torch.equal(flat_k[batch.slot_mapping], batch.key)


def test_write_kv_skips_negative_slots() -> None:
    batch = make_batch([(0, 6)], num_kv_heads=3, head_dim=8, block_size=8)
    slot_mapping = batch.slot_mapping.clone()
    slot_mapping[[1, 4]] = -1
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()

    triton_ops.write_kv(batch.key, batch.value, key_cache, value_cache, slot_mapping)

    flat_k = key_cache.view(-1, *key_cache.shape[2:])
    flat_v = value_cache.view(-1, *value_cache.shape[2:])
    kept = slot_mapping >= 0
    assert torch.equal(flat_k[slot_mapping[kept]], batch.key[kept])
    assert torch.equal(flat_v[slot_mapping[kept]], batch.value[kept])
    # The skipped tokens' slots keep their old contents, as does every other slot.
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slot_mapping[kept]] = False
    old_k = batch.key_cache.view(-1, *key_cache.shape[2:])
    assert torch.equal(flat_k[untouched], old_k[untouched])


def test_write_kv_accepts_strided_key_and_value() -> None:
    # Models split a fused qkv projection into views; the kernel reads them through strides.
    batch = make_batch([(3, 4)], num_kv_heads=2, head_dim=16, block_size=16)
    kv = torch.randn(batch.key.shape[0], 4, 16)
    key, value = kv[:, :2], kv[:, 2:]
    expected_k, expected_v = batch.key_cache.clone(), batch.value_cache.clone()
    torch_ops.write_kv(key, value, expected_k, expected_v, batch.slot_mapping)
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()

    triton_ops.write_kv(key, value, key_cache, value_cache, batch.slot_mapping)

    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


# --------------------------------------------------------------------------------------------
# paged_attention
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_across_block_boundaries(block_size: int) -> None:
    # Context lengths just below, at and just past block (and 16-wide KV tile) boundaries.
    lens = [1, block_size - 1, block_size, block_size + 1, 2 * block_size + 3]
    batch = make_batch([(n - 1, 1) for n in lens], block_size=block_size, seed=block_size)
    assert_close(run_step(batch, triton_ops), reference_step(batch))


@pytest.mark.parametrize("head_dim", [8, 40, 48, 72, 80])
def test_odd_head_dims(head_dim: int) -> None:
    batch = make_batch([(0, 3), (9, 1)], num_heads=2, num_kv_heads=1, head_dim=head_dim)
    assert_close(run_step(batch, triton_ops), reference_step(batch))


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads"),
    [(2, 2), (4, 1), (6, 2), (8, 2)],  # MHA, MQA, a group of 3 (padded to 4), a group of 4
)
def test_grouped_query_attention(num_heads: int, num_kv_heads: int) -> None:
    batch = make_batch([(5, 4), (20, 1)], num_heads=num_heads, num_kv_heads=num_kv_heads)
    assert_close(run_step(batch, triton_ops), reference_step(batch))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_batch_of_prefills_chunks_and_decodes(dtype: torch.dtype) -> None:
    seqs = [
        (0, 19),  # first prefill chunk: causal within the chunk only
        (13, 1),  # decode
        (21, 6),  # chunked prefill: new chunk after cached context
        (0, 1),  # one-token prompt
        (40, 1),  # decode over several blocks
        (8, 17),  # chunk longer than one query tile, starting on a block boundary
    ]
    batch = make_batch(seqs, num_heads=4, num_kv_heads=2, head_dim=24, block_size=8, dtype=dtype)
    assert_close(run_step(batch, triton_ops), reference_step(batch))


def test_half_precision_tensor_core_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a GPU fp16/bf16 operands feed tl.dot directly; the interpreter is exact for fp16, so
    # that path is checked here too.
    batch = make_batch([(0, 7), (18, 5), (30, 1)], head_dim=40, block_size=16, dtype=torch.float16)
    monkeypatch.setattr(triton_ops, "_use_fp32_dot", lambda dtype: False)
    assert_close(run_step(batch, triton_ops), reference_step(batch))


@pytest.mark.parametrize("num_splits", [2, 4])
def test_split_context_decode(num_splits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # On a GPU, small decode batches cut each context into slices merged by a second kernel;
    # forcing it here covers slices that are full, partial and empty (short contexts).
    lens = [1, 15, 64, 65, 150, 260]
    batch = make_batch([(n - 1, 1) for n in lens], num_heads=6, num_kv_heads=2, head_dim=40)
    monkeypatch.setattr(triton_ops, "_num_kv_splits", lambda *args: num_splits)
    assert_close(run_step(batch, triton_ops), reference_step(batch))


def test_bfloat16_inputs() -> None:
    batch = make_batch([(0, 5), (12, 1)], head_dim=16, block_size=8, dtype=torch.bfloat16)
    assert_close(run_step(batch, triton_ops), reference_step(batch))


def test_matches_vectorised_reference_and_given_max_query_len() -> None:
    batch = make_batch([(3, 9), (0, 2), (17, 1)], block_size=8)
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
    torch_ops.write_kv(batch.key, batch.value, key_cache, value_cache, batch.slot_mapping)
    args = (batch.query, key_cache, value_cache, batch.block_tables, batch.seq_lens)
    expected = torch_ops.paged_attention(*args, batch.query_start_loc, batch.scale)

    out = triton_ops.paged_attention(*args, batch.query_start_loc, batch.scale, max_query_len=9)

    assert_close(out, expected)


def test_strided_query_view() -> None:
    batch = make_batch([(6, 3), (10, 1)], num_heads=4, num_kv_heads=2, head_dim=16)
    qkv = torch.randn(batch.query.shape[0], 8, 16)
    batch.query = qkv[:, :4]  # non-contiguous token stride, as after splitting a fused qkv
    assert_close(run_step(batch, triton_ops), reference_step(batch))


def test_empty_batch() -> None:
    batch = make_batch([(4, 1)])
    out = triton_ops.paged_attention(
        batch.query[:0],
        batch.key_cache,
        batch.value_cache,
        batch.block_tables[:0],
        batch.seq_lens[:0],
        batch.query_start_loc[:1],
        batch.scale,
    )
    assert out.shape == (0, *batch.query.shape[1:])


def test_rejects_bad_inputs() -> None:
    batch = make_batch([(4, 2)], num_heads=4, num_kv_heads=2)
    args = list(batch.attention_args())
    with pytest.raises(AssertionError, match="multiple of num_kv_heads"):
        triton_ops.paged_attention(batch.query[:, :3], *args[1:])
    with pytest.raises(AssertionError, match="share a dtype"):
        triton_ops.paged_attention(batch.query.half(), *args[1:])
    with pytest.raises(AssertionError, match="seq_lens must be int32"):
        triton_ops.paged_attention(*args[:4], batch.seq_lens.float(), *args[5:])
    with pytest.raises(AssertionError, match="query_start_loc must be"):
        triton_ops.paged_attention(*args[:5], batch.query_start_loc[:1], batch.scale)
    with pytest.raises(AssertionError, match="slot_mapping must be"):
        triton_ops.write_kv(
            batch.key, batch.value, batch.key_cache, batch.value_cache, batch.slot_mapping[:1]
        )


# --------------------------------------------------------------------------------------------
# CUDA: compiled kernels at realistic sizes
# --------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# Output rounding plus the probabilities rounded to the input dtype before the P @ V product.
CUDA_TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def fp32_reference_step(batch: Batch) -> torch.Tensor:
    """The vectorised torch reference on fp32 copies (the naive loop is too slow at this size).

    In bf16 the reference's own matmuls round the scores, so fp32 inputs isolate the kernel's
    error.
    """
    f32 = {
        name: getattr(batch, name).float()
        for name in ("query", "key", "value", "key_cache", "value_cache")
    }
    return run_step(replace(batch, **f32), torch_ops)


def random_seqs(
    num_seqs: int, max_context: int, max_chunk: int, seed: int
) -> list[tuple[int, int]]:
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(num_seqs):
        num_cached = int(torch.randint(0, max_context, (1,), generator=gen))
        # Every other sequence decodes; the rest are (chunked) prefills.
        num_new = 1 if i % 2 else int(torch.randint(1, max_chunk + 1, (1,), generator=gen))
        seqs.append((num_cached, num_new))
    return seqs


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(32, 8, 128, 16), (14, 2, 64, 32), (40, 40, 80, 16), (16, 4, 96, 8)],
)
def test_cuda_mixed_batch(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    cuda = torch.device("cuda")
    seqs = random_seqs(24, max_context=1500, max_chunk=300, seed=head_dim)
    batch = make_batch(
        seqs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=cuda,
    )
    out = run_step(batch, triton_ops)
    assert out.dtype == dtype
    torch.testing.assert_close(
        out.float(), fp32_reference_step(batch), atol=CUDA_TOL[dtype], rtol=CUDA_TOL[dtype]
    )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_decode_long_context(dtype: torch.dtype) -> None:
    cuda = torch.device("cuda")
    seqs = [(n - 1, 1) for n in (1, 17, 511, 2048, 4097)]
    batch = make_batch(seqs, num_heads=32, num_kv_heads=8, head_dim=128, dtype=dtype, device=cuda)
    out = run_step(batch, triton_ops)
    torch.testing.assert_close(
        out.float(), fp32_reference_step(batch), atol=CUDA_TOL[dtype], rtol=CUDA_TOL[dtype]
    )


@pytest.mark.gpu
@needs_cuda
def test_cuda_write_kv_matches_reference() -> None:
    cuda = torch.device("cuda")
    batch = make_batch(random_seqs(16, 1000, 200, seed=1), num_heads=32, num_kv_heads=8,
                       head_dim=128, dtype=torch.bfloat16, device=cuda)  # fmt: skip
    batch.slot_mapping[::7] = -1
    expected_k, expected_v = batch.key_cache.clone(), batch.value_cache.clone()
    torch_ops.write_kv(batch.key, batch.value, expected_k, expected_v, batch.slot_mapping)
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
    triton_ops.write_kv(batch.key, batch.value, key_cache, value_cache, batch.slot_mapping)
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)
