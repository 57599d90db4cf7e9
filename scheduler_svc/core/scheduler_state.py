"""What one executor's scheduler holds between steps: its requests and queues, how requests
enter and end, how a step's result changes them (update_from_output), and what can be read
about them. The policy that plans a step is
`scheduler.Scheduler`, built on this."""

from __future__ import annotations

import copy

from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.block_pool import Block
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.errors import QueueFull
from scheduler_svc.core.request import Request, RequestStatus, Sequence
from scheduler_svc.core.request_queue import RequestQueue
from scheduler_svc.core.scheduler_output import SchedulerOutput, SchedulerStats

__all__ = ["SchedulerState"]

_RUNNING = RequestStatus.RUNNING


class SchedulerState:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(
            block_size=config.block_size,
            num_device_blocks=config.num_device_blocks,
            num_cpu_blocks=config.num_cpu_blocks,
            watermark=config.watermark,
            enable_prefix_caching=config.enable_prefix_caching,
            num_host_cache_blocks=config.num_host_cache_blocks,
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
        # Steps scheduled and not yet given back to update_from_output(), oldest first: one,
        # or two when schedule_ahead() planned the next while the first was running.
        self._in_flight: list[SchedulerOutput] = []
        self.num_preemptions = 0
        # A feature's admission constraint per step (core/step_budget.py), this core's own.
        self.step_limit = config.step_limit() if config.step_limit is not None else None
        # Waiting requests the step limit skipped: req_id -> step of the first skip.
        self._skipped: dict[str, int] = {}
        # Decodes with lookahead positions (core/lookahead.py), this core's own; None: none.
        self.lookahead = config.lookahead() if config.lookahead is not None else None

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

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: dict[str, int],
        spec_drawn: dict[str, list[int]] | None = None,
    ) -> list[Sequence]:
        """Apply a step's results: advance computed counts, append sampled tokens.

        A sequence with lookahead positions (output.spec_token_ids, core/lookahead.py) gets
        what the lookahead accepts of its draws: the first in `sampled`, then the draws after
        each lookahead token in `spec_drawn`; the count accepted goes to
        output.spec_num_accepted.

        Returns the sequences that got a token (or, prompt-only, completed their prompt), in
        batch order. Sequences that ended while the
        step was in flight are skipped; an output discarded by reset_executor() is ignored.
        """
        if not self._in_flight or output is not self._in_flight[0]:
            return []
        del self._in_flight[0]
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
            proposed = output.spec_token_ids.get(seq.seq_id) if output.spec_token_ids else None
            if proposed is not None and self.lookahead is not None and spec_drawn is not None:
                drawn = [sampled[seq.seq_id], *spec_drawn.get(seq.seq_id, ())]
                accepted = self.lookahead.verified(seq, proposed, drawn, bm)
                output.spec_num_accepted[seq.seq_id] = accepted
                nc = seq.num_computed_tokens
                got.append(seq)
            elif nc == len(tokens):
                token = sampled.get(seq.seq_id)
                if token is not None:
                    tokens.append(token)
                elif not seq.prompt_only:  # prompt-only ones are never sampled, yet reported
                    raise ValueError(f"the executor returned no token for {seq.seq_id!r}")
                got.append(seq)
            if caching and nc // bs > seq.num_cached_blocks:
                bm.cache_full_blocks(seq)
        return got

    # ------------------------------------------------------------------ moving (issue 47)

    def movable_requests(self) -> list[Request]:
        """Running requests whose KV may move to another executor's cache and continue there
        (live migration): one sequence, with KV computed, and nothing kept on the executor
        outside its blocks (`swappable`, as for a swap)."""
        return [
            r
            for r in self._running
            if r.status == _RUNNING
            and len(r.seqs) == 1
            and r.forked
            and r.swappable
            and r.seqs[0].status == _RUNNING
            and r.seqs[0].num_computed_tokens > 0
        ]

    def adopt_request(self, other: Request) -> tuple[Request, int] | None:
        """Take over `other` (a movable request of another executor's core) as running here,
        with blocks for its computed tokens: this cache's prefix-cache hits first, then fresh
        blocks. Returns the copy held here and how many leading blocks are hits; the caller
        fills the blocks past them with the KV from the other executor before this core's next
        step, or gives the request back with `release_request`. The executor learns the
        sequence from a NewSequence with its num_computed_tokens, as after a swap-in; its full
        blocks enter the prefix cache after its first step here (update_from_output), so an
        undone move leaves no unfilled block findable. None: it does not fit (sequence slots,
        the step limit, free blocks above the watermark) or the id is taken."""
        src = other.seqs[0]
        nc = src.num_computed_tokens
        bm = self.block_manager
        if other.req_id in self._requests or self.num_running_seqs >= self.config.max_num_seqs:
            return None
        limit = self.step_limit  # e.g. adapters a step may hold: the running ones all run
        if limit is not None:
            limit.begin(self._running)
            if not limit.admits(other):
                return None
        req, seq = copy.copy(other), copy.copy(src)
        seq.token_ids, seq.block_hashes = list(src.token_ids), list(src.block_hashes)
        seq.block_table, seq.cpu_block_table, seq.sent = [], [], False
        req.seqs = [seq]
        hits = bm.find_cached_prefix(seq, nc)
        # A device hit sitting in the free list costs a free block; a host-tier hit costs a
        # fresh one (copied into at this core's next step), as a fresh block does.
        on_device = [b for b in hits if isinstance(b, Block)]
        need = bm.num_blocks_for(nc + 1) - len(on_device) + sum(b.ref_cnt == 0 for b in on_device)
        if bm.num_free_blocks - need < bm.watermark_blocks:
            return None
        bm.allocate_group([seq], [hits], [nc])
        seq.num_computed_tokens = nc
        self._num_added += 1
        req.sort_key = (*other.sort_key[:-1], self._num_added)
        self._requests[req.req_id] = req
        self._seqs[seq.seq_id] = seq
        self._running.append(req)
        self._running.sort(key=lambda r: r.sort_key)
        return req, len(hits)

    def release_request(self, req_id: str) -> bool:
        """Let go of a request without ending it (it continues on another executor, or an
        adoption is undone): its blocks are freed, the executor told to drop its sequences,
        and nothing is reported finished. False when it is unknown here."""
        req = self._requests.pop(req_id, None)
        if req is None:
            return False
        for seq in req.live_seqs:
            self._end_seq(seq, RequestStatus.FINISHED_ABORTED)
        req.status = RequestStatus.FINISHED_ABORTED  # dropped from _running by the next step
        self._waiting.remove(req_id)
        self._swapped.remove(req_id)
        return True

    def take_pending_drops(self) -> list[str]:
        """Sequences ended since the last step that the executor still holds, each with the
        blocks this core has freed (an import into those blocks is refused until they are
        dropped): the caller sends them in a step of its own now."""
        out, self._pending_drops = self._pending_drops, []
        return out

    def put_back_drops(self, seq_ids: list[str]) -> None:
        """Drops from take_pending_drops whose step failed: they go with the next step."""
        self._pending_drops[:0] = seq_ids

    def take_finished_requests(self) -> list[Request]:
        """Requests ended since the last call (by the scheduler itself, abort, or finish)."""
        out, self._finished = self._finished, []
        return out

    def reset_executor(self) -> None:
        """The executor lost its state: everything running or swapped is recomputed from scratch.

        Any step in flight is discarded (its update_from_output becomes a no-op).
        """
        self._in_flight.clear()
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

    @property
    def num_running_seqs(self) -> int:
        return sum(r.num_seqs_when_running for r in self._running if r.status == _RUNNING)

    def waiting_requests(self) -> list[Request]:
        """The waiting requests, in no particular order."""
        return self._waiting.unordered()

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
            num_running_seqs=self.num_running_seqs,
            num_device_blocks=bm.num_device_blocks,
            num_free_blocks=bm.num_free_blocks,
            num_cpu_blocks=bm.num_cpu_blocks,
            num_free_cpu_blocks=bm.num_free_cpu_blocks,
            kv_cache_usage=bm.usage,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            prefix_cache_host_hits=bm.prefix_cache_host_hits,
            num_preemptions=self.num_preemptions,
        )

    def check_invariants(self) -> None:
        """Block-level invariants, plus: with no unfinished request, every block is free."""
        self.block_manager.check_invariants(expect_empty=not self._requests)
