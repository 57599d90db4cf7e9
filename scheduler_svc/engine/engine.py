"""The engine: the asyncio layer around the scheduling cores, and who owns what.

`Engine` builds the parts, hands each its collaborators, and runs the lifecycle (stand by,
connect, recover, serve, stop). It does no request work itself:

- `lifecycle.Lifecycle`: the engine's one state and why it does not serve;
- `executors.ExecutorPool`: the executors (handles, cores, routing, connect, probe, retire);
- `request_table.RequestTable`: the requests held in memory (usage, metrics, finish);
- `recovery.Recovery` and `faults.Faults`: recompute after any loss, and what a failure does;
- `step_loop.StepLoop`: one loop per executor, schedule -> ExecuteModel -> apply -> persist;
- `requests.RequestFront`: what the API calls (`client.EngineClient`), with `aborts.Aborts`;
- `health.HealthMonitor`, `metrics.EngineMetrics`; `state.persister.Persister` writes Redis.

A step's output is handed to the persister and the loop moves on: clients see tokens only once
Redis has acknowledged them, but the next step never waits for Redis unless the write backlog
passes its bound.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable, Coroutine

import structlog

from scheduler_svc.engine.aborts import Aborts
from scheduler_svc.engine.config import EngineConfig
from scheduler_svc.engine.faults.faults import Faults
from scheduler_svc.engine.faults.health import HealthMonitor
from scheduler_svc.engine.faults.lifecycle import EngineState, Lifecycle
from scheduler_svc.engine.faults.migration import Migration
from scheduler_svc.engine.faults.recovery import Recovery
from scheduler_svc.engine.fleet.executors import ExecutorPool, IncompatibleExecutor
from scheduler_svc.engine.handoff import Handoff
from scheduler_svc.engine.key_usage import KeyUsage
from scheduler_svc.engine.metrics import EngineMetrics
from scheduler_svc.engine.model import ModelInfo
from scheduler_svc.engine.moves import RequestMoves
from scheduler_svc.engine.request_table import RequestTable
from scheduler_svc.engine.requests import RequestFront
from scheduler_svc.engine.step_loop import StepLoop
from scheduler_svc.features.registry import build_features
from scheduler_svc.state.leader import LeaderLease
from scheduler_svc.state.persister import Persister
from scheduler_svc.state.store import RequestStore

log = structlog.get_logger(__name__)

__all__ = ["Engine"]


def _request_store(config: EngineConfig) -> RequestStore:
    """The state store, with the replica acknowledgement the configuration asks of its writes."""
    store = RequestStore(
        config.redis_target,
        finished_ttl_s=config.finished_ttl_s,
        min_replicas=config.redis_min_replicas,
        replica_timeout_ms=config.redis_replica_timeout_ms,
    )
    store.release_unreplicated = config.redis_degrade_unreplicated
    return store


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.lifecycle = Lifecycle(config.leader_election)
        self.model = ModelInfo()
        self.store = _request_store(config)
        self.persister = Persister(
            self.store,
            max_backlog_steps=config.max_backlog_steps,
            resync=lambda: self.recovery.resync_store(),
        )
        self.pool = ExecutorPool(config, self.store)
        self.metrics = EngineMetrics(self.pool, self.persister, config.preemption_mode)
        usage = KeyUsage(config.max_requests_per_key, config.max_queued_tokens_per_key)
        self.table = RequestTable(usage, self.metrics)
        self.recovery = Recovery(
            self.table, self.pool, self.persister, self.store, self.model, self.metrics
        )
        mover = Migration(self.pool, self.table, self.metrics, config.migrate_timeout_s,
                          config.migrate_transport, config.migrate_chunk_bytes)  # fmt: skip
        faults = Faults(self.table, self.pool, self.persister, self.recovery, self.lifecycle,
                        mover if config.migrate_on_drain else None)  # fmt: skip
        self.steps = StepLoop(config, self.lifecycle, self.pool, self.table, self.persister,
                              faults, self.metrics, handoff=Handoff(mover, self.metrics))  # fmt: skip
        self.health = HealthMonitor(self.lifecycle, self.pool, self.store, self.persister,
                                    interval_s=config.health_interval_s)  # fmt: skip
        aborts = Aborts(self.lifecycle, self.table, self.store, self.persister,
                        config.abort_ahead_ttl_s)  # fmt: skip
        self.client = RequestFront(  # what the API layer talks to (client.EngineClient)
            config, self.lifecycle, self.table, self.pool, self.store, self.persister, aborts,
            self.model,
        )  # fmt: skip
        self.persister.on_write = self.metrics.redis_write.observe
        self.client.moves = RequestMoves(mover)
        self._plug_in()
        self.persister.on_fenced = self.lifecycle.lose_leadership
        self.pool.on_change = self.health.update
        self.lifecycle.watchers += [self._state_changed, self.health.update]
        self._tasks: list[asyncio.Task] = []

    def _plug_in(self) -> None:
        """Build the optional features (scheduler_svc/features) and hand their hooks to the
        parts that call them: once, here."""
        self.features = features = build_features(
            self.config, lifecycle=self.lifecycle, pool=self.pool, model=self.model,
            table=self.table, store=self.store, persister=self.persister,
            check_available=self.client.check_available,
        )  # fmt: skip
        self.client.features = self.steps.features = self.recovery.features = features
        self.table.admit = features.admit
        self.metrics.feature_families = features.metrics
        self.pool.checks, self.pool.core_options = features.check_executor, features.scheduling

    # ---------------------------------------------------------------- lifecycle

    async def start(self, on_ready_change: Callable[[bool], None] | None = None) -> None:
        if on_ready_change is not None:
            self.health.on_change = on_ready_change
        self.health.update()
        self.persister.start()
        if self.config.leader_election:
            self._spawn(self._lead(), "engine.lead")
        else:
            self._spawn(self._connect_all(), "engine.connect")
        self._spawn(self.health.run(), "engine.health")

    async def _lead(self) -> None:
        """Stand by until this scheduler holds the leader lease, then start serving (connect,
        recover) with its epoch on every write; hold the lease until it is lost."""
        cfg = self.config
        lease = LeaderLease(
            cfg.redis_target,
            ttl_s=cfg.lease_ttl_s,
            min_replicas=cfg.redis_min_replicas,
            replica_timeout_ms=cfg.redis_replica_timeout_ms,
            release_unreplicated=cfg.redis_degrade_unreplicated,
        )
        tasks: list[asyncio.Task] = []
        try:
            epoch = await lease.acquire()
            self.store.epoch = self.pool.epoch = epoch
            self.lifecycle.elected()
            holding = asyncio.create_task(lease.hold(), name="engine.lease")
            tasks = [holding, asyncio.create_task(self._connect_all(), name="engine.connect")]
            reason = await holding  # _connect_all runs beside it
            self.lifecycle.lose_leadership(reason)
        finally:
            for task in tasks:
                task.cancel()
            if self.lifecycle.state is EngineState.STOPPING:
                await lease.release()  # a clean stop hands over at once
            await lease.close()

    def _state_changed(self) -> None:
        """Once leadership is lost nothing more may be written (Redis and executors refuse
        this epoch): the loops stop at once; the caller starts the process over as a standby."""
        if self.lifecycle.state is EngineState.LOST_LEADERSHIP:
            log.error("leader.lost", reason=self.lifecycle.lost_reason, epoch=self.store.epoch)
            self.pool.wake_all()

    def _spawn(self, coro: Coroutine[object, object, None], name: str) -> None:
        """Run one of the engine's own tasks; one that dies of an error says so in the log."""
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(_log_task_failure)
        self._tasks.append(task)

    async def _connect_all(self) -> None:
        for address in await self.pool.initial_addresses():
            try:
                handle = await self.pool.connect(address)
            except IncompatibleExecutor as e:  # refuse to serve: the process exits (cli.py)
                log.error("engine.executor_incompatible", address=address, reason=str(e))
                self.lifecycle.fail(f"executor {address}: {e}")
                return
            assert handle is not None  # connect() keeps trying
            self.pool.executors.append(handle)
            if self.model.tokenizer is None:
                await self.model.load_tokenizer(handle)
        self.model.set_limits(self.pool.executors[0].describe, self.config.max_model_len)
        # The features' own durable state (live-loaded adapters) before anything is served.
        await self.features.recover()
        await self.recovery.recover()
        # Start-up built long-lived objects (tokenizer, tables, recovered requests): move them out
        # of the collector's way so the steps' young-object collections do not rescan them.
        gc.collect()
        gc.freeze()
        for ex in self.pool.executors:
            self._spawn(self.steps.run(ex), f"engine.{ex.address}")
        if self.config.discover_executors:
            self._spawn(self._discover(), "engine.discover")
        self.lifecycle.started()
        log.info("engine.ready", executors=len(self.pool.executors), recovered=len(self.table))

    async def _discover(self) -> None:
        """Serve executors that register in Redis after start-up (scaling out at run time)."""
        while not self.lifecycle.stopping:
            await asyncio.sleep(self.config.discovery_interval_s)
            for ex in await self.pool.discover():
                self._spawn(self.steps.run(ex), f"engine.{ex.address}")
            self.pool.retire_gone()

    async def stop(self, drain_timeout_s: float = 5.0) -> None:
        """Stop taking requests, let running ones finish for up to `drain_timeout_s`, then stop.

        Requests still unfinished stay in Redis as they are and resume on the next start.
        """
        self.lifecycle.stop()
        deadline = time.monotonic() + drain_timeout_s
        while len(self.table) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            # Bounded, and without swallowing a cancellation of stop() itself (awaiting each
            # task under suppress(CancelledError) did both).
            done, pending = await asyncio.wait(self._tasks, timeout=drain_timeout_s)
            for task in done:  # retrieved: shutting down, their errors were logged already
                if not task.cancelled():
                    task.exception()
            if pending:
                log.warning("engine.stop.tasks_pending", tasks=[t.get_name() for t in pending])
        try:
            await asyncio.wait_for(self.persister.wait_drained(), timeout=drain_timeout_s)
        except TimeoutError:
            log.warning("engine.stop.unflushed", backlog=self.persister.backlog)
        await self.persister.stop()
        self.table.close_all("scheduler shutting down; resume the request by id")
        for ex in self.pool.executors:
            await ex.channel.close()
        await self.store.close()
        log.info("engine.stopped", unfinished=len(self.table))


def _log_task_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error(
            "engine.task_failed",
            task=task.get_name(),
            error=repr(task.exception()),
            exc_info=task.exception(),
        )
