"""The Triton KV-cache write (``write_kv``) and the checks both Triton attention ops share.

Same signature and semantics as ``torch_ops.write_kv`` (see docs/internals.md); part of the
Triton backend, ``triton_ops``, which re-exports it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor_svc.config import envs

INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    # Read at call time: the env var decides how @triton.jit behaved at import, and the check
    # only gates which devices the wrappers accept.
    return envs.triton_interpret()


def check_device(tensors: dict[str, torch.Tensor]) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    assert all(d == first for d in devices.values()), f"tensors on different devices: {devices}"
    assert first.type == "cuda" or interpreting(), (
        f"Triton attention needs CUDA tensors (got {first}); set TRITON_INTERPRET=1 before "
        "importing triton to run the kernels on the CPU"
    )


# --------------------------------------------------------------------------------------------
# write_kv
# --------------------------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    HEADS_PER_PROG: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    tok = tl.program_id(0)
    # int64 before the multiply: block_id * stride overflows int32 on large caches.
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:  # padding / tokens whose KV must not be stored
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.program_id(1) * HEADS_PER_PROG + tl.arange(0, HEADS_PER_PROG)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HEAD_DIM)
    tok64 = tok.to(tl.int64)

    k = tl.load(
        key_ptr + tok64 * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd,
        mask=mask,
    )
    v = tl.load(
        value_ptr + tok64 * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd,
        mask=mask,
    )
    tl.store(
        key_cache_ptr
        + block_id * stride_kcb
        + offset * stride_kcs
        + heads[:, None] * stride_kch
        + dims[None, :] * stride_kcd,
        k,
        mask=mask,
    )
    tl.store(
        value_cache_ptr
        + block_id * stride_vcb
        + offset * stride_vcs
        + heads[:, None] * stride_vch
        + dims[None, :] * stride_vcd,
        v,
        mask=mask,
    )


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, block_id * block_size + offset; -1 = skip
) -> None:
    """Store each token's key/value at its slot in the paged cache; slots < 0 are skipped."""
    assert key.dim() == 3, f"key must be [num_tokens, num_kv_heads, head_dim], got {key.shape}"
    assert value.shape == key.shape, f"value {value.shape} != key {key.shape}"
    assert key_cache.dim() == 4, (
        f"key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {key_cache.shape}"
    )
    assert value_cache.shape == key_cache.shape, (
        f"value_cache {value_cache.shape} != key_cache {key_cache.shape}"
    )
    num_tokens, num_kv_heads, head_dim = key.shape
    assert key_cache.shape[2:] == (num_kv_heads, head_dim), (
        f"cache heads/head_dim {tuple(key_cache.shape[2:])} != key {(num_kv_heads, head_dim)}"
    )
    assert slot_mapping.shape == (num_tokens,), (
        f"slot_mapping must be [num_tokens={num_tokens}], got {tuple(slot_mapping.shape)}"
    )
    assert slot_mapping.dtype in INDEX_DTYPES, (
        f"slot_mapping must be int64, got {slot_mapping.dtype}"
    )
    assert key.dtype in FLOAT_DTYPES, f"unsupported dtype {key.dtype}"
    dtypes = {key.dtype, value.dtype, key_cache.dtype, value_cache.dtype}
    assert len(dtypes) == 1, f"key, value and caches must share one dtype, got {dtypes}"
    check_device(
        {"key": key, "value": value, "key_cache": key_cache, "value_cache": value_cache,
         "slot_mapping": slot_mapping}
    )  # fmt: skip
    assert slot_mapping.stride(0) == 1 or num_tokens <= 1, "slot_mapping must be contiguous"
    if num_tokens == 0:
        return

    head_pad = triton.next_power_of_2(head_dim)
    # About 2K elements per program keeps registers in check for wide models while a typical
    # layer (8 KV heads x 128) still writes a whole token in one program.
    heads_per_prog = max(1, min(triton.next_power_of_2(num_kv_heads), 2048 // head_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, heads_per_prog))
    _write_kv_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        HEADS_PER_PROG=heads_per_prog,
        BLOCK_SIZE=key_cache.shape[1],
    )
