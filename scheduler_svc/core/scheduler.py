"""Scheduling policy for one executor: budgets, chunked prefill, forks, preemption, the step diff.

One step, in order:
  1. running requests in policy order: decodes (one token per sequence) take their blocks
     first; when blocks run out, the lowest-priority, latest-arriving running request (the tail
     of the running list) is preempted, possibly the one asking;
  2. running requests still prefilling take chunks of what budget is left;
  3. swapped requests come back (before any new work; not in a step that preempted, so a CPU
     block freed by a swap-in is never overwritten by a swap-out of the same step);
  4. waiting requests are admitted in policy order while blocks (above the watermark), budget
     and sequence slots last, only when nothing is left swapped and nothing was preempted.

A request gets blocks for every token it knows when it is admitted, so prefill chunks never need
blocks and only decodes (and the fork of n > 1) can run out; that is where preemption happens.
"""

from __future__ import annotations

from scheduler_svc.core.ahead import plan_ahead
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.prefix_wait import (
    prefix_blocks_in_flight,
    uncomputed_prompt_hashes,
    waits_for_prefix,
)
from scheduler_svc.core.request import Request, RequestStatus, Sequence
from scheduler_svc.core.scheduler_output import SchedulerOutput
from scheduler_svc.core.scheduler_state import SchedulerState
from scheduler_svc.core.step_budget import Admit, StepBudget
from scheduler_svc.core.step_entry import add_to_step

__all__ = ["Scheduler", "SchedulerConfig"]

_RUNNING = RequestStatus.RUNNING


class Scheduler(SchedulerState):
    """Plans each step for one executor (the policy); its state lives in SchedulerState."""

    # A waiting request the step limit skipped this many steps starts a drain: no request the
    # limit claims is admitted behind it until it is, so what the step holds runs out.
    starvation_steps = 32

    # ------------------------------------------------------------------ step

    def schedule(self) -> SchedulerOutput:
        """Plan the next step: the four phases of the module docstring, in order.

        When it schedules any token, update_from_output() must get its result before the next
        schedule(). Whatever it holds (drops, swaps, copies) must reach the executor unless
        out.is_empty.
        """
        if self._in_flight:
            raise RuntimeError(
                "schedule() called before update_from_output() of step "
                f"{self._in_flight[-1].step_id}"
            )
        self._step_id += 1
        out = SchedulerOutput(self._step_id)
        step = StepBudget(self.config.max_num_batched_tokens)
        running = self._schedule_running(step, out)
        limit = self.step_limit
        if limit is not None:
            limit.begin(running)
        self._schedule_prefill_chunks(step, out)
        if not out.preempted_req_ids:
            # New work only when nothing was just pushed out (it would be pushed out again).
            self._schedule_swapped(step, out)
            if not self._swapped:
                self._schedule_waiting(step, out)
        if step.added:
            running += step.added
            running.sort(key=_sort_key)
        self._running = running
        # Last, so that sequences ended during this call are dropped in this very step.
        out.finished_seq_ids.extend(self._pending_drops)
        self._pending_drops.clear()
        self._add_host_transfers(out)
        out.total_num_scheduled_tokens = self.config.max_num_batched_tokens - step.tokens
        # A step that computes nothing has no result to wait for: the engine may skip it (or
        # send it for its drops and copies) without calling update_from_output().
        if out.scheduled:
            self._in_flight.append(out)
            if limit is not None:
                limit.scheduled()
        return out

    def schedule_ahead(self) -> SchedulerOutput | None:
        """Async scheduling: the decode step after the one in flight, planned before its
        result is back, or None when only schedule() can tell what comes next (see ahead.py).

        The executor must run it right after the step in flight; both results go to
        update_from_output() in order.
        """
        if len(self._in_flight) != 1 or len(self._swapped):
            return None
        la = self.lookahead
        running = self._running
        if la is not None and la.active(len(running)) and any(map(la.eligible, running)):
            return None  # a lookahead decode's next step depends on what is accepted
        out = plan_ahead(
            self._in_flight[0],
            self._running,
            self.block_manager,
            self.config.max_model_len,
            self._step_id + 1,
            # Waiting requests could only be admitted into a free sequence slot.
            self.config.max_num_seqs if len(self._waiting) else 0,
        )
        if out is None:
            return None
        self._step_id += 1
        out.finished_seq_ids.extend(self._pending_drops)
        self._pending_drops.clear()
        self._add_host_transfers(out)
        self._in_flight.append(out)
        return out

    def _add_host_transfers(self, out: SchedulerOutput) -> None:
        """The host prefix tier's copies planned by this step's allocations (core/host_tier.py)."""
        to_host, from_host = self.block_manager.take_host_transfers()
        out.blocks_to_swap_out += to_host
        out.blocks_to_swap_in += from_host

    def _schedule_running(self, step: StepBudget, out: SchedulerOutput) -> list[Request]:
        """Phase 1: decodes of running requests, best first; victims come off the tail.

        Prefill chunks are only noted here (phase 2 schedules them). Returns the requests
        still running. The steady state, one sequence decoding in place into a block of its
        own, is handled inline: it is most of every busy step.
        """
        running = [r for r in self._running if r.status == _RUNNING]
        lane_ids, lane_computed = out.decode_seq_ids, out.decode_num_computed_tokens
        num_scheduled, scheduled = out.num_scheduled_tokens, out.scheduled
        max_len = self.config.max_model_len
        tokens, num_seqs = step.tokens, step.num_seqs
        i, end = 0, len(running)
        la = self.lookahead if self.lookahead is not None and self.lookahead.active(end) else None
        while i < end:
            req = running[i]
            i += 1
            if len(req.seqs) == 1 and req.forked:  # n == 1
                seq = req.seqs[0]
                nc = seq.num_computed_tokens
                if len(seq.token_ids) - nc > 1:
                    step.prefills.append((req, seq))
                    num_seqs += 1
                    continue
                if (
                    la is not None
                    and seq.sent
                    and (k := la.schedule(self.block_manager, req, seq, tokens, max_len, out))
                ):
                    num_seqs += 1
                    tokens -= 1 + k
                    continue
                if nc < seq.exclusive_until and seq.sent and req.decode_lane:
                    lane_ids.append(seq.seq_id)
                    lane_computed.append(nc)
                    num_scheduled[seq.seq_id] = 1
                    scheduled.append((seq, 1))
                    num_seqs += 1
                    tokens -= 1
                    continue
                if len(seq.token_ids) <= max_len:
                    end = self._decode_one(req, seq, running, i, end, out)
                    if req.status == _RUNNING:
                        num_seqs += 1
                        tokens -= 1
                    continue
            end, seqs_added, tokens_used = self._decode_group(req, running, i, end, step, out)
            num_seqs += seqs_added
            tokens -= tokens_used
        step.tokens, step.num_seqs = tokens, num_seqs
        if out.preempted_req_ids:
            # Prefill entries of a request that preempted itself are stale.
            step.prefills = [(r, s) for r, s in step.prefills if s.status == _RUNNING]
        return [r for r in running[:end] if r.status == _RUNNING]

    def _decode_one(
        self, req: Request, seq: Sequence, running: list[Request], i: int, end: int, out
    ) -> int:
        """One sequence's decode token, with room made by preempting from the tail of
        running[i:end] when needed (possibly req itself). Returns the new end."""
        growth = self.block_manager.grow(seq, 1, out.blocks_to_copy)
        while growth is None:
            end = self._make_room(1, req, running, i, end, out)
            if req.status != _RUNNING:
                return end
            growth = self.block_manager.grow(seq, 1, out.blocks_to_copy)
        add_to_step(self._requests[seq.req_id], seq, 1, growth, out)
        return end

    def _decode_group(
        self,
        req: Request,
        running: list[Request],
        i: int,
        end: int,
        step: StepBudget,
        out: SchedulerOutput,
    ) -> tuple[int, int, int]:
        """Decodes of a request with several sequences (or one about to fork), as one unit:
        they share blocks, so the room they need is counted together. Returns the new end,
        the sequences it adds to the step and the tokens it schedules."""
        bm = self.block_manager
        if not req.forked:
            seq0 = req.seqs[0]
            num_seqs = req.sampling_params.n
            if seq0.num_computed_tokens < req.num_prompt_tokens - 1:
                step.prefills.append((req, seq0))
                return end, num_seqs, 0
            decode_seqs = None  # fork first
            need = req.sampling_params.n - 1  # copy-on-write of the shared last block
        else:
            decode_seqs, num_seqs = [], 0
            for seq in req.seqs:
                if seq.status != _RUNNING:
                    continue
                if len(seq.token_ids) - seq.num_computed_tokens > 1:
                    step.prefills.append((req, seq))
                elif len(seq.token_ids) > self.config.max_model_len:  # behind the output checks
                    self.finish_sequence(seq.seq_id, RequestStatus.FINISHED_LENGTH)
                    continue
                else:
                    decode_seqs.append(seq)
                num_seqs += 1
            if not decode_seqs:
                return end, num_seqs, 0
            need = bm.num_blocks_to_compute(decode_seqs)
        if need > bm.num_free_blocks:
            end = self._make_room(need, req, running, i, end, out)
            if req.status != _RUNNING:
                return end, num_seqs - req.num_seqs_when_running, 0
        for seq in decode_seqs if decode_seqs is not None else self._fork(req):
            self._schedule_seq(seq, 1, out)
        return end, num_seqs, len(req.seqs if decode_seqs is None else decode_seqs)

    def _schedule_prefill_chunks(self, step: StepBudget, out: SchedulerOutput) -> None:
        """Phase 2: prefill chunks of running requests (their blocks came on admission)."""
        for req, seq in step.prefills:
            if step.tokens <= 0:
                break
            step.tokens -= self._schedule_chunk(req, seq, step.tokens, out)

    def _schedule_swapped(self, step: StepBudget, out: SchedulerOutput) -> None:
        """Phase 3: swapped requests come back, oldest first, before any new work."""
        bm = self.block_manager
        limit = self.step_limit
        while step.tokens > 0 and (req := self._swapped.peek()) is not None:
            live = req.live_seqs
            n = req.num_seqs_when_running
            if step.num_seqs + n > self.config.max_num_seqs or step.tokens < len(live):
                break
            if limit is not None and not limit.admits(req):
                break  # it waits for a step the limit admits it to
            need = bm.num_blocks_to_swap_in(live) + self._blocks_to_resume(req, live)
            if not self._can_take(need, req, "swap it back in"):
                if req.is_finished:
                    continue
                break
            self._swapped.pop()
            if limit is not None:
                limit.add(req)
            out.blocks_to_swap_in.extend(bm.swap_in(live))
            self._set_status(req, live, _RUNNING)
            if not req.forked and live[0].num_computed_tokens == req.num_prompt_tokens - 1:
                live = self._fork(req)
            for seq in live:
                if step.tokens <= 0:
                    break
                step.tokens -= self._schedule_chunk(req, seq, step.tokens, out)
            step.num_seqs += n
            step.added.append(req)

    def _schedule_waiting(self, step: StepBudget, out: SchedulerOutput) -> None:
        """Phase 4: new (or recomputed) requests in policy order, while they fit.

        A request whose next uncached prompt block is being computed right now by a running
        request (one admitted this step included) waits for it: a step later that block is in
        the prefix cache and the request skips it, instead of computing the same prefix again
        beside it (a burst of requests with one long system prompt computes it once).

        A request the step limit refuses (core/step_budget.py) is skipped for this step,
        keeping its place in the queue (vLLM does the same).
        """
        skipped: list[Request] = []
        try:
            self._admit_waiting(step, out, skipped)
        finally:
            for req in skipped:  # back in their places: first in line once the limit admits
                self._waiting.push(req)
        if self._skipped:  # forget the ones admitted, aborted or ended meanwhile
            for req_id in [r for r in self._skipped if r not in self._waiting]:
                del self._skipped[req_id]

    def _admit_waiting(
        self, step: StepBudget, out: SchedulerOutput, skipped: list[Request]
    ) -> None:
        inflight: set[bytes] | None = None
        limit = self.step_limit
        drain = False  # a request starves for the limit: what it claims stops coming in
        while step.tokens > 0 and (req := self._waiting.peek()) is not None:
            n = req.num_seqs_when_running
            if step.num_seqs + n > self.config.max_num_seqs:
                break
            if limit is not None:
                if not limit.admits(req):
                    # Skipped for this step (no head-of-line blocking): requests behind it
                    # that the limit admits go on.
                    since = self._skipped.setdefault(req.req_id, self._step_id)
                    drain = drain or self._step_id - since >= self.starvation_steps
                    skipped.append(self._waiting.pop())
                    continue
                if drain and limit.claims(req):
                    skipped.append(self._waiting.pop())
                    continue
            if self.block_manager.enable_prefix_caching:
                if inflight is None:
                    inflight = prefix_blocks_in_flight(self.block_manager, self._running)
                if waits_for_prefix(self.block_manager, req, inflight):
                    break
            admitted = self._admit(req, step, out)
            if admitted is Admit.ENDED:  # it could never fit and has been ended
                continue
            if admitted is Admit.WAIT:
                break
            step.num_seqs += n
            step.added.append(req)
            if limit is not None:
                limit.add(req)
            if inflight is not None:
                inflight.update(uncomputed_prompt_hashes(self.block_manager, req))

    def _make_room(
        self,
        need: int,
        req: Request,
        running: list[Request],
        i: int,
        end: int,
        out: SchedulerOutput,
    ) -> int:
        """Preempt from the tail of running[i:end] until `need` blocks are free.

        The tail is the lowest-priority, latest-arriving work; none of it has been scheduled
        this step. When nothing is left behind req, req itself goes. Returns the new end.
        """
        while need > self.block_manager.num_free_blocks:
            if end > i:
                end -= 1
                self._preempt(running[end], out)
            else:
                self._preempt(req, out)
                break
        return end

    def _can_take(self, need: int, req: Request, what: str) -> bool:
        """Whether `need` blocks may go to new or resumed work; ends req if it never can."""
        bm = self.block_manager
        free = bm.num_free_blocks
        if free == bm.num_device_blocks:
            # Nothing holds a block, so the watermark protects nobody.
            if need <= free:
                return True
            self._end_request(
                req,
                RequestStatus.FINISHED_ERROR,
                f"needs {need} KV cache blocks to {what} but the executor has {free}",
            )
            return False
        return free - need >= bm.watermark_blocks

    def _admit(self, req: Request, step: StepBudget, out: SchedulerOutput) -> Admit:
        """Give a waiting request its blocks and first chunks (charged to `step`)."""
        bm = self.block_manager
        live = req.live_seqs
        hits, need = bm.plan_admission(live)
        if not self._can_take(need, req, "compute its prompt"):
            return Admit.ENDED if req.is_finished else Admit.WAIT
        self._waiting.pop()
        bm.allocate_group(live, hits, [len(s.token_ids) for s in live])
        self._set_status(req, live, _RUNNING)
        for seq in live:
            if step.tokens <= 0:
                break
            step.tokens -= self._schedule_chunk(req, seq, step.tokens, out)
        return Admit.ADMITTED

    def _blocks_to_resume(self, req: Request, live: list[Sequence]) -> int:
        """Blocks a swapped request needs, beyond its own, to run right after swap-in."""
        if not req.forked:
            seq0 = req.seqs[0]
            done = seq0.num_computed_tokens == req.num_prompt_tokens - 1
            return req.sampling_params.n - 1 if done else 0
        return self.block_manager.num_blocks_to_compute(live, on_cpu=True)

    def _schedule_chunk(
        self, req: Request, seq: Sequence, budget: int, out: SchedulerOutput
    ) -> int:
        """Schedule as much of seq's remaining tokens as budget and threshold allow."""
        # Before the fork, sequence 0 stops short of the last prompt token: each forked
        # sequence computes that one itself and samples from its own logits.
        target = len(seq.token_ids) if req.forked else req.num_prompt_tokens - 1
        num = min(target - seq.num_computed_tokens, budget)
        threshold = self.config.long_prefill_token_threshold
        if threshold is not None and num > threshold:
            num = threshold
        if num <= 0:
            return 0
        self._schedule_seq(seq, num, out)
        return num

    def _schedule_seq(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> None:
        """Room for seq's next `num_tokens` tokens (the caller checked the free blocks), then
        its entry in the step."""
        growth = self.block_manager.grow(seq, num_tokens, out.blocks_to_copy)
        assert growth is not None, f"{seq.seq_id}: room was checked before scheduling"
        add_to_step(self._requests[seq.req_id], seq, num_tokens, growth, out)

    def _fork(self, req: Request) -> list[Sequence]:
        parent = req.seqs[0]
        children = req.fork()
        self.block_manager.fork(parent, children)
        for child in children:
            self._seqs[child.seq_id] = child
        return req.seqs

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        bm = self.block_manager
        live = req.live_seqs
        for seq in live:
            if seq.sent:
                out.finished_seq_ids.append(seq.seq_id)
                seq.sent = False
        if self.config.preemption_mode == "swap" and bm.can_swap_out(live) and req.swappable:
            out.blocks_to_swap_out.extend(bm.swap_out(live))
            self._set_status(req, live, RequestStatus.SWAPPED)
            self._swapped.push(req)
        else:
            for seq in live:
                bm.free(seq)
                seq.num_computed_tokens = 0
                seq.num_cached_blocks = 0
            self._set_status(req, live, RequestStatus.WAITING)
            self._unfork_if_untouched(req)
            # Its sort key puts it ahead of everything that arrived later.
            self._waiting.push(req)
        out.preempted_req_ids.append(req.req_id)
        self.num_preemptions += 1


def _sort_key(req: Request) -> tuple:
    return req.sort_key
