"""Live migration on drain (issue 47): a draining executor's running requests move with their KV
cache to executors taking new work, and continue there without computing any token again.

Tracked like a swap. With the movers' lock (`Migration.lock`, which every move takes first:
two moves never wait for each other's executors), then the source's lock (between two of its
steps: nothing in flight, async scheduling plans nothing ahead while someone waits for the
lock) and then each destination's, in that order:

1. plan: the source core's movable requests (`movable_requests`: one sequence, KV computed,
   nothing kept on the executor outside its blocks), each to the executor the router picks
   among those up and not draining;
2. adopt: the destination core takes each request as running with blocks for its computed
   tokens (its own prefix-cache hits first, then fresh blocks), as long as they fit;
3. move: the destination's pending drops first, in a step of their own (sequences its core
   ended since its last step still hold, on the executor, blocks the adoption may have
   reused), then ExportKV on the source piped into ImportKV on the destination, only the
   blocks past the destination's hits (`fleet/kv_move.py`; shared memory when both are on
   this host); requests sharing a computed block with one already in the batch wait for a
   later one (an export names each block once);
4. commit: the source core lets the requests go (its blocks freed, the executor told to drop
   the sequences in its next step), each handle points at the destination, whose executor
   learns each sequence from a NewSequence with its num_computed_tokens, as after a swap-in.

A drain is a series of such passes, one task per executor instance, until the executor holds
no request (or is down, restarted, no longer draining): the first at once, the next whenever
one may move something (`drain_retry.RetryGate`: a request became movable, e.g. its first
prefill chunk computed or swapped back in, or a destination has more free blocks or sequence
slots than at the last pass that left requests behind, e.g. its own requests finished). The
task checks that after each of the source's steps (every reply of a draining executor calls
`start`, which wakes it) and every `RETRY_BACKOFF_S`; a pass that moved something is followed
by another at once (what shared a block with a moved request). With no destination up, no
pass is made.

Any failure in 3 (either end dies or refuses: any RPC error) undoes 2 (the destination's blocks
are freed, nothing was registered in its prefix cache) and leaves the requests where they were,
which is the path without migration: they run on the draining executor until it stops, and
what is left then is recomputed elsewhere. After a failure this executor migrates nothing more
(no retry loop against a dying peer).

`move_batch` (2-4 for one destination, both locks held) also serves prefill/decode handoffs
(`engine/handoff.py`) and the admin move (`engine/moves.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog

from scheduler_svc import failpoints
from scheduler_svc.core.request import Request
from scheduler_svc.core.scheduler_output import SchedulerOutput
from scheduler_svc.engine.faults.drain_retry import RetryGate, Room
from scheduler_svc.engine.fleet.executor_handle import ExecutorHandle
from scheduler_svc.engine.fleet.executors import ExecutorPool
from scheduler_svc.engine.fleet.kv_move import ROUTES, move_kv, push_kv, transport_between
from scheduler_svc.engine.metrics import EngineMetrics
from scheduler_svc.engine.request_table import RequestTable

log = structlog.get_logger(__name__)

__all__ = ["Migration"]

# A drain's task checks its gate at least this often (it is woken at each step of its source).
RETRY_BACKOFF_S = 0.25

# (source request, its copy adopted by the destination core, leading blocks the destination's
# prefix cache already held)
_Adopted = tuple[Request, Request, int]


class Migration:
    def __init__(
        self,
        pool: ExecutorPool,
        table: RequestTable,
        metrics: EngineMetrics,
        timeout_s: float,
        transport: str = "auto",
        chunk_bytes: int = 0,
    ) -> None:
        self.pool = pool
        self.table = table
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.transport = transport  # "auto", "grpc", "shm", "push" (kv_move.transport_between)
        self.chunk_bytes = chunk_bytes  # per gRPC chunk; 0: the executor's default
        # Executor instances whose drain was handled (one drain task per instance; after a
        # failed move, requests left behind stay there) and the drain tasks under way.
        self._started: set[str] = set()
        # Per instance whose drain task runs: set when something may have changed for it.
        self._wakes: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task] = set()
        # Held by every move of KV between executors (a drain here, a handoff, the admin move)
        # before it takes the source's lock and then the destination's: two moves in opposite
        # directions never wait for each other's executor (the step loops and the one-lock
        # holders, aborts and recovery, never wait for this one).
        self.lock = asyncio.Lock()

    def start(self, src: ExecutorHandle) -> None:
        """`src` said it drains (every reply of a draining executor says so): the first call
        moves its running requests in the background, and keeps moving what becomes movable
        or finds room later; each later call tells that task a step of `src` ended (the
        caller may hold its lock: a move waits for it)."""
        key = src.describe.instance_id
        wake = self._wakes.get(key)
        if wake is not None:
            wake.set()
            return
        if key in self._started:
            return  # its drain ended: a failed move, or nothing left there
        self._started.add(key)
        wake = self._wakes[key] = asyncio.Event()
        task = asyncio.get_running_loop().create_task(self._drain(src, wake))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self, src: ExecutorHandle, wake: asyncio.Event) -> None:
        """Passes over `src`'s movable requests while it holds any request: the first at
        once, the next whenever the gate says one may move something (a step of `src` ended,
        or a destination has more room), until a move fails."""
        began = time.perf_counter()
        instance = src.describe.instance_id  # a restart at that address is another executor
        gate = RetryGate()
        num_passes = 0
        try:
            while _still_draining(src, instance):
                wake.clear()
                targets = self._targets(src)
                # No destination up (yet): nothing to try until one is, or a step later.
                if targets and gate.due(self._movable_ids(src), _rooms(targets)):
                    async with self.lock, src.exclusive():
                        if not _still_draining(src, instance):
                            return  # gone (fail-over recomputes what it held), or restarted
                        moved, failed = await self._move_all(src)
                    src.wake.set()  # its next step drops the moved sequences
                    num_passes += 1
                    log.info(
                        "executor.migrated",
                        address=src.address,
                        moved_requests=moved,
                        left_requests=src.sched.num_running,
                        num_passes=num_passes,
                        seconds=round(time.perf_counter() - began, 4),
                    )
                    if failed:
                        return
                    if moved:
                        continue  # what a pass leaves (a shared block) may go in the next
                    gate.record(self._movable_ids(src), _rooms(self._targets(src)))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), RETRY_BACKOFF_S)
        finally:
            del self._wakes[instance]

    async def _move_all(self, src: ExecutorHandle) -> tuple[int, bool]:
        """Every batch (one per destination) in turn, until one fails. Returns the requests
        moved and whether a move failed."""
        moved = 0
        for dst, reqs in self._plan(src):
            async with dst.exclusive():
                if not (dst.takes_work and src.healthy):
                    break
                done = await self.move_batch(src, dst, reqs)
            dst.wake.set()
            if done is None:
                return moved, True
            moved += done
            self.metrics.migrated += done
        return moved, False

    def _targets(self, src: ExecutorHandle) -> list[ExecutorHandle]:
        return [e for e in self.pool.executors if e is not src and e.takes_work]

    def _movable_ids(self, src: ExecutorHandle) -> list[str]:
        return [r.req_id for r in src.sched.movable_requests()]

    def _plan(self, src: ExecutorHandle) -> list[tuple[ExecutorHandle, list[Request]]]:
        return self.plan(src, self._targets(src), src.sched.movable_requests())

    def plan(
        self, src: ExecutorHandle, targets: list[ExecutorHandle], reqs: list[Request]
    ) -> list[tuple[ExecutorHandle, list[Request]]]:
        """`reqs` (movable requests of `src`) grouped by the executor the router picks for each
        among `targets`."""
        batches: dict[str, tuple[ExecutorHandle, list[Request]]] = {}
        if not targets:
            return []
        for req in reqs:
            handle = self.table.get(req.req_id)
            if handle is None or handle.finished_in_engine or handle.executor is not src:
                continue
            dst = self.pool.router.choose(targets, req)
            batches.setdefault(dst.address, (dst, []))[1].append(req)
        return list(batches.values())

    async def move_batch(
        self,
        src: ExecutorHandle,
        dst: ExecutorHandle,
        reqs: list[Request],
        events: tuple[str, str] = ("executor.migrating", "executor.migration_failed"),
    ) -> int | None:
        """Adopt, move, commit (or undo), both executors' locks held. Returns the requests
        moved, None when it failed. `events`: the log events of a move and of a failure."""
        adopted = self._adopt(src, dst, reqs)
        if not adopted:
            return 0
        log.info(events[0], src=src.address, dst=dst.address, requests=len(adopted))
        try:
            await self._transfer(src, dst, adopted)
        except Exception as e:  # noqa: BLE001 -- any RPC error or refusal: undo, recompute later
            for _, new, _ in adopted:
                dst.sched.release_request(new.req_id)
            log.warning(events[1], src=src.address, dst=dst.address, error=repr(e))
            return None
        for old, new, _ in adopted:
            src.sched.release_request(old.req_id)
            handle = self.table.get(old.req_id)
            if handle is None:  # cannot happen while src's lock is held; never leave an orphan
                dst.sched.release_request(new.req_id)
                continue
            handle.executor = dst
        return len(adopted)

    def _adopt(
        self, src: ExecutorHandle, dst: ExecutorHandle, reqs: list[Request]
    ) -> list[_Adopted]:
        """`reqs` adopted by dst's core, those that fit. A request sharing a computed block
        with one adopted before it is left for a later batch: an export names each source
        block once, and dst's copy of a moved block enters its prefix cache only after its
        next step."""
        adopted: list[_Adopted] = []
        taken: set[int] = set()
        bm = src.sched.block_manager
        for req in reqs:
            seq = req.seqs[0]
            blocks = seq.block_table[: bm.num_blocks_for(seq.num_computed_tokens)]
            if not taken.isdisjoint(blocks):
                continue
            got = dst.sched.adopt_request(req)
            if got is None:
                continue  # no room for it on dst, or past dst's step limit: it stays on src
            taken.update(blocks)
            adopted.append((req, *got))
        return adopted

    async def _flush_drops(self, dst: ExecutorHandle) -> None:
        """Sequences dst's core ended since dst's last step still hold their blocks on the
        executor, which drops them with its next step; adopted requests may have been given
        those blocks, so the drops go first, in a step of their own (it computes nothing)."""
        drops = dst.sched.take_pending_drops()
        if drops:
            out = SchedulerOutput(step_id=0, finished_seq_ids=drops)
            try:
                await dst.send(out, 0, self.pool.epoch, self.timeout_s).call
            except BaseException:
                # Most likely not applied: the next step sends them (if they were, that step
                # is refused, and the executor is reset and its requests recomputed).
                dst.sched.put_back_drops(drops)
                raise

    async def _transfer(
        self, src: ExecutorHandle, dst: ExecutorHandle, adopted: list[_Adopted]
    ) -> None:
        """The KV of the adopted requests' computed blocks, past the destination's hits."""
        bm = src.sched.block_manager
        src_blocks: dict[str, list[int]] = {}
        dst_blocks: dict[str, list[int]] = {}
        for old, new, num_hits in adopted:
            seq = old.seqs[0]
            end = bm.num_blocks_for(seq.num_computed_tokens)
            if end > num_hits:
                src_blocks[seq.seq_id] = seq.block_table[num_hits:end]
                dst_blocks[seq.seq_id] = new.seqs[0].block_table[num_hits:end]
        if failpoints.ARMED:  # tests: a window to kill an end in, or a refused move
            await asyncio.sleep(failpoints.delay("engine.migrate"))
            failpoints.hit("engine.migrate")
        await self._flush_drops(dst)
        if not src_blocks:
            return
        route = transport_between(src, dst, self.transport)
        if route == "push":
            tls_name = self.pool.config.executor_tls_server_name or ""
            await push_kv(src, dst, src_blocks, dst_blocks, timeout_s=self.timeout_s,
                          epoch=self.pool.epoch, chunk_bytes=self.chunk_bytes,
                          tls_server_name=tls_name)  # fmt: skip
            return
        await move_kv(src, dst, src_blocks, dst_blocks, transport=ROUTES[route],
                      timeout_s=self.timeout_s, epoch=self.pool.epoch,
                      chunk_bytes=self.chunk_bytes)  # fmt: skip


def _still_draining(ex: ExecutorHandle, instance: str) -> bool:
    """The same executor instance, up, draining, and holding requests."""
    held = ex.sched.num_running + ex.sched.num_swapped + ex.sched.num_waiting
    return (
        ex.healthy
        and not ex.retired
        and ex.draining
        and ex.describe.instance_id == instance
        and held > 0
    )


def _rooms(targets: list[ExecutorHandle]) -> dict[str, Room]:
    return {
        e.describe.instance_id: Room(
            e.sched.block_manager.num_free_blocks,
            e.sched.config.max_num_seqs - e.sched.num_running_seqs,
        )
        for e in targets
    }
