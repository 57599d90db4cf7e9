"""What the attention layers of one forward read: the batch's metadata (a leaf, imported by
every backend, the models and the runner)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """What the attention layers of one forward need; tensors live on the model's device."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token, -1 = skip
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cu_seqlens_q
    max_query_len: int  # host copies, so kernels can size grids without a device sync
    max_seq_len: int
    num_decode_seqs: int = 0  # sequences with exactly one query token (informational)
    # Per-forward memo for backends: values derived from this metadata alone, computed by the
    # first layer and reused by the rest. Keys are prefixed with the backend name.
    scratch: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]
