"""Redis with replicas and Sentinels on loopback: 1 primary, 2 replicas, 3 Sentinels, all real
processes of the same redis-server binary (Sentinel is `redis-server CONF --sentinel`), each on
an OS-chosen port. `make run-ha` serves from it (scheduler_svc/local/launch.py --redis-ha), and
the tests kill its nodes (tests/support/redis_ha.py).

`down-after-milliseconds` is 1500: a Sentinel calls an instance down after this long without a
valid reply to its PINGs, so a kill -9 is noticed within ~1.5-2.5 s and the failover (quorum 2
of 3, one Sentinel elected to promote the replica with the newest data) ends ~1 s later. It
must stay above 1000, Sentinel's PING period. After a switch every Sentinel makes a new link to
the promoted primary and pings it first one period later. With 1000, the check that runs right
after that first PING, before its reply, finds 1000 ms without a reply. Each Sentinel then calls
the new primary down at the same moment, and they fail it over again ~1 s after they promoted
it. That happened in 4 of 5 runs of test_redis_ha_frontend here ("+sdown" ~1.05 s after
"+switch-master", "-sdown" ~0.1 s later). Sentinel's default of 30 s would make a test wait half
a minute for each failover.
"""

from __future__ import annotations

import secrets
import signal
import subprocess
import time
from pathlib import Path

import redis

from scheduler_svc.local.redis_server import RedisServer, _free_port, find_redis_server

__all__ = ["MASTER", "NODE_ARGS", "RedisHA"]

MASTER = "mymaster"
# On every node, since any may become the primary: a primary otherwise waits 5 s (Redis's
# repl-diskless-sync-delay) for more replicas before each full sync, which a new topology, a
# replica restarted after a kill and a replica re-attaching to a promoted primary all wait for.
NODE_ARGS = ("--repl-diskless-sync-delay", "0")


class _Sentinel:
    def __init__(
        self,
        workdir: Path,
        me: tuple[int, str],
        peers: list[tuple[int, str]],
        primary_port: int,
        down_after_ms: int,
        failover_ms: int,
    ):
        """`me` and `peers`: (port, Sentinel id). Each starts knowing the others, which it would
        otherwise learn from their hello messages, sent every 2 s."""
        workdir.mkdir(parents=True, exist_ok=True)
        self.port, myid = me
        self.conf = workdir / "sentinel.conf"
        known = "".join(
            f"sentinel known-sentinel {MASTER} 127.0.0.1 {port} {runid}\n" for port, runid in peers
        )
        # Sentinel rewrites its configuration file as it learns the topology: one per process.
        self.conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\nprotected-mode no\ndir {workdir}\n"
            f"sentinel myid {myid}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {primary_port} 2\n"
            f"sentinel down-after-milliseconds {MASTER} {down_after_ms}\n"
            f"sentinel failover-timeout {MASTER} {failover_ms}\n"
            f"sentinel parallel-syncs {MASTER} 2\n{known}"
        )
        log = open(workdir / "sentinel.log", "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(
            [find_redis_server(), str(self.conf), "--sentinel"], stdout=log, stderr=log
        )
        log.close()
        self.client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1.0)

    def master_state(self) -> dict | None:
        try:
            return self.client.sentinel_master(MASTER)
        except redis.RedisError:
            return None

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _is_primary(node: RedisServer) -> bool:
    if node.proc is None:
        return False
    try:
        client = redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=1)
        try:
            return client.info("replication")["role"] == "master"
        finally:
            client.close()
    except redis.RedisError:
        return False


def _writing_aof(node: RedisServer) -> bool:
    try:
        with redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=1) as client:
            info = client.info("persistence")
    except redis.RedisError:
        return True
    return bool(info["aof_rewrite_in_progress"] or info["aof_rewrite_scheduled"])


class RedisHA:
    def __init__(
        self,
        root: Path,
        *,
        num_replicas: int = 2,
        num_sentinels: int = 3,
        down_after_ms: int = 1500,
        failover_ms: int = 3000,
    ) -> None:
        self.root = root
        self.num_replicas = num_replicas
        self.num_sentinels = num_sentinels
        self.down_after_ms = down_after_ms
        self.failover_ms = failover_ms
        self.nodes: list[RedisServer] = []
        self.sentinels: list[_Sentinel] = []

    # ---------------------------------------------------------------- set-up

    def start(self, timeout: float = 30.0) -> RedisHA:
        primary = RedisServer(self.root / "node0", appendfsync="everysec", extra_args=NODE_ARGS)
        primary.start()
        self.nodes.append(primary)
        for i in range(1, self.num_replicas + 1):
            replica = RedisServer(
                self.root / f"node{i}",
                appendfsync="everysec",
                extra_args=(*NODE_ARGS, "--replicaof", "127.0.0.1", str(primary.port)),
            )
            replica.start()
            self.nodes.append(replica)
        ids = [(_free_port(), secrets.token_hex(20)) for _ in range(self.num_sentinels)]
        for i, me in enumerate(ids):
            peers = [p for p in ids if p != me]
            workdir = self.root / f"sentinel{i}"
            self.sentinels.append(
                _Sentinel(workdir, me, peers, primary.port, self.down_after_ms, self.failover_ms)
            )
        self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Until every Sentinel agrees on one primary and knows the other Sentinels, and all live
        replicas are in sync with that primary and acknowledge its writes."""
        deadline = time.monotonic() + timeout
        while True:
            why = self._why_unhealthy()
            if why is None:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"Redis HA topology not healthy: {why}")
            time.sleep(0.1)

    def _why_unhealthy(self) -> str | None:
        states = [s.master_state() for s in self.sentinels]
        if any(st is None for st in states):
            return "a Sentinel does not answer"
        ports = {int(st["port"]) for st in states}
        if len(ports) != 1:
            return f"Sentinels disagree on the primary: {ports}"
        for st in states:
            if st["num-other-sentinels"] < self.num_sentinels - 1:
                return "Sentinels have not found each other yet"
            if st["is_sdown"] or st["is_odown"] or st["flags"] != "master":
                return f"primary flags {st['flags']}"
        live = [n for n in self.nodes if n.proc is not None]
        primary = self.node_at(ports.pop())
        try:
            info = redis.Redis(host="127.0.0.1", port=primary.port, socket_timeout=1).info(
                "replication"
            )
        except redis.RedisError as e:
            return f"primary: {e}"
        online = [
            v for k, v in info.items() if k.startswith("slave") and v.get("state") == "online"
        ]
        if info["role"] != "master" or len(online) < len(live) - 1:
            return f"{len(online)} of {len(live) - 1} replicas online"
        for node in live:
            if _writing_aof(node):
                # A node's first AOF, written at start-up (~1 s here): till it is done, it
                # refuses SIGTERM ("Writing initial AOF, can't exit"), and a replica
                # acknowledges writes late.
                return f"node {node.port} is writing its AOF"
        # Online is not yet answering: WAIT counts the replicas that hold a write, and a PUBLISH
        # goes down the replication stream without touching a key.
        try:
            with redis.Redis(host="127.0.0.1", port=primary.port, socket_timeout=1) as client:
                pipe = client.pipeline(transaction=False)
                pipe.publish("llmserve:ha:probe", "")
                pipe.execute_command("WAIT", len(live) - 1, 50)
                acked = pipe.execute()[1]
        except redis.RedisError as e:
            return f"primary: {e}"
        if acked < len(live) - 1:
            return f"{acked} of {len(live) - 1} replicas acknowledge writes"
        return None

    # ---------------------------------------------------------------- what tests use

    @property
    def sentinel_arg(self) -> str:
        """The `--redis-sentinel` value."""
        return ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)

    @property
    def sentinel_addresses(self) -> tuple[tuple[str, int], ...]:
        return tuple(("127.0.0.1", s.port) for s in self.sentinels)

    def node_at(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def primary(self, timeout: float = 10.0) -> RedisServer:
        """The node the Sentinels name primary now (waiting until those answering agree: one
        may lag a moment behind the others after a failover)."""
        deadline = time.monotonic() + timeout
        while True:
            states = [s.master_state() for s in self.sentinels]
            ports = {int(st["port"]) for st in states if st is not None}
            if len(ports) == 1:
                return self.node_at(ports.pop())
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Sentinels do not agree on a primary: {ports}")
            time.sleep(0.05)

    def close(self) -> None:
        for s in self.sentinels:
            s.stop()
        for n in self.nodes:
            if n.proc is not None:
                n.proc.send_signal(signal.SIGCONT)  # a paused one could not act on SIGTERM
        # Replicas first: a primary told to stop waits (up to shutdown-timeout) for connected
        # replicas to acknowledge its last writes, ~1 s here; with none left it stops at once.
        for n in sorted(self.nodes, key=_is_primary):
            n.close()

    def __enter__(self) -> RedisHA:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
