"""The batched LoRA apply: one forward serves rows of several adapters and of the base model.

A step's rows are grouped by adapter (``LoraStep``); each packed ``Linear`` of the model holds a
``LoraSlot`` that adds, for every group, ``(x[rows] @ A) @ B`` to the base output of those rows.

Step invariance (docs/internals.md, "Step-invariant numerics"): a row's delta is computed with
the step-invariant GEMM (``kernels.gemm.matmul``: one FMA chain per output element, k ascending,
whatever the number of rows), so it does not depend on how many rows share its adapter nor on
which other adapters are in the step; each output element then gets exactly one addition. Where
that kernel does not apply (CUDA, half precision, ``--no-deterministic``) the grouped product
falls back to ``torch.matmul``, whose per-row result may follow the group's size, like the base
layers' own matmuls there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_svc.features.lora import kernel as lora_kernel
from executor_svc.features.lora.peft import LoraAdapter
from executor_svc.kernels import gemm


def _mm(x: torch.Tensor, w: torch.Tensor | gemm.PackedWeight) -> torch.Tensor:
    if not isinstance(w, torch.Tensor):
        return w.linear(x, None)  # packed for the CPU kernel (``pack_adapter``)
    y = gemm.matmul(x, w)
    return torch.matmul(x, w) if y is None else y


def pack_adapter(adapter: LoraAdapter) -> LoraAdapter:
    """The adapter with A and B in the CPU kernel's packed layout where it applies (fp32 CPU):
    bitwise the same products as ``gemm.matmul`` on the plain matrices, several times faster
    on the small matrices of an adapter (no per-call packing)."""
    packed: dict = {}
    for key, (a, bs) in adapter.weights.items():
        fused = lora_kernel.LoraWeights.of(a, adapter.rank, bs)
        if fused is not None:  # one kernel call per group (kernels/csrc/lowrank_rows.cpp)
            packed[key] = fused
            continue
        pa = gemm.pack(a)
        pbs = [(start, size, gemm.pack(b)) for start, size, b in bs]
        if pa is None or any(pb is None for _, _, pb in pbs):
            packed[key] = (a, bs)
        else:
            packed[key] = (pa, pbs)
    return LoraAdapter(adapter.name, adapter.path, adapter.rank, adapter.scaling, packed)


@dataclass(slots=True)
class LoraGroup:
    adapter: LoraAdapter  # on the model's device and dtype
    rows: torch.Tensor  # [num_rows] int64, rows of the step's flattened batch


class LoraStep:
    """The adapter groups of the step being run (rows of the base model belong to none)."""

    def __init__(self) -> None:
        self.groups: list[LoraGroup] = []

    def set(self, groups: list[LoraGroup]) -> None:
        self.groups = groups

    def clear(self) -> None:
        self.groups = []


class LoraSlot:
    """Installed on one packed ``Linear`` as its ``delta`` (the model's per-layer extension
    point); reads the current ``LoraStep``."""

    def __init__(self, key: tuple[int, str], step: LoraStep) -> None:
        self.key = key  # (layer index, packed module name)
        self.step = step

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base output of ``x``, [num_tokens, out]) plus each group's delta."""
        for group in self.step.groups:
            ab = group.adapter.weights.get(self.key)
            if ab is None:
                continue
            if isinstance(ab, lora_kernel.LoraWeights):
                ab.apply(x, group.rows, y)
                continue
            a, bs = ab
            r = group.adapter.rank
            xa = _mm(x.index_select(0, group.rows), a)  # [num_rows, r * num_shards]
            if len(bs) == 1 and bs[0][1] == y.shape[1]:
                delta = _mm(xa, bs[0][2])  # [num_rows, out]
            else:
                # Columns of shards the adapter skips get exact zeros.
                delta = y.new_zeros(len(group.rows), y.shape[1])
                for j, (start, size, b) in enumerate(bs):
                    delta[:, start : start + size] = _mm(xa[:, j * r : (j + 1) * r], b)
            y.index_copy_(0, group.rows, y.index_select(0, group.rows) + delta)
        return y
