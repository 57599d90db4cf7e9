"""One ExecuteModel step between the wire and the model runner, in the order the servicer runs
it once the step is validated and its diffs applied (``service.ExecutorServicer._execute``):

1. ``StepWork.of``: what the runner is asked to do (sequences, swap and copy lists);
2. ``run_step``: the runner's forward and sampling, its results checked against the plan;
3. ``record_samples``: sampled tokens appended to the live sequence states;
4. ``build_reply``: the ``ExecuteModelResponse``.

Overlapped steps (``Flight``) split 3: when the step is launched, ``Flight.reserve`` advances
the sequences and appends ``PENDING`` where each will get its token, so the next step can be
validated and launched at once (its inputs take those tokens on the device); ``Flight.settle``
fills them in when the draws reach the host, and gives what the reply carries.

Nothing here takes the lock, rolls back or logs: the servicer owns the state and the
transaction; these functions get exactly what they use.
"""

from __future__ import annotations

import threading
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from executor_svc.api.validation import StepPlan
from executor_svc.features.base import Features, sampled_pb
from executor_svc.runner.launched import PENDING, Launched
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
                features=s.features,
                pending=s.pending,
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
    launched: Launched | None = None  # an overlapped step's draws (None: run through)


def run_step(
    runner: ModelRunner, work: StepWork, plan: StepPlan, defer: bool = False
) -> StepOutput:
    """The forward and sampling of one step; raises when the runner's results do not match the
    plan (the caller rolls the step back). With ``defer`` the draws may still be on their way
    (``StepOutput.launched``; ``by_id`` is then filled by ``Flight.settle``)."""
    out = StepOutput({}, runner.features.outputs())
    args = (work.seqs, work.swap_out, work.swap_in, work.copy)
    ids: AbstractSet[str]
    if defer and not work.is_empty:
        launched = out.launched = runner.launch(*args, **out.outputs, defer=True)
        ids, num_results = set(launched.seq_ids), len(launched.seq_ids)
        if not launched.deferred:
            out.by_id = {r.seq_id: r for r in launched.results()}
    else:
        # Run through (every step of an executor that does not overlap, every CPU one's): the
        # results as they are, no Launched.
        results = runner.execute(*args, **out.outputs) if not work.is_empty else []
        out.by_id = {r.seq_id: r for r in results}
        ids, num_results = out.by_id.keys(), len(results)
    if len(ids) != num_results or not ids <= plan.states.keys():
        raise RuntimeError("model runner returned results for unexpected sequences")
    if any(s.seq_id not in ids for s in plan.lane):
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


class Flight:
    """A launched step whose draws may not be on the host yet (overlapped steps)."""

    def __init__(self, plan: StepPlan, out: StepOutput, t0: float) -> None:
        self.plan = plan
        self.out = out
        self.t0 = t0  # perf_counter() when the step began
        self._samples: Samples | None = None
        self._lock = threading.Lock()
        # (state, index in its token list) per sampling row, as reserved
        self._slots: list[tuple[Any, int]] = []

    @property
    def settled(self) -> bool:
        return self._samples is not None

    def done(self, samples: Samples) -> None:
        """A step run through: its draws were recorded when it ran (``record_samples``)."""
        self._samples = samples

    def reserve(self) -> None:
        """Advance the scheduled sequences and hold a place for each draw (``PENDING``), which
        the next step's inputs take from the device until ``settle`` fills it in."""
        plan, launched = self.plan, self.out.launched
        assert launched is not None
        for s, n in plan.scheduled:
            s.num_computed_tokens += n
        for j, seq_id in enumerate(launched.seq_ids):
            s = plan.states[seq_id]
            idx = len(s.token_ids)
            s.token_ids.append(PENDING)
            s.pending = (launched, j, idx)
            self._slots.append((s, idx))

    def settle(self) -> Samples:
        """Wait for the draws, fill the reserved places, and return what the reply carries
        (once; any thread, any number of times)."""
        if self._samples is None:
            with self._lock:
                if self._samples is None:
                    self._samples = self._fill()
        return self._samples

    def _fill(self) -> Samples:
        launched = self.out.launched
        assert launched is not None
        results = launched.results()
        for (s, idx), r in zip(self._slots, results, strict=True):
            s.token_ids[idx] = r.token_id
        self.out.by_id = by_id = {r.seq_id: r for r in results}
        plan = self.plan
        num_regular = len(plan.scheduled) - len(plan.lane)
        sampled = [
            sampled_pb(r) for s, _ in plan.scheduled[:num_regular] if (r := by_id.get(s.seq_id))
        ]
        lane = [by_id[s.seq_id] for s in plan.lane]
        return Samples(sampled, [r.token_id for r in lane], [r.logprob for r in lane])


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
