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

from executor_svc.api.seq_state import SeqState
from executor_svc.api.validation import StepPlan
from executor_svc.runner.draft import draft_computed_after
from executor_svc.runner.model_runner import (
    ModelRunner,
    PromptLogprobResult,
    SampleResult,
    ScheduledSequence,
)
from executor_svc.runner.pooling import PooledResult, pooled_to_proto
from executor_svc.runner.spec_verify import accept, blocks_to_keep
from protos import executor_pb2 as pb

BlockPairs = list[tuple[int, int]]


@dataclass(slots=True)
class StepWork:
    """What the model runner runs for one step."""

    seqs: list[ScheduledSequence]
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
                token_mask=plan.token_masks.get(s.seq_id) if plan.token_masks else None,
                lora_name=s.lora_name,
                lora_path=s.lora_path,
            )
            for s, n in plan.scheduled
        ]
        if plan.draft:  # the draft proposes in the runner (runner/draft.py)
            for seq in seqs:
                if seq.seq_id in plan.draft:
                    seq.num_draft_tokens = plan.draft[seq.seq_id]
                    seq.draft_num_computed = plan.states[seq.seq_id].draft_num_computed
        if plan.spec:  # proposals ride after the known tokens (runner/spec_verify.py)
            for seq in seqs:
                spec = plan.spec.get(seq.seq_id)
                if spec:
                    seq.token_ids = seq.token_ids + spec
                    seq.spec_token_ids = spec
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
    """What the runner produced: one result per sampling sequence, by seq_id, and the prompt
    logprobs asked for."""

    by_id: dict[str, SampleResult]
    prompt_logprobs: list[PromptLogprobResult] = field(default_factory=list)
    pooled: list[PooledResult] = field(default_factory=list)  # embeddings (runner/pooling.py)


def run_step(runner: ModelRunner, work: StepWork, plan: StepPlan) -> StepOutput:
    """The forward and sampling of one step; raises when the runner's results do not match the
    plan (the caller rolls the step back)."""
    out = StepOutput({})
    results: list[SampleResult] = []
    if not work.is_empty:
        results = runner.execute(
            work.seqs,
            work.swap_out,
            work.swap_in,
            work.copy,
            out.prompt_logprobs,
            pooled=out.pooled,
        )
    for s in work.seqs if plan.draft else ():
        if s.num_draft_tokens:  # verified like the scheduler's proposals from here on
            plan.spec[s.seq_id] = list(s.spec_token_ids)
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
    """Advance every scheduled sequence by what it computed and append what it sampled."""
    sampled = []
    num_regular = len(plan.scheduled) - len(plan.lane)
    for s, n in plan.scheduled[:num_regular]:
        s.num_computed_tokens += n
        r = by_id.get(s.seq_id)
        if r is None:
            continue
        k = plan.draft.get(s.seq_id, 0) if plan.draft else 0
        num_known = len(s.token_ids)
        if r.spec is not None:
            accepted = record_verified(s, plan.spec[s.seq_id], r, plan.block_size)
            if k:
                s.draft_num_computed = draft_computed_after(num_known, k, accepted)
        else:
            s.token_ids.append(r.token_id)
        sampled.append(_sampled_pb(r))
        if r.spec:
            sampled[-1].spec_sampled.extend(_sampled_pb(x) for x in r.spec)
        if k:
            sampled[-1].draft_token_ids.extend(plan.spec[s.seq_id])
    lane_tokens: list[int] = []
    lane_logprobs: list[float] = []
    for s in plan.lane:
        r = by_id[s.seq_id]  # a lane entry always computes its last token: it samples
        s.num_computed_tokens += 1
        s.token_ids.append(r.token_id)
        lane_tokens.append(r.token_id)
        lane_logprobs.append(r.logprob)
    return Samples(sampled, lane_tokens, lane_logprobs)


def _sampled_pb(r: SampleResult) -> pb.SampledToken:
    return pb.SampledToken(
        seq_id=r.seq_id,
        token_id=r.token_id,
        logprob=r.logprob,
        top_logprobs=[pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in r.top_logprobs],
    )


def record_verified(s: SeqState, proposed: list[int], r: SampleResult, block_size: int) -> int:
    """A verifying sequence keeps the draws up to the first rejected proposal; the KV of the
    rejected positions is left behind (overwritten later) and the blocks past what its known
    tokens need go back to the scheduler, which drops the same ones. Returns the number of
    proposals accepted."""
    assert r.spec is not None
    drawn = [r.token_id, *(x.token_id for x in r.spec)]
    accepted = accept(proposed, drawn)
    s.num_computed_tokens -= len(proposed) - accepted
    s.token_ids.extend(drawn[: accepted + 1])
    keep = blocks_to_keep(len(s.block_table), len(s.token_ids), block_size)
    if keep < len(s.block_table):
        s.block_table[:] = s.block_table.tolist()[:keep]
    return accepted


def build_reply(
    step_id: int, samples: Samples, out: StepOutput, elapsed_s: float, draining: bool
) -> pb.ExecuteModelResponse:
    return pb.ExecuteModelResponse(
        step_id=step_id,
        sampled=samples.sampled,
        execute_time_us=int(elapsed_s * 1e6),
        decode_token_ids=samples.lane_tokens,
        decode_logprobs=samples.lane_logprobs,
        prompt_logprobs=[_prompt_logprobs_pb(r) for r in out.prompt_logprobs],
        draining=draining,
        pooled=pooled_to_proto(out.pooled),
    )


def _prompt_logprobs_pb(r: PromptLogprobResult) -> pb.PromptLogprobs:
    return pb.PromptLogprobs(
        seq_id=r.seq_id,
        first_position=r.first_position,
        entries=[
            pb.PromptTokenLogprob(
                logprob=lp,
                top_logprobs=[pb.TokenLogprob(token_id=t, logprob=v) for t, v in top],
            )
            for lp, top in zip(r.logprobs, r.top, strict=True)
        ],
    )
