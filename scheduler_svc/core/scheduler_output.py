"""What one scheduling step produces: the executor diff (executor.proto's ExecuteModelRequest as
plain dataclasses) plus bookkeeping the scheduler needs back in update_from_output.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from scheduler_svc.core.request import Sequence
from scheduler_svc.core.sampling_params import SamplingParams


@dataclass(slots=True)
class NewSeqData:
    """A sequence the executor has not seen, or must re-learn (NewSequence)."""

    seq_id: str
    token_ids: list[int]  # snapshot: prompt + outputs known so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int | None  # per-sequence seed; overrides sampling_params.seed on the wire
    block_table: list[int]  # snapshot of the full device block table
    num_computed_tokens: int  # leading tokens already in the cache (prefix hit, fork, swap-in)
    num_scheduled_tokens: int
    tag: Hashable | None = None  # its request's (Request.tag), for the step message's hooks


@dataclass(slots=True)
class CachedSeqData:
    """A running sequence the executor knows, as a difference (CachedSequence).

    new_token_ids of the proto is always empty here: the executor appends what it samples and
    the scheduler never adds tokens to a sequence the executor already holds.
    """

    seq_id: str
    new_block_ids: list[int]  # appended to the block table after replacements
    replaced_blocks: list[tuple[int, int]]  # (logical_index, new block id), copy-on-write
    num_scheduled_tokens: int
    num_computed_tokens: int  # consistency check on the executor side
    # Lookahead positions after the decode token (core/lookahead.py): their tokens, checked
    # against the draws when the result is back (executor.proto's names).
    spec_token_ids: list[int] = field(default_factory=list)
    # Or that many positions whose tokens the executor supplies (they come back with the draws).
    num_draft_tokens: int = 0


@dataclass(slots=True)
class SchedulerOutput:
    step_id: int
    new_seqs: list[NewSeqData] = field(default_factory=list)
    cached_seqs: list[CachedSeqData] = field(default_factory=list)
    # The decode lane (ExecuteModelRequest.decode_seq_ids): running sequences decoding their last
    # token with no block-table change and no logprobs asked, as parallel lists. Each entry
    # means CachedSeqData(seq_id, [], [], 1, num_computed_tokens).
    decode_seq_ids: list[str] = field(default_factory=list)
    decode_num_computed_tokens: list[int] = field(default_factory=list)
    # Sequences the executor drops before this step: finished, aborted (also between steps) or
    # preempted (by recompute or swap).
    finished_seq_ids: list[str] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # seq_id -> tokens
    total_num_scheduled_tokens: int = 0
    preempted_req_ids: list[str] = field(default_factory=list)
    # (sequence, tokens scheduled) in batch order; read back by update_from_output.
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list, repr=False)
    # Lookahead (core/lookahead.py): seq_id -> the tokens at its lookahead positions this step
    # (empty until the reply brings them when the executor supplies them); update_from_output
    # fills spec_num_accepted (seq_id -> how many were accepted) when the result is back.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_num_accepted: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        """Nothing for the executor to do; the step can be skipped without losing anything."""
        return not (
            self.total_num_scheduled_tokens
            or self.finished_seq_ids
            or self.blocks_to_swap_out
            or self.blocks_to_swap_in
            or self.blocks_to_copy
        )


@dataclass(slots=True)
class SchedulerStats:
    """Counts and usage for GetServerInfo and routing."""

    num_waiting: int  # requests
    num_running: int
    num_swapped: int
    num_running_seqs: int
    num_device_blocks: int
    num_free_blocks: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    kv_cache_usage: float  # fraction of device blocks in use
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    prefix_cache_host_hits: int = 0  # of prefix_cache_hits, tokens found in the host tier
