"""What the engine does with one ExecuteModel reply, as a function the benchmarks call too.

Per sequence that got a token: the scheduler core appends it (update_from_output), the request's
output state applies the stop checks and detokenizes it, and the step's record collects the
Redis append and the acknowledged-stream delta. Sequences the stop checks end are finished in
the scheduler core at once (their blocks are free for the next step); the core reports the
requests that ended with them once per step (`take_finished_requests`). This runs once per step
for every running sequence, so it is kept to plain loops over plain data.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Sequence as Sequence_
from typing import Any

from protos import executor_pb2 as epb
from scheduler_svc.core.request import RequestStatus, Sequence, req_id_of
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.scheduler_output import SchedulerOutput
from scheduler_svc.core.spec_decode import take_draft_proposals
from scheduler_svc.engine.streams import EngineStep, RequestHandle

__all__ = ["process_step_outputs"]


def process_step_outputs(
    sched: Scheduler,
    requests: Mapping[str, RequestHandle],
    out: SchedulerOutput,
    resp: epb.ExecuteModelResponse,
    record: EngineStep,
    grammar_done: Callable[[Sequence, dict[str, Any]], bool] | None = None,
) -> None:
    """Apply one step's sampled tokens and prompt logprobs to the core and the requests."""
    if resp.prompt_logprobs:
        # Before the tokens: the step that completes a prompt's logprobs also samples its first
        # token, and both must reach Redis in the same write.
        _add_prompt_logprobs(requests, resp, record)
    sampled = resp.sampled
    # The decode lane's tokens come back as one packed list in the lane's order.
    tokens = dict(zip(out.decode_seq_ids, resp.decode_token_ids, strict=True))
    tokens.update({s.seq_id: s.token_id for s in sampled})
    by_id = None  # the full SampledToken, only needed for logprobs
    drawn = _spec_drawn(out, sampled) if out.spec_token_ids else None  # speculative decoding
    for seq in sched.update_from_output(out, tokens, drawn):
        handle = requests.get(seq.req_id)
        if handle is None or handle.finished_in_engine:
            continue
        if drawn is not None and seq.seq_id in out.spec_token_ids:
            status = _process_verified(handle, seq, sampled, out, record)
        elif not handle.params.max_tokens:
            # A prompt-only request (max_tokens 0): the executor sampled nothing for it; it
            # ends with the step that completed its prompt, its prompt logprobs (above) in hand.
            status = RequestStatus.FINISHED_LENGTH
            handle.finish_seq(seq.index, status, None, record)
        elif handle.params.logprobs is None:
            status = handle.process_token(seq.index, tokens[seq.seq_id], 0.0, (), record)
        else:
            by_id = by_id or {s.seq_id: s for s in sampled}
            s = by_id[seq.seq_id]
            status = handle.process_token(seq.index, s.token_id, s.logprob, s.top_logprobs, record)
        if status is None and grammar_done is not None:
            status = _grammar_complete(handle, seq, grammar_done, record)
        if status is not None:
            sched.finish_sequence(seq.seq_id, status, handle.states[seq.index].stop_reason)


def _spec_drawn(out: SchedulerOutput, sampled: Sequence_[epb.SampledToken]) -> dict[str, list[int]]:
    """The target's draws after each proposal; a draft model's proposals come back here too."""
    take_draft_proposals(out, {s.seq_id: list(s.draft_token_ids) for s in sampled})
    return {s.seq_id: [x.token_id for x in s.spec_sampled] for s in sampled if s.spec_sampled}


def _process_verified(
    handle: RequestHandle,
    seq: Sequence,
    sampled: Sequence_[epb.SampledToken],
    out: SchedulerOutput,
    record: EngineStep,
) -> RequestStatus | None:
    """A speculating sequence's accepted run, token by token through the stop checks; tokens
    after one that ends it are dropped from the core's copy too (they never reach a client)."""
    s = next(x for x in sampled if x.seq_id == seq.seq_id)
    n = out.spec_num_accepted[seq.seq_id] + 1
    tokens = seq.token_ids
    start = len(tokens) - n
    entries = [s, *s.spec_sampled[: n - 1]]
    with_logprobs = handle.params.logprobs is not None
    for j in range(n):
        e = entries[j]
        if with_logprobs:
            status = handle.process_token(
                seq.index, tokens[start + j], e.logprob, e.top_logprobs, record
            )
        else:
            status = handle.process_token(seq.index, tokens[start + j], 0.0, (), record)
        if status is not None:
            del tokens[start + j + 1 :]
            return status
    return None


def _grammar_complete(
    handle: RequestHandle,
    seq: Sequence,
    grammar_done: Callable[[Sequence, dict[str, Any]], bool],
    record: EngineStep,
) -> RequestStatus | None:
    """A constrained sequence whose grammar is complete ends with reason stop at once, without
    a step to sample the EOS its mask would now force (structured outputs, scheduler_svc/grammar).
    """
    spec = handle.params.structured_output
    if spec is None or not grammar_done(seq, spec):
        return None
    handle.finish_seq(seq.index, RequestStatus.FINISHED_STOPPED, None, record)
    return RequestStatus.FINISHED_STOPPED


def _add_prompt_logprobs(
    requests: Mapping[str, RequestHandle], resp: epb.ExecuteModelResponse, record: EngineStep
) -> None:
    for msg in resp.prompt_logprobs:
        handle = requests.get(req_id_of(msg.seq_id))
        if handle is not None and not handle.finished_in_engine:
            handle.add_prompt_logprobs(msg, record)
