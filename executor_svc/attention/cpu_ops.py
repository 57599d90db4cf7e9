"""The CPU attention backend: a compiled paged-attention kernel, one call per layer.

``csrc/paged_attention.cpp`` reads K/V in place through the block table for the whole batch
(decodes and prefill chunks together, GQA, any head_dim), where the torch backend gathers each
sequence's context into a padded copy per layer. The kernel is built and loaded with the rest
of the kernel library (``kernels/library.py``: at first use, cached, called through ctypes; or a
library built ahead of time). No library: ``available()`` is False and
``get_attention_backend("auto", "cpu")`` takes the torch backend. Anything the kernel does not
cover goes to the torch ops, which stay the reference in tests.

bf16 models keep a bf16 cache: the kernel's bf16-K/V build (``csrc/paged_attention_bf16kv.cpp``)
reads it, widening each key and value exactly, with the fp32 kernel's arithmetic and order. The
step's bf16 q/k/v rows are widened before the call (new keys are rotated in fp32, then rounded
once into the cache) and the output is rounded back to bf16.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import executor_svc.attention.torch_ops as torch_ops
from executor_svc.kernels import library

if TYPE_CHECKING:
    from executor_svc.attention.metadata import AttentionMetadata


def available() -> bool:
    """Whether the compiled kernel can run here (the backend ``auto`` picks on the CPU)."""
    return library.available()


def _supported(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    return (
        query.device.type == "cpu"
        and query.dtype in (torch.float32, torch.bfloat16)
        and key_cache.dtype in _ENTRY
        and key_cache.is_contiguous()
        and library.load() is not None
    )


# The kernel's entry point per cache dtype.
_ENTRY = {
    torch.float32: "llmserve_paged_attention_f32",
    torch.bfloat16: "llmserve_paged_attention_bf16kv",
}


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each token's K/V at its slot (-1 = skip); the torch op, one index_copy_ each."""
    torch_ops.write_kv(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Same contract as ``torch_ops.paged_attention``; one kernel call for the whole batch."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert key_cache.shape[3] == head_dim and value_cache.shape == key_cache.shape
    assert query_start_loc.shape == (seq_lens.shape[0] + 1,)
    assert block_tables.shape[0] == seq_lens.shape[0]
    if not _supported(query, key_cache) or not value_cache.is_contiguous():
        return torch_ops.paged_attention(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale
        )
    out_dtype = query.dtype
    query = _f32(query)
    if query.stride(2) != 1:
        query = query.contiguous()
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32)
    if num_tokens:
        meta = _Meta(block_tables, seq_lens, query_start_loc, None)
        _run(query, key_cache, value_cache, meta, scale, out)
    return out.to(out_dtype)


class _Meta:
    """The batch metadata as the kernel takes it (int32/int64, contiguous) and its pointers."""

    def __init__(self, block_tables, seq_lens, query_start_loc, slot_mapping) -> None:
        self.tables = block_tables.to(torch.int32).contiguous()
        self.seq_lens = seq_lens.to(torch.int32).contiguous()
        self.qsl = query_start_loc.to(torch.int32).contiguous()
        self.slots = None if slot_mapping is None else slot_mapping.to(torch.int64).contiguous()

    @staticmethod
    def of(md: AttentionMetadata) -> _Meta:
        """Made once per forward, by the first layer; the others reuse it."""
        meta = md.scratch.get("cpu.meta")
        if meta is None:
            meta = md.scratch["cpu.meta"] = _Meta(
                md.block_tables, md.seq_lens, md.query_start_loc, md.slot_mapping
            )
        return meta


def _run(query, key_cache, value_cache, meta: _Meta, scale, out, new=None, rope=None) -> None:
    """The kernel call: ``query`` [T, H, D] rows with head_dim contiguous; ``new`` = (key,
    value) [T, KVH, D] written first at meta.slots; ``rope`` = (cos, sin) rotating q and new k."""
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1:3]
    key, value = new if new is not None else (None, None)
    cos, sin = rope if rope is not None else (None, None)
    rc = getattr(library.load(), _ENTRY[key_cache.dtype])(  # type: ignore[union-attr]
        query.data_ptr(), query.stride(0), query.stride(1),
        key_cache.data_ptr(), value_cache.data_ptr(),
        meta.tables.data_ptr(), meta.tables.stride(0),
        meta.seq_lens.data_ptr(), meta.qsl.data_ptr(), meta.seq_lens.shape[0],
        num_heads, num_kv_heads, head_dim, block_size, scale,
        out.data_ptr(), torch.get_num_threads(),
        None if key is None else key.data_ptr(), 0 if key is None else key.stride(0),
        None if value is None else value.data_ptr(), 0 if value is None else value.stride(0),
        None if key is None else meta.slots.data_ptr(), 0 if key is None else key.shape[0],
        None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"paged attention kernel rejected its arguments (code {rc})")


def _fused(query, key, value, rope, key_cache, value_cache, md, scale) -> torch.Tensor | None:
    """K/V write (rope on q and k when given) and attention in one kernel call; None when the
    kernel does not take these inputs."""
    d, out_dtype = query.shape[2], query.dtype
    if not (
        _supported(query, key_cache)
        and key.dtype == value.dtype == query.dtype
        and value_cache.is_contiguous()
        and (rope is None or all(t.dtype == query.dtype and t.is_contiguous() for t in rope))
    ):
        return None
    if out_dtype != torch.float32:  # bf16 rows widened; the rope tables once per forward
        query, key, value = _f32(query), _f32(key), _f32(value)
        if rope is not None:
            rope = md.scratch.get("cpu.rope_f32") or md.scratch.setdefault(
                "cpu.rope_f32", tuple(t.float() for t in rope)
            )
    if not all(t.stride(2) == 1 and t.stride(1) == d for t in (query, key, value)):
        return None
    out = torch.empty(query.shape, dtype=torch.float32)
    _run(query, key_cache, value_cache, _Meta.of(md), scale, out, (key, value), rope)
    return out.to(out_dtype)


def attend(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """K/V write and attention of one layer in one kernel call (torch's ops for inputs the
    kernel does not take). Whole prompts go through the kernel too: since its chunked two-pass
    softmax it is ~2.2x faster than torch's fused causal SDPA on one thread
    (``benchmarks/bench_cpu_ops.py``)."""
    out = _fused(query, key, value, None, key_cache, value_cache, md, scale)
    if out is None:
        return torch_ops.attend(query, key, value, key_cache, value_cache, md, scale)
    return out


def attend_rope(
    qk: torch.Tensor,  # [num_tokens, num_heads + num_kv_heads, head_dim]: q then k, unrotated
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim / 2]
    sin: torch.Tensor,
    num_heads: int,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
) -> torch.Tensor | None:
    """Rotary embedding (the model's neox rope), K/V write and attention of one layer in one
    kernel call; None when the kernel does not take these inputs (then the caller rotates and
    calls ``attend``)."""
    key = qk[:, num_heads:]
    return _fused(qk[:, :num_heads], key, value, (cos, sin), key_cache, value_cache, md, scale)
