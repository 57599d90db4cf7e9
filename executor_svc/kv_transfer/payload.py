"""A KV payload: the K and V of some device blocks, layer-major, with its layout and checksum.

The payload is one contiguous host tensor ``[num_layers, 2, num_blocks, block_size,
num_kv_heads, head_dim]`` (index 0 of the second axis is K, 1 is V), so every layer's K and V
of the moved blocks are adjacent bytes: a transport moves one flat byte range, and a transport
that moves layers separately (RDMA, layer by layer while a prefill runs) can address layer
``l`` as one range of ``2 * num_blocks * block bytes`` at ``l`` times that.

``gather`` reads blocks out of a cache and ``scatter`` writes a payload into blocks; both
work on any object with the cache's ``key`` and ``value`` tensors (``[num_layers,
num_device_blocks, block_size, num_kv_heads, head_dim]``, runner/kv_cache.py), so this module
imports nothing of the runner. The caller holds the step lock around them.
"""

from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass
from typing import Protocol

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Refusal(enum.Enum):
    """Why a transfer was refused; the service maps each to a gRPC status."""

    INVALID = "invalid"  # bad input: INVALID_ARGUMENT
    CORRUPT = "corrupt"  # the bytes are not what the header says: DATA_LOSS
    ELSEWHERE = "elsewhere"  # not possible here (another host, tensor parallelism)


class TransferError(Exception):
    """A transfer refused before any destination block changed."""

    def __init__(self, refusal: Refusal, message: str) -> None:
        super().__init__(message)
        self.refusal = refusal


class CacheTensors(Protocol):
    """What a payload reads and writes of the KV cache (runner/kv_cache.KVCache has them)."""

    key: torch.Tensor  # [num_layers, num_device_blocks, block_size, num_kv_heads, head_dim]
    value: torch.Tensor  # same


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape of one block in every layer: a payload fits a cache only if these are equal."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # a key of DTYPES

    @classmethod
    def of(cls, cache: CacheTensors) -> KVLayout:
        num_layers, _, block_size, num_kv_heads, head_dim = cache.key.shape
        return cls(num_layers, block_size, num_kv_heads, head_dim, dtype_name(cache.key.dtype))

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        b = (self.block_size, self.num_kv_heads, self.head_dim)
        return (self.num_layers, 2, num_blocks, *b)

    def num_bytes(self, num_blocks: int) -> int:
        n = 1
        for d in self.shape(num_blocks):
            n *= d
        return n * DTYPES[self.dtype].itemsize

    @classmethod
    def from_shape(cls, shape: list[int], dtype: str) -> KVLayout:
        if dtype not in DTYPES:
            raise TransferError(
                Refusal.INVALID, f"payload dtype {dtype!r} is not one of {list(DTYPES)}"
            )
        if len(shape) != 6 or shape[1] != 2:
            raise TransferError(
                Refusal.INVALID,
                f"payload shape {list(shape)} is not [num_layers, 2, num_blocks, block_size, "
                "num_kv_heads, head_dim]",
            )
        return cls(shape[0], shape[3], shape[4], shape[5], dtype)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def crc32(data: torch.Tensor) -> int:
    """CRC-32 of a contiguous host tensor's bytes (zlib: ~4 GB/s, no copy)."""
    return zlib.crc32(as_bytes(data))


def as_bytes(data: torch.Tensor) -> memoryview:
    """A byte view of a contiguous host tensor (no copy)."""
    assert data.is_contiguous() and data.device.type == "cpu"
    return memoryview(data.view(torch.uint8).numpy()).cast("B")


def check_block_ids(block_ids: list[int], num_device_blocks: int, what: str) -> None:
    """Every id in range and none twice, else INVALID naming the first bad one."""
    if not block_ids:
        raise TransferError(Refusal.INVALID, f"no {what} blocks given")
    seen: set[int] = set()
    for b in block_ids:
        if b >= num_device_blocks:
            raise TransferError(
                Refusal.INVALID,
                f"{what} block id {b} is out of range: this executor has {num_device_blocks} "
                "device blocks",
            )
        if b in seen:
            raise TransferError(Refusal.INVALID, f"{what} block id {b} is given twice")
        seen.add(b)


def gather(cache: CacheTensors, block_ids: list[int], out: torch.Tensor) -> None:
    """Copy the K and V of ``block_ids`` (checked) into ``out``, a contiguous host tensor of
    ``KVLayout.of(cache).shape(len(block_ids))``: one index_select per layer and K/V."""
    idx = torch.tensor(block_ids, dtype=torch.long, device=cache.key.device)
    on_host = cache.key.device.type == "cpu"
    for i, tensor in enumerate((cache.key, cache.value)):
        for layer in range(tensor.shape[0]):
            if on_host:
                torch.index_select(tensor[layer], 0, idx, out=out[layer, i])
            else:
                out[layer, i].copy_(tensor[layer].index_select(0, idx))


def scatter(cache: CacheTensors, block_ids: list[int], payload: torch.Tensor) -> None:
    """Write ``payload`` (as ``gather`` makes it) into ``block_ids`` (checked) of ``cache``."""
    idx = torch.tensor(block_ids, dtype=torch.long, device=cache.key.device)
    for i, tensor in enumerate((cache.key, cache.value)):
        for layer in range(tensor.shape[0]):
            tensor[layer].index_copy_(0, idx, payload[layer, i].to(tensor.device))
