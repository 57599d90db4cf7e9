"""Async scheduling: the next decode step planned while the current one is still running.

In steady decode the step that follows is known before the current one returns: every running
sequence computes one more token, the one the current step is sampling. The executor keeps each
sequence's tokens, so a decode entry needs no token from the scheduler, and the next step can be
sent at once; the executor starts it the moment the current one ends, and the scheduler's work
between steps (outputs, stop checks, detokenizing, Redis, the next plan, the round trip) runs
while the executor computes instead of in between.

It is planned only when it is certain: every running request is one sequence that the step in
flight samples, nothing is swapped out, nothing waits unless every sequence slot
(max_num_seqs) stays taken, and the blocks the next tokens need are free.
Anything else (new requests, prefill chunks, preemption, n > 1) goes through schedule() once the
step in flight is back. A sequence that the step in flight ends by length is left out; one that
a stop token or string ends computes one token too many, which update_from_output() drops (it
skips sequences that are no longer running).
"""

from __future__ import annotations

from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.request import Request, RequestStatus, Sequence
from scheduler_svc.core.scheduler_output import CachedSeqData, SchedulerOutput

__all__ = ["plan_ahead"]

_RUNNING = RequestStatus.RUNNING


def plan_ahead(
    in_flight: SchedulerOutput,
    running: list[Request],
    bm: BlockManager,
    max_model_len: int,
    step_id: int,
    min_seqs: int = 0,
) -> SchedulerOutput | None:
    """The step after `in_flight` (whose result is not applied yet), or None when it is not
    certain or would run fewer than `min_seqs` sequences (with requests waiting: a slot that
    frees is schedule()'s to fill). Sequence state is still as before `in_flight`: each
    sampling sequence has computed all but its last token, and `in_flight` computes that one."""
    sampling: set[str] = set()
    for seq, num in in_flight.scheduled:
        if seq.status != _RUNNING:
            continue  # ended while in flight
        if num != 1 or seq.num_computed_tokens + 1 != len(seq.token_ids):
            return None  # a prefill chunk: what follows it is schedule()'s decision
        sampling.add(seq.seq_id)
    bs = bm.block_size
    entries: list[tuple[Request, Sequence, bool]] = []  # (request, sequence, needs a block)
    need = 0
    for req in running:
        if req.status != _RUNNING:
            continue
        if len(req.seqs) != 1 or req.sampling_params.step_by_step:
            # Its next step depends on the token still being sampled (a constraint's mask).
            return None
        seq = req.seqs[0]
        if seq.seq_id not in sampling:
            return None
        length = len(seq.token_ids) + 1  # once the token in flight is in
        if (
            length - seq.num_prompt_tokens >= req.sampling_params.max_tokens
            or length >= max_model_len
        ):
            continue  # the token in flight is its last
        slot = seq.num_computed_tokens + 1  # where the next step writes
        if slot < seq.exclusive_until:
            entries.append((req, seq, False))
        elif slot == len(seq.block_table) * bs:
            entries.append((req, seq, True))
            need += 1
        else:
            return None  # a block nobody vouched for yet: let schedule() check it
    if not entries or len(entries) < min_seqs or need > bm.num_free_blocks:
        return None
    out = SchedulerOutput(step_id)
    for req, seq, grows in entries:
        sid = seq.seq_id
        nc = seq.num_computed_tokens + 1
        new_ids: list[int] = []
        if grows:
            # From the slot in flight: that block is the sequence's own, one fresh one follows.
            growth = bm.grow(seq, 2, out.blocks_to_copy)
            assert growth is not None and growth[1] is None, f"{sid}: room was checked"
            new_ids = growth[0]
        if new_ids or not req.decode_lane:
            out.cached_seqs.append(CachedSeqData(sid, new_ids, [], 1, nc))
        else:
            out.decode_seq_ids.append(sid)
            out.decode_num_computed_tokens.append(nc)
        out.num_scheduled_tokens[sid] = 1
        out.scheduled.append((seq, 1))
    out.total_num_scheduled_tokens = len(entries)
    return out
