"""The batched LoRA kernel's wrapper (``kernels/csrc/lowrank_rows.cpp``): for the rows of one
adapter group, ``y[rows] += (x[rows] @ A) @ B_s`` per shard, each row on its own in a fixed
order (step invariant), in one call instead of a GEMM pair per shard plus gathers. ``LoraWeights.of``
returns None where the kernel does not apply (not fp32 CPU, no library, deterministic numerics
off), and the caller keeps its torch path."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from executor_svc.config import numerics
from executor_svc.kernels import library

MAX_RANK_TOTAL = 256  # rank * shards; csrc/lowrank_rows.cpp kMaxRankTotal


def _fn():
    lib = library.load()
    return getattr(lib, "llmserve_lowrank_rows_f32", None) if lib is not None else None


@dataclass(slots=True, eq=False)
class LoraWeights:
    """One adapter's A and B shards of one packed projection, ready for the kernel."""

    a: torch.Tensor  # [k, ra] fp32 contiguous
    rank: int
    bs: list[torch.Tensor]  # [rank, size] fp32 contiguous, kept alive for b_ptrs
    starts: torch.Tensor  # [num_shards] int64
    sizes: torch.Tensor  # [num_shards] int64
    b_ptrs: ctypes.Array

    @classmethod
    def of(
        cls, a: torch.Tensor, rank: int, shards: list[tuple[int, int, torch.Tensor]]
    ) -> LoraWeights | None:
        tensors = [a, *(b for _, _, b in shards)]
        if not (
            numerics.deterministic()
            and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
            and a.shape[1] <= MAX_RANK_TOTAL
            and _fn() is not None
        ):
            return None
        bs = [b.contiguous() for _, _, b in shards]
        return cls(
            a=a.contiguous(),
            rank=rank,
            bs=bs,
            starts=torch.tensor([s for s, _, _ in shards], dtype=torch.long),
            sizes=torch.tensor([n for _, n, _ in shards], dtype=torch.long),
            b_ptrs=(ctypes.c_void_p * len(bs))(*(b.data_ptr() for b in bs)),
        )

    def apply(self, x: torch.Tensor, rows: torch.Tensor, y: torch.Tensor) -> None:
        """``y[rows] += (x[rows] @ A) @ B_s`` in place (x, y: fp32 CPU rows, unit column stride;
        rows: int64 indices into both)."""
        assert x.stride(1) == 1 and y.stride(1) == 1 and x.shape[1] == self.a.shape[0]
        assert rows.dtype == torch.long and rows.is_contiguous()
        assert y.dtype == torch.float32 and x.dtype == torch.float32
        rc = _fn()(
            x.data_ptr(), x.stride(0), x.shape[1], rows.data_ptr(), rows.numel(),
            self.a.data_ptr(), self.a.shape[1], self.rank, len(self.bs),
            self.starts.data_ptr(), self.sizes.data_ptr(), self.b_ptrs,
            y.data_ptr(), y.stride(0), torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"lora kernel rejected A {tuple(self.a.shape)} rank {self.rank}")
