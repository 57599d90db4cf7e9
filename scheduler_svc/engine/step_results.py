"""What the engine does with one ExecuteModel reply, as a function the benchmarks call too.

Per sequence that got a token: the scheduler core appends it (update_from_output), the request's
taker applies it to the request's output state (stop checks, detokenizing) and the step's record
collects the Redis append and the acknowledged-stream delta. Sequences the stop checks end are
finished in the scheduler core at once (their blocks are free for the next step); the core
reports the requests that ended with them once per step (`take_finished_requests`).

Features take part through two hooks and are named nowhere here (scheduler_svc/features):
`on_reply` runs before the tokens (what else the reply carries, and a run of verified tokens
gets its own taker for the step), and each request's `take` was chosen once when it was
admitted (with or without logprobs, or a feature's).
This runs once per step for every running sequence, so it is kept to plain loops over plain
data.
"""

from __future__ import annotations

from collections.abc import Mapping

from protos import executor_pb2 as epb
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.scheduler_output import SchedulerOutput
from scheduler_svc.engine.streams import EngineStep, RequestHandle
from scheduler_svc.features.base import NO_FEATURES, Features, StepReply

__all__ = ["process_step_outputs"]


def process_step_outputs(
    sched: Scheduler,
    requests: Mapping[str, RequestHandle],
    out: SchedulerOutput,
    resp: epb.ExecuteModelResponse,
    record: EngineStep,
    features: Features = NO_FEATURES,
) -> None:
    """Apply one step's reply to the core and the requests."""
    reply = StepReply(out, resp, record)
    for hook in features.on_reply:
        hook(requests, reply)
    takers = reply.takers
    for seq in sched.update_from_output(out, reply.tokens, reply.drawn):
        handle = requests.get(seq.req_id)
        if handle is None or handle.finished_in_engine:
            continue
        take = takers.get(seq.seq_id, handle.take) if takers else handle.take
        status = take(handle, seq, reply)
        if status is not None:
            sched.finish_sequence(seq.seq_id, status, handle.states[seq.index].stop_reason)
