"""A scheduled sequence's entry in the step message (the scheduler's step diff): in full when
the executor does not hold it yet, else as a difference, or in the compact decode lane when
nothing but one token changes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler_svc.core.scheduler_output import CachedSeqData, NewSeqData, SchedulerOutput

if TYPE_CHECKING:
    from scheduler_svc.core.request import Request, Sequence


def add_to_step(
    req: Request,
    seq: Sequence,
    num_tokens: int,
    growth: tuple[list[int], tuple[int, int] | None],
    out: SchedulerOutput,
) -> None:
    """seq (of req) computes num_tokens tokens this step; growth is what the block manager gave
    it for them (new block ids, a replaced block)."""
    new_ids, replaced = growth
    sid = seq.seq_id
    if (
        seq.sent
        and num_tokens == 1
        and not new_ids
        and not replaced
        and seq.num_computed_tokens + 1 == len(seq.token_ids)
        and req.decode_lane
    ):
        out.decode_seq_ids.append(sid)
        out.decode_num_computed_tokens.append(seq.num_computed_tokens)
    elif seq.sent:
        out.cached_seqs.append(
            CachedSeqData(
                sid, new_ids, [replaced] if replaced else [], num_tokens, seq.num_computed_tokens
            )
        )
    else:
        out.new_seqs.append(
            NewSeqData(
                sid,
                list(seq.token_ids),
                seq.num_prompt_tokens,
                req.sampling_params,
                seq.seed,
                list(seq.block_table),
                seq.num_computed_tokens,
                num_tokens,
                req.tag,
            )
        )
        seq.sent = True
    out.num_scheduled_tokens[sid] = num_tokens
    out.scheduled.append((seq, num_tokens))
