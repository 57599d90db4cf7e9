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

from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.errors import QueueFull
from scheduler_svc.core.request import Request, RequestStatus, Sequence
from scheduler_svc.core.request_queue import RequestQueue
from scheduler_svc.core.scheduler_output import (
    CachedSeqData,
    NewSeqData,
    SchedulerOutput,
    SchedulerStats,
)

_RUNNING = RequestStatus.RUNNING


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(
            block_size=config.block_size,
            num_device_blocks=config.num_device_blocks,
            num_cpu_blocks=config.num_cpu_blocks,
            watermark=config.watermark,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self._waiting = RequestQueue()
        self._swapped = RequestQueue()
        # Running requests in policy order (best first); finished ones are dropped lazily by
        # the next schedule(), which walks the list anyway.
        self._running: list[Request] = []
        self._requests: dict[str, Request] = {}  # unfinished requests
        self._seqs: dict[str, Sequence] = {}  # unfinished sequences
        self._pending_drops: list[str] = []  # sent sequences that ended between steps
        self._finished: list[Request] = []  # since take_finished_requests()
        self._num_added = 0  # tie-break of equal arrival times: order of add_request
        self._step_id = 0
        self._in_flight: SchedulerOutput | None = None
        self.num_preemptions = 0

    # ------------------------------------------------------------------ requests

    def add_request(self, req: Request) -> None:
        """Queue a request. Raises QueueFull at the waiting cap, ValueError on a duplicate id.

        A request that can never run here (too long for max_model_len or the whole cache, or
        n above max_num_seqs) is finished at once with FINISHED_ERROR and req.error; it shows up
        in take_finished_requests().
        """
        if req.req_id in self._requests:
            raise ValueError(f"request {req.req_id!r} is already active")
        if len(self._waiting) >= self.config.max_waiting:
            raise QueueFull(
                f"the waiting queue is full ({self.config.max_waiting} requests); retry later"
            )
        self._num_added += 1
        if self.config.policy == "priority":
            req.sort_key = (-req.priority, req.arrival_time, self._num_added)
        else:
            req.sort_key = (req.arrival_time, self._num_added)
        self._requests[req.req_id] = req
        live = [s for s in req.seqs if not s.is_finished]
        for seq in live:
            seq.status = RequestStatus.WAITING
            self._seqs[seq.seq_id] = seq
        error = self.config.never_fits_reason(req, live)
        if not live or error:
            status = RequestStatus.FINISHED_ERROR if error else req.seqs[-1].status
            self._end_request(req, status, error)
            return
        req.status = RequestStatus.WAITING
        self._waiting.push(req)

    def abort_request(self, req_id: str) -> bool:
        """End a request now and free its blocks; False when it is unknown or already ended.

        The executor is told to drop its sequences in the next step's finished_seq_ids.
        """
        req = self._requests.get(req_id)
        if req is None:
            return False
        self._end_request(req, RequestStatus.FINISHED_ABORTED)
        return True

    def finish_sequence(
        self, seq_id: str, status: RequestStatus, stop_reason: int | str | None = None
    ) -> bool:
        """End one sequence (a stop condition); the request ends with its last sequence.

        Returns False when the sequence is unknown or already ended.
        """
        if not RequestStatus.is_finished(status):
            raise ValueError(f"finish_sequence needs a finished status, got {status!r}")
        seq = self._seqs.get(seq_id)
        if seq is None:
            return False
        req = self._requests[seq.req_id]
        self._end_seq(seq, status, stop_reason)
        if not req.forked or all(s.is_finished for s in req.seqs):
            self._end_request(req, status)
        return True

    def _end_seq(
        self, seq: Sequence, status: RequestStatus, stop_reason: int | str | None = None
    ) -> None:
        seq.status = status
        seq.stop_reason = stop_reason
        self.block_manager.free(seq)
        if seq.sent:
            self._pending_drops.append(seq.seq_id)
            seq.sent = False
        self._seqs.pop(seq.seq_id, None)

    def _end_request(self, req: Request, status: RequestStatus, error: str | None = None) -> None:
        for seq in req.seqs:
            if not seq.is_finished:
                self._end_seq(seq, status)
        if not req.forked:
            # Sequences 1..n-1 were never forked: they end with the same status, so every one
            # of the n sequences has a final state to report.
            for child in req.fork():
                child.status = req.seqs[0].status
        req.status = status
        req.error = error
        self._waiting.remove(req.req_id)
        self._swapped.remove(req.req_id)
        del self._requests[req.req_id]
        self._finished.append(req)

    def take_finished_requests(self) -> list[Request]:
        """Requests ended since the last call (by the scheduler itself, abort, or finish)."""
        out, self._finished = self._finished, []
        return out

    def reset_executor(self) -> None:
        """The executor lost its state: everything running or swapped is recomputed from scratch.

        Any step in flight is discarded (its update_from_output becomes a no-op).
        """
        self._in_flight = None
        self._pending_drops.clear()
        requeue = [r for r in self._running if r.status == _RUNNING]
        requeue += self._swapped.ordered()
        self._running = []
        self._swapped.clear()
        self.block_manager.reset()
        for req in requeue:
            for seq in req.live_seqs:
                seq.sent = False
                seq.num_computed_tokens = 0
                seq.num_cached_blocks = 0
                seq.status = RequestStatus.WAITING
            self._unfork_if_untouched(req)
            req.status = RequestStatus.WAITING
            self._waiting.push(req)

    # ------------------------------------------------------------------ step

    def schedule(self) -> SchedulerOutput:
        """Plan the next step.

        When it schedules any token, update_from_output() must get its result before the next
        schedule(). Whatever it holds (drops, swaps, copies) must reach the executor unless
        out.is_empty.
        """
        if self._in_flight is not None:
            raise RuntimeError(
                f"schedule() called before update_from_output() of step {self._in_flight.step_id}"
            )
        cfg = self.config
        bm = self.block_manager
        self._step_id += 1
        out = SchedulerOutput(self._step_id)
        budget = cfg.max_num_batched_tokens
        max_len = cfg.max_model_len

        # 1. Decodes of running requests, best first; victims come off the tail.
        running = [r for r in self._running if r.status == _RUNNING]
        prefills: list[tuple[Request, Sequence]] = []
        num_seqs = 0
        end = len(running)
        i = 0
        bs = cfg.block_size
        pool = bm.pool
        scheduled = out.scheduled
        cached_seqs = out.cached_seqs
        num_scheduled = out.num_scheduled_tokens
        lane_ids = out.decode_seq_ids
        lane_computed = out.decode_num_computed_tokens
        while i < end:
            req = running[i]
            i += 1
            if len(req.seqs) == 1 and req.forked:
                # Fast path for one sequence (n == 1, the common case): same decisions as the
                # general path below, with the block arithmetic and the diff inlined.
                seq = req.seqs[0]
                nc = seq.num_computed_tokens
                num_tokens = len(seq.token_ids)
                table = seq.block_table
                if num_tokens - nc > 1:
                    prefills.append((req, seq))
                    num_seqs += 1
                    continue
                grow = nc >= len(table) * bs
                if num_tokens <= max_len and (grow or pool.blocks[table[nc // bs]].ref_cnt == 1):
                    if grow and pool.num_free == 0:
                        end = self._make_room(1, req, running, i, end, out)
                        if req.status != _RUNNING:
                            continue
                    num_seqs += 1
                    budget -= 1
                    if not seq.sent:
                        self._schedule_seq(seq, 1, out)
                        continue
                    if grow:
                        bid = pool.allocate().block_id
                        table.append(bid)
                        cached_seqs.append(CachedSeqData(seq.seq_id, [bid], [], 1, nc))
                    elif req.decode_lane:
                        lane_ids.append(seq.seq_id)
                        lane_computed.append(nc)
                    else:
                        cached_seqs.append(CachedSeqData(seq.seq_id, [], [], 1, nc))
                    num_scheduled[seq.seq_id] = 1
                    scheduled.append((seq, 1))
                    continue
            if not req.forked:
                seq0 = req.seqs[0]
                num_seqs += req.sampling_params.n
                if seq0.num_computed_tokens < req.num_prompt_tokens - 1:
                    prefills.append((req, seq0))
                    continue
                decode_seqs = None  # fork first
                need = req.sampling_params.n - 1  # copy-on-write of the shared last block
            else:
                decode_seqs = []
                for seq in req.seqs:
                    if seq.status != _RUNNING:
                        continue
                    if len(seq.token_ids) - seq.num_computed_tokens > 1:
                        prefills.append((req, seq))
                    elif len(seq.token_ids) > max_len:  # safety net behind the output processor
                        self.finish_sequence(seq.seq_id, RequestStatus.FINISHED_LENGTH)
                        continue
                    else:
                        decode_seqs.append(seq)
                    num_seqs += 1
                if not decode_seqs:
                    continue
                need = bm.num_blocks_to_compute(decode_seqs)
            if need > bm.num_free_blocks:
                end = self._make_room(need, req, running, i, end, out)
                if req.status != _RUNNING:
                    num_seqs -= req.num_seqs_when_running
                    continue
            if decode_seqs is None:
                decode_seqs = self._fork(req)
            for seq in decode_seqs:
                self._schedule_seq(seq, 1, out)
            budget -= len(decode_seqs)
        preempted = bool(out.preempted_req_ids)
        if preempted:
            # Prefill entries of a request that preempted itself are stale.
            prefills = [(r, s) for r, s in prefills if s.status == _RUNNING]
        kept = [r for r in running[:end] if r.status == _RUNNING]

        # 2. Prefill chunks of running requests (their blocks were allocated on admission).
        for req, seq in prefills:
            if budget <= 0:
                break
            budget -= self._schedule_chunk(req, seq, budget, out)

        # 3. Swapped requests come back before any new work.
        added: list[Request] = []
        while not preempted and budget > 0 and (req := self._swapped.peek()) is not None:
            live = req.live_seqs
            n = req.num_seqs_when_running
            if num_seqs + n > cfg.max_num_seqs or budget < len(live):
                break
            need = bm.num_blocks_to_swap_in(live) + self._blocks_to_resume(req, live)
            if not self._can_take(need, req, "swap it back in"):
                if req.is_finished:
                    continue
                break
            self._swapped.pop()
            out.blocks_to_swap_in.extend(bm.swap_in(live))
            self._set_status(req, live, _RUNNING)
            if not req.forked and live[0].num_computed_tokens == req.num_prompt_tokens - 1:
                live = self._fork(req)
            for seq in live:
                if budget <= 0:
                    break
                budget -= self._schedule_chunk(req, seq, budget, out)
            num_seqs += n
            added.append(req)

        # 4. New (or recomputed) requests.
        while (
            not preempted
            and not self._swapped
            and budget > 0
            and (req := self._waiting.peek()) is not None
        ):
            n = req.num_seqs_when_running
            if num_seqs + n > cfg.max_num_seqs:
                break
            admitted = self._admit(req, budget, out)
            if admitted is None:  # it could never fit and has been ended
                continue
            if admitted is False:
                break
            budget -= admitted
            num_seqs += n
            added.append(req)

        if added:
            kept += added
            kept.sort(key=_sort_key)
        self._running = kept
        # Last, so that sequences ended during this call are dropped in this very step.
        out.finished_seq_ids.extend(self._pending_drops)
        self._pending_drops.clear()
        out.total_num_scheduled_tokens = cfg.max_num_batched_tokens - budget
        # A step that computes nothing has no result to wait for: the engine may skip it (or
        # send it for its drops and copies) without calling update_from_output().
        self._in_flight = out if out.scheduled else None
        return out

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

    def _admit(self, req: Request, budget: int, out: SchedulerOutput) -> int | bool | None:
        """Give a waiting request its blocks and first chunks.

        Returns the tokens scheduled (possibly 0), False when it must wait (head-of-line), None
        when it can never fit and was ended.
        """
        bm = self.block_manager
        live = req.live_seqs
        hits = []
        need = 0
        free_hits: set[int] = set()
        for seq in live:
            # Bound the hit below the tokens to compute, so at least one is computed.
            seq_hits = bm.find_cached_prefix(seq, len(seq.token_ids) - 1)
            hits.append(seq_hits)
            need += bm.num_blocks_for(len(seq.token_ids)) - len(seq_hits)
            free_hits.update(b.block_id for b in seq_hits if b.ref_cnt == 0)
        need += len(free_hits)
        if not self._can_take(need, req, "compute its prompt"):
            return None if req.is_finished else False
        self._waiting.pop()
        bm.allocate_group(live, hits, [len(s.token_ids) for s in live])
        self._set_status(req, live, _RUNNING)
        used = 0
        for seq in live:
            if used >= budget:
                break
            used += self._schedule_chunk(req, seq, budget - used, out)
        return used

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
        new_ids, replaced = self.block_manager.prepare_compute(seq, num_tokens, out.blocks_to_copy)
        sid = seq.seq_id
        if (
            seq.sent
            and num_tokens == 1
            and not new_ids
            and not replaced
            and seq.num_computed_tokens + 1 == len(seq.token_ids)
            and self._requests[seq.req_id].decode_lane
        ):
            out.decode_seq_ids.append(sid)
            out.decode_num_computed_tokens.append(seq.num_computed_tokens)
        elif seq.sent:
            out.cached_seqs.append(
                CachedSeqData(
                    sid,
                    new_ids,
                    [replaced] if replaced else [],
                    num_tokens,
                    seq.num_computed_tokens,
                )
            )
        else:
            req = self._requests[seq.req_id]
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
                )
            )
            seq.sent = True
        out.num_scheduled_tokens[sid] = num_tokens
        out.scheduled.append((seq, num_tokens))

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
        if self.config.preemption_mode == "swap" and bm.can_swap_out(live):
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

    def _unfork_if_untouched(self, req: Request) -> None:
        """Undo a fork whose sequences have no output yet: recompute the prompt once again."""
        if req.sampling_params.n == 1 or not req.forked:
            return
        if any(s.num_output_tokens or s.is_finished for s in req.seqs):
            return
        for child in req.seqs[1:]:
            self._seqs.pop(child.seq_id, None)
        del req.seqs[1:]
        req.forked = False

    @staticmethod
    def _set_status(req: Request, live: list[Sequence], status: RequestStatus) -> None:
        req.status = status
        for seq in live:
            seq.status = status

    def update_from_output(
        self, output: SchedulerOutput, sampled: dict[str, int]
    ) -> list[Sequence]:
        """Apply a step's results: advance computed counts, append sampled tokens.

        Returns the sequences that got a token, in batch order. Sequences that ended while the
        step was in flight are skipped; an output discarded by reset_executor() is ignored.
        """
        if output is not self._in_flight:
            return []
        self._in_flight = None
        bm = self.block_manager
        caching = bm.enable_prefix_caching
        bs = bm.block_size
        got = []
        for seq, num in output.scheduled:
            if seq.status != _RUNNING:
                continue
            nc = seq.num_computed_tokens + num
            seq.num_computed_tokens = nc
            tokens = seq.token_ids
            if nc == len(tokens):
                token = sampled.get(seq.seq_id)
                if token is None:
                    raise ValueError(f"the executor returned no token for {seq.seq_id!r}")
                tokens.append(token)
                got.append(seq)
            if caching and nc // bs > seq.num_cached_blocks:
                bm.cache_full_blocks(seq)
        return got

    # ------------------------------------------------------------------ introspection

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return sum(1 for r in self._running if r.status == _RUNNING)

    @property
    def num_swapped(self) -> int:
        return len(self._swapped)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    @property
    def num_device_blocks(self) -> int:
        return self.block_manager.num_device_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    def unfinished_request_ids(self) -> list[str]:
        """Every request not ended yet: waiting, running or swapped."""
        return list(self._requests)

    def running_request_ids(self) -> list[str]:
        return [r.req_id for r in self._running if r.status == _RUNNING]

    def waiting_request_ids(self) -> list[str]:
        return [r.req_id for r in self._waiting.ordered()]

    def swapped_request_ids(self) -> list[str]:
        return [r.req_id for r in self._swapped.ordered()]

    def get_request(self, req_id: str) -> Request | None:
        return self._requests.get(req_id)

    def get_stats(self) -> SchedulerStats:
        bm = self.block_manager
        running = [r for r in self._running if r.status == _RUNNING]
        return SchedulerStats(
            num_waiting=len(self._waiting),
            num_running=len(running),
            num_swapped=len(self._swapped),
            num_running_seqs=sum(r.num_seqs_when_running for r in running),
            num_device_blocks=bm.num_device_blocks,
            num_free_blocks=bm.num_free_blocks,
            num_cpu_blocks=bm.num_cpu_blocks,
            num_free_cpu_blocks=bm.num_free_cpu_blocks,
            kv_cache_usage=bm.usage,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
        )

    def check_invariants(self) -> None:
        """Block-level invariants, plus: with no unfinished request, every block is free."""
        self.block_manager.check_invariants(expect_empty=not self._requests)


def _sort_key(req: Request) -> tuple:
    return req.sort_key
