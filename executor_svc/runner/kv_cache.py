"""Paged KV cache on the device plus the CPU swap pool, and how many blocks each gets.

Storage is one tensor per K and V holding all layers, ``[num_layers, num_blocks, block_size,
num_kv_heads, head_dim]``; each layer's cache is a contiguous view of it. Swapping and copying a
list of blocks is then one ``index_select`` + ``index_copy_`` per K and V for all layers at once,
whatever the number of blocks or layers.

Block-count sizing (``num_device_blocks`` when not given explicitly):

* CUDA: after a warm-up forward at ``PROFILE_NUM_TOKENS`` tokens, the KV cache gets
  ``total * gpu_memory_utilization - (memory in use now) - (activation peak of the forward)``.
  Measuring instead of estimating covers the CUDA context, allocator slack and other processes.
* CPU: ``min(2 GiB, 25% of MemAvailable)``. A CPU executor shares RAM with the OS, the scheduler
  and Redis; a quarter of what is free leaves them room and 2 GiB is already far more context
  than a CPU can attend over at interactive speed.

Either way the count is capped at what ``MAX_FULL_SEQS`` sequences of ``max_model_len`` could
use, so tiny models do not zero gigabytes they can never fill. The CPU swap pool gets
``swap_space_gib`` with the same cap.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

GIB = 1 << 30
CPU_KV_BUDGET_MAX_BYTES = 2 * GIB
CPU_KV_BUDGET_FRACTION = 0.25
PROFILE_NUM_TOKENS = 2048  # tokens in the CUDA profiling forward (a typical per-step budget)
MAX_FULL_SEQS = 256  # cap: blocks for this many sequences of max_model_len


def block_bytes(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across all layers, K and V."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def max_useful_blocks(max_model_len: int, block_size: int) -> int:
    return MAX_FULL_SEQS * -(-max_model_len // block_size)


def mem_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cpu_num_blocks(bytes_per_block: int) -> int:
    """Device blocks for a CPU executor: min(2 GiB, 25% of MemAvailable)."""
    available = mem_available_bytes()
    budget = CPU_KV_BUDGET_MAX_BYTES
    if available is not None:
        budget = min(budget, int(available * CPU_KV_BUDGET_FRACTION))
    return max(budget // bytes_per_block, 0)


def cuda_num_blocks(
    warmup: Callable[[], None],
    device: torch.device,
    gpu_memory_utilization: float,
    bytes_per_block: int,
) -> int:
    """Device blocks that fit beside the weights and one forward's activations on ``device``."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    warmup()
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - before
    # Return the warm-up's cached blocks to the driver so mem_get_info sees only what is held.
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free  # weights, CUDA context, other processes
    budget = total * gpu_memory_utilization - in_use - activation_peak
    return max(int(budget) // bytes_per_block, 0)


class KVCache:
    """Device K/V blocks for every layer and a CPU pool of the same block shape for swapping."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_device_blocks: int,
        num_cpu_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.num_device_blocks = num_device_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.device = device
        block = (block_size, num_kv_heads, head_dim)
        # Zeroed, not empty: attention multiplies masked-out values by probability 0, and
        # 0 * NaN (uninitialised memory) would still be NaN.
        self.key = torch.zeros(num_layers, num_device_blocks, *block, dtype=dtype, device=device)
        self.value = torch.zeros_like(self.key)
        # Pinned host memory lets device<->host copies run at full PCIe speed.
        pin = device.type == "cuda"
        self.cpu_key = torch.zeros(num_layers, num_cpu_blocks, *block, dtype=dtype, pin_memory=pin)
        self.cpu_value = torch.zeros_like(self.cpu_key, pin_memory=pin)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (self.key[i], self.value[i]) for i in range(num_layers)
        ]

    def _indices(self, pairs: list[tuple[int, int]], device: torch.device):
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long)
        return src, dst

    def swap_out(self, device_to_cpu: list[tuple[int, int]]) -> None:
        """Copy device blocks into CPU blocks: list of (device_block, cpu_block)."""
        if not device_to_cpu:
            return
        src, dst = self._indices(device_to_cpu, self.device)
        for dev_cache, cpu_cache in ((self.key, self.cpu_key), (self.value, self.cpu_value)):
            cpu_cache.index_copy_(1, dst, dev_cache.index_select(1, src).cpu())

    def swap_in(self, cpu_to_device: list[tuple[int, int]]) -> None:
        """Copy CPU blocks into device blocks: list of (cpu_block, device_block)."""
        if not cpu_to_device:
            return
        src, dst = self._indices(cpu_to_device, torch.device("cpu"))
        dst = dst.to(self.device)
        for dev_cache, cpu_cache in ((self.key, self.cpu_key), (self.value, self.cpu_value)):
            dev_cache.index_copy_(1, dst, cpu_cache.index_select(1, src).to(self.device))

    def copy(self, src_to_dst: list[tuple[int, int]]) -> None:
        """Copy device blocks to device blocks (copy-on-write): list of (src, dst)."""
        if not src_to_dst:
            return
        src, dst = self._indices(src_to_dst, self.device)
        dst = dst.to(self.device)
        # index_select materialises every source first, so a block that is both a source and a
        # destination in the same list is read before it is overwritten.
        for cache in (self.key, self.value):
            cache.index_copy_(1, dst, cache.index_select(1, src))
