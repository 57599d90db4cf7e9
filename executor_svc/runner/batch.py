"""The flattened inputs of one engine step, as the model runner builds them and as
tensor-parallel rank 0 sends them to the other ranks (a leaf: imports no runner code)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_svc.attention import AttentionMetadata


@dataclass(slots=True)
class BatchInputs:
    """Flattened model inputs of one step (on the model's device; on the host while tensor-
    parallel rank 0 sends them)."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn_metadata: AttentionMetadata
    # Which of the step's sequences sample, and their last token's row in the batch; a
    # sequence a feature has sample several rows is listed once per row (Feature.sample_rows).
    sample_seq_indices: list[int]
    sample_rows: torch.Tensor  # [num_samples] int64

    def to(self, device: torch.device) -> BatchInputs:
        """The same inputs on ``device`` (self when they are there already)."""
        if self.input_ids.device == device:
            return self
        md = self.attn_metadata
        return BatchInputs(
            input_ids=self.input_ids.to(device),
            positions=self.positions.to(device),
            attn_metadata=AttentionMetadata(
                slot_mapping=md.slot_mapping.to(device),
                block_tables=md.block_tables.to(device),
                seq_lens=md.seq_lens.to(device),
                query_start_loc=md.query_start_loc.to(device),
                max_query_len=md.max_query_len,
                max_seq_len=md.max_seq_len,
                num_decode_seqs=md.num_decode_seqs,
            ),
            sample_seq_indices=self.sample_seq_indices,
            sample_rows=self.sample_rows.to(device),
        )
