"""The KV payload (executor_svc/kv_transfer/payload.py): layer-major bytes of the asked blocks,
a round trip through gather and scatter keeps every bit, block ids checked."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import pytest
import torch

from executor_svc.kv_transfer.payload import (
    KVLayout,
    TransferError,
    check_block_ids,
    crc32,
    gather,
    scatter,
)


@dataclass
class FakeCache:
    key: torch.Tensor
    value: torch.Tensor


def make_cache(
    dtype: torch.dtype, num_blocks: int = 10, seed: int = 0, device: str = "cpu"
) -> FakeCache:
    g = torch.Generator().manual_seed(seed)
    shape = (3, num_blocks, 4, 2, 8)  # [num_layers, num_blocks, block_size, heads, head_dim]
    key, value = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    return FakeCache(key.to(device, dtype), value.to(device, dtype))


CUDA = pytest.param(
    "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gather_then_scatter_moves_every_bit(dtype: torch.dtype, device: str):
    """On CUDA the payload is still a host tensor: the cache's blocks are copied to it."""
    src, dst = make_cache(dtype, seed=1, device=device), make_cache(dtype, seed=2, device=device)
    layout = KVLayout.of(src)
    assert layout == KVLayout(3, 4, 2, 8, str(dtype).removeprefix("torch."))
    ids, to = [7, 0, 3], [1, 9, 4]
    payload = torch.empty(layout.shape(3), dtype=dtype)
    gather(src, ids, payload)
    assert payload.numel() * payload.element_size() == layout.num_bytes(3)
    for layer in range(3):  # layer-major: per layer, K then V of the blocks in the asked order
        assert torch.equal(payload[layer, 0], src.key[layer, ids].cpu())
        assert torch.equal(payload[layer, 1], src.value[layer, ids].cpu())
    before = FakeCache(dst.key.clone(), dst.value.clone())
    scatter(dst, to, payload)
    bits = torch.int16 if dtype.itemsize == 2 else torch.int32
    assert torch.equal(dst.key[:, to].view(bits), src.key[:, ids].view(bits))
    assert torch.equal(dst.value[:, to].view(bits), src.value[:, ids].view(bits))
    rest = [b for b in range(10) if b not in to]
    assert torch.equal(dst.key[:, rest], before.key[:, rest])
    flat = payload.view(-1).view(torch.uint8)
    assert crc32(flat) == zlib.crc32(bytes(flat.tolist()))


def test_block_ids_are_checked():
    check_block_ids([0, 9], 10, "source")
    for ids, words in [([10], "out of range"), ([1, 1], "twice"), ([], "no source")]:
        with pytest.raises(TransferError, match=words):
            check_block_ids(ids, 10, "source")
    with pytest.raises(TransferError, match="shape"):
        KVLayout.from_shape([3, 1, 2, 4, 2, 8], "float32")
