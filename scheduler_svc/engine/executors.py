"""The executors one scheduler drives: their handles, connecting, and the Redis registry.

Executors come from `--executor` addresses (a name that resolves to several addresses, as
`docker compose up --scale executor=N` makes, counts once per address) or, with
`--discover-executors`, from the registry executors keep alive in Redis. Each executor gets its
own scheduler core, sized from what it reports in Describe.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import structlog

from protos import executor_pb2 as epb
from protos import executor_pb2_grpc as epb_grpc
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.state.store import RequestStore, StoreUnavailable

if TYPE_CHECKING:
    from scheduler_svc.engine.config import EngineConfig

log = structlog.get_logger(__name__)

__all__ = ["ExecutorHandle", "ExecutorPool", "expand_addresses"]


@dataclass(slots=True)
class ExecutorHandle:
    address: str
    channel: grpc.aio.Channel
    stub: epb_grpc.ExecutorStub
    describe: epb.DescribeResponse
    sched: Scheduler
    healthy: bool = True
    step_id: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    consecutive_failures: int = 0
    unhealthy_since: float = 0.0  # time.monotonic() of the failure that made it unhealthy
    # Its loop is parked with nothing to schedule (the health monitor probes only these).
    idle: bool = False
    # Steps that raised inside the scheduler since the last one that completed.
    num_crashed_steps: int = 0
    # For metrics: steps sent, seconds the executor was busy with them, wall time the last
    # one ended (time.time(), and time.perf_counter() for the busy time).
    num_steps: int = 0
    num_steps_ahead: int = 0  # of those, planned while the one before was running
    step_seconds: float = 0.0
    last_step_time: float = 0.0
    last_step_done: float = 0.0
    # Tasks waiting in exclusive(): the engine loop plans no step ahead while there are any.
    num_lock_waiters: int = 0
    # Left the registry for good (scaled down) and dropped by the pool: its loop ends.
    retired: bool = False
    # Shutting down gracefully: finishes what it runs, gets no new requests.
    draining: bool = False

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold `lock` from outside the engine loop (an abort, a recovery): between two steps,
        never in the middle of one. The loop plans no step ahead while someone waits here, so
        a run of decode steps planned ahead ends at the next step."""
        self.num_lock_waiters += 1
        try:
            await self.lock.acquire()
        finally:
            self.num_lock_waiters -= 1
        try:
            yield
        finally:
            self.lock.release()


def expand_addresses(addresses: list[str]) -> list[str]:
    """Each host:port once per address its name resolves to, so that one service name behind
    which several executors run (`docker compose up --scale executor=N`) reaches all of them."""
    out: list[str] = []
    for address in addresses:
        host, _, port = address.rpartition(":")
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
            ips = sorted({info[4][0] for info in infos})
        except (OSError, ValueError):
            ips = []
        if len(ips) <= 1 or host in ("localhost", "127.0.0.1", "::1"):
            expanded = [address]
        else:
            expanded = [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips]
        out.extend(a for a in expanded if a not in out)
    return out


class ExecutorPool:
    def __init__(self, config: EngineConfig, store: RequestStore) -> None:
        self.config = config
        self.store = store
        self.executors: list[ExecutorHandle] = []
        # Instance ids alive in the registry at the last look (discovery only).
        self.registered: set[str] = set()
        # This scheduler's leader epoch (0: no leader election), sent with every Reset and
        # step: executors refuse older ones.
        self.epoch = 0

    async def initial_addresses(self) -> list[str]:
        """The executors to connect at start-up (with discovery and no addresses: the
        registered ones, waiting for the first)."""
        addresses = await asyncio.to_thread(expand_addresses, self.config.executor_addresses)
        if self.config.discover_executors and not addresses:
            addresses = await self.wait_for_registrations()
        return addresses

    async def connect(self, address: str, *, retry: bool = True) -> ExecutorHandle | None:
        """Connect to an executor and reset it; keeps trying unless `retry` is False (then
        None when it cannot be reached)."""
        delay = 0.1
        while True:
            options = [
                ("grpc.max_send_message_length", 256 * 1024 * 1024),
                ("grpc.max_receive_message_length", 256 * 1024 * 1024),
            ]
            if self.config.executor_tls is None:
                channel = grpc.aio.insecure_channel(address, options=options)
            else:
                ca, cert, key = self.config.executor_tls
                credentials = grpc.ssl_channel_credentials(
                    root_certificates=ca, private_key=key, certificate_chain=cert
                )
                if self.config.executor_tls_server_name:
                    name = self.config.executor_tls_server_name
                    options.append(("grpc.ssl_target_name_override", name))
                channel = grpc.aio.secure_channel(address, credentials, options=options)
            stub = epb_grpc.ExecutorStub(channel)
            try:
                describe = await _handshake(stub, self.epoch)
            except grpc.aio.AioRpcError as e:
                await channel.close()
                if not retry:
                    log.warning("executor.unreachable", address=address, code=e.code().name)
                    return None
                log.info("executor.waiting", address=address, code=e.code().name)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            log.info(
                "executor.connected",
                address=address,
                instance_id=describe.instance_id,
                blocks=describe.num_device_blocks,
            )
            return ExecutorHandle(
                address,
                channel,
                stub,
                describe,
                self.new_scheduler(describe),
                draining=describe.draining,
            )

    async def reconnect(self, ex: ExecutorHandle) -> bool | None:
        """One attempt (after a back-off) to bring an unhealthy executor back: None while it
        stays unreachable, else whether its cache shape changed (then its scheduler core no
        longer fits it). It is not marked healthy here: the caller first fixes the core."""
        await asyncio.sleep(min(0.1 * 2**ex.consecutive_failures, 2.0))
        try:
            describe = await _handshake(ex.stub, self.epoch)
        except grpc.aio.AioRpcError:
            return None
        if describe.instance_id != ex.describe.instance_id:
            log.warning("executor.restarted", address=ex.address, instance_id=describe.instance_id)
        old, ex.describe = ex.describe, describe
        ex.draining = describe.draining
        return _capacity(describe) != _capacity(old)

    async def probe(self, ex: ExecutorHandle, timeout_s: float) -> str | None:
        """Why `ex` is lost (unreachable, or restarted: its KV cache is gone), or None."""
        try:
            describe = await ex.stub.Describe(epb.DescribeRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            return f"health probe: {e.code().name}"
        if describe.instance_id != ex.describe.instance_id:
            return "restarted"
        ex.draining = describe.draining
        return None

    def mark_failed(self, ex: ExecutorHandle) -> None:
        """`ex` failed a step or a probe: unhealthy until reconnected, and everything it held
        (or our view of it) is untrusted, so its requests will be recomputed."""
        if ex.healthy:
            ex.unhealthy_since = time.monotonic()
        ex.healthy = False
        ex.sched.reset_executor()
        ex.wake.set()

    def failover_due(self, ex: ExecutorHandle) -> bool:
        """Unreachable for `executor_failover_s` (at once after it said it was draining: it is
        not coming back) while another executor is live."""
        waited = time.monotonic() - ex.unhealthy_since
        if not ex.draining and waited < self.config.executor_failover_s:
            return False
        return any(e.healthy for e in self.executors if e is not ex)

    def new_scheduler(self, d: epb.DescribeResponse) -> Scheduler:
        c = self.config
        num_device = min(d.num_device_blocks, c.num_device_blocks or d.num_device_blocks)
        num_cpu = min(
            d.num_cpu_blocks, c.num_cpu_blocks if c.num_cpu_blocks is not None else 1 << 30
        )
        return Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=c.max_num_batched_tokens,
                max_num_seqs=c.max_num_seqs,
                block_size=d.block_size,
                num_device_blocks=num_device,
                num_cpu_blocks=num_cpu,
                max_model_len=min(d.max_model_len, c.max_model_len or d.max_model_len),
                policy=c.policy,
                preemption_mode=c.preemption_mode,
                enable_prefix_caching=c.enable_prefix_caching,
                watermark=c.watermark,
                # The engine enforces the queue cap across executors; never refuse here.
                max_waiting=1 << 30,
            )
        )

    async def wait_for_registrations(self) -> list[str]:
        """Addresses of the executors registered in Redis, once there is at least one."""
        log.info("engine.waiting_for_executor_registrations")
        while True:
            try:
                entries = await self.store.list_executors()
            except StoreUnavailable:
                entries = []
            if entries:
                return sorted({address for _, address in entries})
            await asyncio.sleep(self.config.discovery_interval_s)

    async def discover(self) -> list[ExecutorHandle]:
        """One look at the Redis registry: connect the executors not served yet.

        Executors are known by the address they advertise and by their instance id; one that
        restarts comes back under the same address and is picked up by its existing loop.
        Returns the handles added (the caller starts their loops).
        """
        try:
            entries = await self.store.list_executors()
        except StoreUnavailable:
            return []
        self.registered = {instance_id for instance_id, _ in entries}
        added = []
        for instance_id, address in entries:
            known = {(ex.address, ex.describe.instance_id) for ex in self.executors}
            if any(address == a or instance_id == i for a, i in known):
                continue
            ex = await self.connect(address, retry=False)
            if ex is None:
                continue
            first = self.executors[0].describe
            if (ex.describe.model_name, ex.describe.vocab_size) != (
                first.model_name,
                first.vocab_size,
            ):
                log.error(
                    "executor.incompatible",
                    address=address,
                    model=ex.describe.model_name,
                    expected=first.model_name,
                )
                await ex.channel.close()
                continue
            if any(e.describe.instance_id == ex.describe.instance_id for e in self.executors):
                await ex.channel.close()  # one already served under another address
                continue
            self.executors.append(ex)
            added.append(ex)
            log.info("executor.discovered", address=address, instance_id=instance_id)
        return added

    def retire_gone(self) -> list[ExecutorHandle]:
        """Drop the executors that left the registry for good (a scaled-down replica, or one
        stopped or killed and not restarted): unreachable, no longer registered, and holding
        no requests (fail-over has moved them). Without this, every scale-down would leave a
        handle retrying an address that no longer exists. The last executor is never dropped.
        Returns the handles removed (their loops end and close their channels)."""
        gone = [
            ex
            for ex in self.executors
            if not ex.healthy
            and ex.describe.instance_id not in self.registered
            and ex.sched.num_unfinished == 0
        ]
        retired = []
        for ex in gone:
            if len(self.executors) <= 1:
                break
            self.executors.remove(ex)
            ex.retired = True
            ex.wake.set()
            retired.append(ex)
            log.info("executor.retired", address=ex.address, instance_id=ex.describe.instance_id)
        return retired


async def _handshake(stub: epb_grpc.ExecutorStub, epoch: int) -> epb.DescribeResponse:
    """Describe, then Reset: a scheduler (re)connecting owns no blocks on the executor yet,
    and the executor must agree before the first step."""
    describe = await stub.Describe(epb.DescribeRequest(), timeout=5)
    await stub.Reset(epb.ResetRequest(leader_epoch=epoch), timeout=5)
    return describe


def _capacity(d: epb.DescribeResponse) -> tuple[int, int, int, int]:
    return (d.block_size, d.num_device_blocks, d.num_cpu_blocks, d.max_model_len)
