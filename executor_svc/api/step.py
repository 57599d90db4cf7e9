"""One ExecuteModel step between the wire and the model runner, in the order the servicer runs
it once the step is validated and its diffs applied (``service.ExecutorServicer._execute``):

1. ``StepWork.of``: what the runner is asked to do (sequences, swap and copy lists);
2. ``run_step``: the runner's forward and sampling, its results checked against the plan;
3. ``record_samples``: sampled tokens appended to the live sequence states;
4. ``build_reply``: the ``ExecuteModelResponse``.

Nothing here takes the lock, rolls back or logs: the servicer owns the state and the
transaction; these functions get exactly what they use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from executor_svc.api.validation import StepPlan
from executor_svc.features.base import Features, sampled_pb
from executor_svc.runner.model_runner import ModelRunner, SampleResult, ScheduledSequence
from protos import executor_pb2 as pb

BlockPairs = list[tuple[int, int]]


@dataclass(slots=True)
class StepWork:
    """What the model runner runs for one step."""

    seqs: list[ScheduledSequence]  # the runner's views of the scheduled SeqStates, in order
    swap_out: BlockPairs
    swap_in: BlockPairs
    copy: BlockPairs

    @classmethod
    def of(cls, request: pb.ExecuteModelRequest, plan: StepPlan) -> StepWork:
        seqs = [
            ScheduledSequence(
                seq_id=s.seq_id,
                token_ids=s.token_ids,
                num_prompt_tokens=s.num_prompt_tokens,
                block_table=s.block_table,
                num_computed_tokens=s.num_computed_tokens,
                num_scheduled_tokens=n,
                sampling_params=s.sampling_params,
            )
            for s, n in plan.scheduled
        ]
        for f in plan.active:  # what the step's features add to the views
            f.prepare(plan, seqs)
        return cls(
            seqs,
            [(m.src, m.dst) for m in request.blocks_to_swap_out],
            [(m.src, m.dst) for m in request.blocks_to_swap_in],
            [(m.src, m.dst) for m in request.blocks_to_copy],
        )

    @property
    def is_empty(self) -> bool:
        return not (self.seqs or self.swap_out or self.swap_in or self.copy)


@dataclass(slots=True)
class StepOutput:
    """What the runner produced: one result per sampling sequence, by seq_id, and what the
    features returned beside the samples, by output name (``Feature.output``)."""

    by_id: dict[str, SampleResult]
    outputs: dict[str, list[Any]] = field(default_factory=dict)


def run_step(runner: ModelRunner, work: StepWork, plan: StepPlan) -> StepOutput:
    """The forward and sampling of one step; raises when the runner's results do not match the
    plan (the caller rolls the step back)."""
    out = StepOutput({}, runner.features.outputs())
    results: list[SampleResult] = []
    if not work.is_empty:
        results = runner.execute(work.seqs, work.swap_out, work.swap_in, work.copy, **out.outputs)
    out.by_id = {r.seq_id: r for r in results}
    if len(out.by_id) != len(results) or not out.by_id.keys() <= plan.states.keys():
        raise RuntimeError("model runner returned results for unexpected sequences")
    if any(s.seq_id not in out.by_id for s in plan.lane):
        raise RuntimeError("model runner sampled nothing for a decode lane sequence")
    return out


@dataclass(slots=True)
class Samples:
    """The step's sampled tokens as the reply carries them."""

    sampled: list[pb.SampledToken]  # regular sequences that sampled
    lane_tokens: list[int]  # the decode lane, in request order
    lane_logprobs: list[float]

    @property
    def num_sampled(self) -> int:
        return len(self.sampled) + len(self.lane_tokens)


def record_samples(plan: StepPlan, by_id: dict[str, SampleResult]) -> Samples:
    """Advance every scheduled sequence by what it computed and append what it sampled (or let
    the feature that owns the result record it: ``Feature.record``)."""
    sampled = []
    num_regular = len(plan.scheduled) - len(plan.lane)
    for s, n in plan.scheduled[:num_regular]:
        s.num_computed_tokens += n
        r = by_id.get(s.seq_id)
        if r is None:
            continue
        sampled.append(sampled_pb(r))
        if not any(f.record(plan, s, r, sampled[-1]) for f in plan.active):
            s.token_ids.append(r.token_id)
    lane_tokens: list[int] = []
    lane_logprobs: list[float] = []
    for s in plan.lane:
        r = by_id[s.seq_id]  # a lane entry always computes its last token: it samples
        s.num_computed_tokens += 1
        s.token_ids.append(r.token_id)
        lane_tokens.append(r.token_id)
        lane_logprobs.append(r.logprob)
    return Samples(sampled, lane_tokens, lane_logprobs)


def build_reply(
    step_id: int,
    samples: Samples,
    out: StepOutput,
    elapsed_s: float,
    draining: bool,
    features: Features,
) -> pb.ExecuteModelResponse:
    response = pb.ExecuteModelResponse(
        step_id=step_id,
        sampled=samples.sampled,
        execute_time_us=int(elapsed_s * 1e6),
        decode_token_ids=samples.lane_tokens,
        decode_logprobs=samples.lane_logprobs,
        draining=draining,
    )
    for f in features.reply:
        f.reply(out.outputs, response)
    return response
