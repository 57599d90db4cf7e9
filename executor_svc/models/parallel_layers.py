"""Sharded linear layers and the vocabulary-parallel embedding / LM head loaders.

Same storage as ``models.llama.Linear`` (``[in, out]``), only smaller: each rank holds its slice
and its weight loader reads just that slice of the checkpoint tensor. Loaders here accept a
safetensors slice (``f.get_slice(name)``, read lazily) as well as a tensor, so a rank never
materialises a full copy of a sharded matrix; ``loads_slice`` on a parameter tells the loader
which of the two to hand over.

* ``ColumnParallelLinear``: the output columns of each packed part (q, k, v or gate, up) are
  split; no communication.
* ``RowParallelLinear``: the input rows are split; the partial products are summed with an
  all-reduce, then the (replicated) bias is added once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from executor_svc.kernels import gemm
from executor_svc.models.llama import Linear, matmul_io
from executor_svc.parallel.group import TPGroup

# A checkpoint tensor, or a safetensors slice of one (supports ``[a:b]`` and ``[:, a:b]``).
Loadable = Any


def _mark_slice_loader(param: nn.Parameter) -> None:
    param.loads_slice = True  # type: ignore[attr-defined]


class ColumnParallelLinear(Linear):
    """``Linear`` over this rank's columns: ``parts`` maps each packed part to (columns on this
    rank, first of them in the checkpoint's part)."""

    def __init__(self, in_features: int, parts: dict[Any, tuple[int, int]], bias: bool) -> None:
        super().__init__(in_features, {k: size for k, (size, _) in parts.items()}, bias)
        self.source_offsets = {k: first for k, (_, first) in parts.items()}
        for p in self.parameters():
            _mark_slice_loader(p)

    def _load(self, param: torch.Tensor, loaded: Loadable, shard_id: Any = None) -> None:
        _, size = self.shard_offsets[shard_id]
        first = self.source_offsets[shard_id]
        # Checkpoint rows are output features, for the weight ([out, in]) and the bias alike.
        super()._load(param, loaded[first : first + size], shard_id)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_rank W_rank) + b, W_rank = rows [first, first + in_features) of W."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, first: int, tp: TPGroup
    ) -> None:
        super().__init__()
        self.first = first
        self.tp = tp
        self.in_features, self.out_features = in_features, out_features  # this rank's shard
        self.delta: Any = None  # as Linear.delta: on this rank's partial sum, before the reduce
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]
        _mark_slice_loader(self.weight)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
            self.bias.weight_loader = self._load  # type: ignore[attr-defined]
        self.packed: gemm.PackedWeight | None = None  # set by prepack(); weight is emptied

    def _load(self, param: torch.Tensor, loaded: Loadable, shard_id: Any = None) -> None:
        if param.dim() == 1:  # the bias, whole on every rank
            param.data.copy_(loaded)
            return
        n = param.shape[0]
        param.data.copy_(loaded[:, self.first : self.first + n].t())  # [out, in_r] -> [in_r, out]

    def prepack(self) -> bool:
        """As ``Linear.prepack``: the shard in the layout the CPU kernel streams fastest (the
        same bits as the plain matrix)."""
        if self.packed is None:
            self.packed = gemm.pack(self.weight.data)
            if self.packed is None:
                return False
            self.weight.data = self.weight.data.new_empty(0)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.packed.linear(x, None) if self.packed is not None else None
        y = partial if partial is not None else matmul_io(x, self.weight)
        if self.delta is not None:  # a delta linear in x_rank: the all-reduce sums it over ranks
            y = self.delta.apply(x, y)
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


def vocab_loader(first: int, vocab_size: int) -> Any:
    """Loader of a ``[hidden, vocab_per_rank]`` embedding / LM head shard: checkpoint rows
    ``[first, first + vocab_per_rank)``; the padding past ``vocab_size`` on the last rank is
    zeroed (its logits are cut off after the gather, its ids never looked up)."""

    def load(param: torch.Tensor, loaded: Loadable, shard_id: Any = None) -> None:
        n = max(min(param.shape[1], vocab_size - first), 0)
        if n:
            param.data[:, :n].copy_(loaded[first : first + n].t())
        param.data[:, n:].zero_()

    return load
