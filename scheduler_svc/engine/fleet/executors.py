"""The executors one scheduler drives: their handles, connecting, and the Redis registry.

Executors come from `--executor` addresses (a name that resolves to several addresses, as
`docker compose up --scale executor=N` makes, counts once per address) or, with
`--discover-executors`, from the registry executors keep alive in Redis. Each executor gets its
own scheduler core, sized from what it reports in Describe.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
import structlog

from protos import executor_pb2 as epb
from protos import executor_pb2_grpc as epb_grpc
from scheduler_svc.core.request import Request
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.engine.fleet.executor_handle import ExecutorHandle, ExecutorState, Sent
from scheduler_svc.engine.fleet.routing import Router
from scheduler_svc.state.store import RequestStore, StoreUnavailable

if TYPE_CHECKING:
    from scheduler_svc.engine.config import EngineConfig

log = structlog.get_logger(__name__)

__all__ = ["ExecutorHandle", "ExecutorPool", "ExecutorState", "Sent", "expand_addresses"]


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
        self.router = Router(config.routing, config.routing_prefill_weight)
        # Called after an executor went down, came back or was retired (health listens).
        self.on_change: Callable[[], None] = lambda: None
        # Instance ids alive in the registry at the last look (discovery only).
        self.registered: set[str] = set()
        # This scheduler's leader epoch (0: no leader election), sent with every Reset and
        # step: executors refuse older ones.
        self.epoch = 0
        # Set by the engine from its features (features/base.py): what each executor must
        # offer (why not, or None), and their fields of each core's configuration (from the
        # executor's Describe).
        self.checks: tuple[Callable[[epb.DescribeResponse], str | None], ...] = ()
        self.core_options: Callable[[epb.DescribeResponse], dict[str, Any]] = lambda d: {}

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
            channel = self._channel(address)
            stub = epb_grpc.ExecutorStub(channel)
            try:
                describe = await _handshake(stub, self.epoch, self.checks)
            except IncompatibleExecutor:
                await channel.close()
                raise
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
            state = ExecutorState.DRAINING if describe.draining else ExecutorState.UP
            return ExecutorHandle(
                address, channel, stub, describe, self.new_scheduler(describe), state
            )

    def _channel(self, address: str) -> grpc.aio.Channel:
        options = [
            ("grpc.max_send_message_length", 256 * 1024 * 1024),
            ("grpc.max_receive_message_length", 256 * 1024 * 1024),
        ]
        if self.config.executor_tls is None:
            return grpc.aio.insecure_channel(address, options=options)
        ca, cert, key = self.config.executor_tls
        credentials = grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )
        if self.config.executor_tls_server_name:
            name = self.config.executor_tls_server_name
            options.append(("grpc.ssl_target_name_override", name))
        return grpc.aio.secure_channel(address, credentials, options=options)

    async def reconnect(self, ex: ExecutorHandle) -> bool | None:
        """One attempt (after a back-off) to bring an unhealthy executor back: None while it
        stays unreachable, else whether its cache shape changed (then its scheduler core no
        longer fits it). It is not marked healthy here: the caller first fixes the core."""
        await asyncio.sleep(min(0.1 * 2**ex.consecutive_failures, 2.0))
        try:
            describe = await _handshake(ex.stub, self.epoch, self.checks)
        except IncompatibleExecutor as e:  # came back without what this scheduler needs
            log.error("executor.incompatible", address=ex.address, reason=str(e))
            return None
        except grpc.aio.AioRpcError:
            return None
        if describe.instance_id != ex.describe.instance_id:
            log.warning("executor.restarted", address=ex.address, instance_id=describe.instance_id)
        old, ex.describe = ex.describe, describe
        ex.set_draining(describe.draining)
        return _capacity(describe) != _capacity(old)

    async def probe(self, ex: ExecutorHandle, timeout_s: float) -> str | None:
        """Why `ex` is lost (unreachable, or restarted: its KV cache is gone), or None."""
        try:
            describe = await ex.stub.Describe(epb.DescribeRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            return f"health probe: {e.code().name}"
        if describe.instance_id != ex.describe.instance_id:
            return "restarted"
        ex.set_draining(describe.draining)
        return None

    async def lose(self, ex: ExecutorHandle, reason: str) -> None:
        """`ex` stopped answering or restarted while idle (a probe found it): mark it failed
        between two of its steps; its loop reconnects it and its requests are recomputed."""
        async with ex.exclusive():
            if not ex.healthy:
                return
            log.warning("executor.lost", address=ex.address, reason=reason)
            self.mark_failed(ex)

    def mark_failed(self, ex: ExecutorHandle) -> None:
        """`ex` failed a step or a probe: unhealthy until reconnected, and everything it held
        (or our view of it) is untrusted, so its requests will be recomputed."""
        ex.went_down()
        ex.sched.reset_executor()
        ex.wake.set()
        self.on_change()

    def mark_up(self, ex: ExecutorHandle) -> None:
        """`ex` answers again and its core fits it: it takes steps (and requests) again."""
        ex.came_back()
        self.on_change()
        ex.wake.set()

    def place(self, req: Request) -> ExecutorHandle:
        """Queue `req` on the executor the router picks; returns that executor."""
        ex = self.router.choose(self.prompt_takers(), req)
        ex.sched.add_request(req)
        ex.wake.set()
        return ex

    def prompt_takers(self) -> list[ExecutorHandle]:
        """Where a prompt may go (prefill/decode disaggregation): the executors that prefill
        (role prefill or both) while one of them takes new work; with none up, every executor,
        decode ones included (availability first)."""
        prefill = [e for e in self.executors if e.prefills and e.takes_work]
        return prefill or self.executors

    def wake_all(self) -> None:
        for ex in self.executors:
            ex.wake.set()

    def failover_due(self, ex: ExecutorHandle) -> bool:
        """Unreachable for `executor_failover_s` (at once after it said it was draining: it is
        not coming back) while another executor is live."""
        waited = time.monotonic() - ex.down_since
        if not ex.draining and waited < self.config.executor_failover_s:
            return False
        return any(e.healthy for e in self.executors if e is not ex)

    def new_scheduler(self, d: epb.DescribeResponse) -> Scheduler:
        c = self.config
        num_device = min(d.num_device_blocks, c.num_device_blocks or d.num_device_blocks)
        num_cpu = min(
            d.num_cpu_blocks, c.num_cpu_blocks if c.num_cpu_blocks is not None else 1 << 30
        )
        num_host = min(c.host_cache_blocks, num_cpu)
        no_swap = c.preemption_mode == "swap" and num_host and num_host == num_cpu
        if num_host < c.host_cache_blocks or no_swap:
            # The tier is carved out of the CPU pool (swap has the rest): the executor's
            # --swap-space is too small for both.
            log.warning(
                "executor.host_cache_short",
                instance_id=d.instance_id,
                host_cache_blocks=num_host,
                asked=c.host_cache_blocks,
                swap_blocks_left=num_cpu - num_host,
            )
        return Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=c.max_num_batched_tokens,
                max_num_seqs=c.max_num_seqs,
                block_size=d.block_size,
                num_device_blocks=num_device,
                num_cpu_blocks=num_cpu,
                num_host_cache_blocks=num_host,
                max_model_len=min(d.max_model_len, c.max_model_len or d.max_model_len),
                policy=c.policy,
                preemption_mode=c.preemption_mode,
                enable_prefix_caching=c.enable_prefix_caching,
                watermark=c.watermark,
                # The engine enforces the queue cap across executors; never refuse here.
                max_waiting=1 << 30,
                **self.core_options(d),
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
            ex = await self._connect_discovered(address)
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

    async def _connect_discovered(self, address: str) -> ExecutorHandle | None:
        try:
            return await self.connect(address, retry=False)
        except IncompatibleExecutor as e:
            log.error("executor.incompatible", address=address, reason=str(e))
            return None

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
            ex.state = ExecutorState.RETIRED
            ex.wake.set()
            self.router.forget(ex)
            retired.append(ex)
            log.info("executor.retired", address=ex.address, instance_id=ex.describe.instance_id)
        if retired:
            self.on_change()
        return retired


class IncompatibleExecutor(Exception):
    """An executor that cannot serve this scheduler's configuration (a feature's check of its
    Describe failed); found before it is reset."""


async def _handshake(
    stub: epb_grpc.ExecutorStub,
    epoch: int,
    checks: tuple[Callable[[epb.DescribeResponse], str | None], ...] = (),
) -> epb.DescribeResponse:
    """Describe, then Reset: a scheduler (re)connecting owns no blocks on the executor yet,
    and the executor must agree before the first step. An executor that cannot serve the
    configuration is left untouched (IncompatibleExecutor)."""
    describe = await stub.Describe(epb.DescribeRequest(), timeout=5)
    for check in checks:
        error = check(describe)
        if error is not None:
            raise IncompatibleExecutor(error)
    await stub.Reset(epb.ResetRequest(leader_epoch=epoch), timeout=5)
    return describe


def _capacity(d: epb.DescribeResponse) -> tuple[int, int, int, int]:
    return (d.block_size, d.num_device_blocks, d.num_cpu_blocks, d.max_model_len)
