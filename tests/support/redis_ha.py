"""The Redis HA topology of scheduler_svc/local/redis_ha.py with what tests do to it: kill -9
of the primary, waiting for Sentinel's failover, restarting a node, stalling one."""

from __future__ import annotations

import signal
import time

import redis

from scheduler_svc.local.redis_ha import MASTER, NODE_ARGS
from scheduler_svc.local.redis_ha import RedisHA as _Topology
from scheduler_svc.local.redis_server import RedisServer

__all__ = ["MASTER", "RedisHA"]


class RedisHA(_Topology):
    def primary_client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.primary().port, socket_timeout=2)

    def kill_primary(self) -> RedisServer:
        """kill -9 of the current primary; returns its node (stopped)."""
        node = self.primary()
        node.stop(kill=True)
        return node

    def wait_failover(self, old: RedisServer, timeout: float = 30.0) -> RedisServer:
        """Until the Sentinels name another primary and it accepts writes; returns it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [s.master_state() for s in self.sentinels]
            ports = {int(st["port"]) for st in states if st is not None}
            if len(ports) == 1 and old.port not in ports:
                node = self.node_at(ports.pop())
                try:
                    client = redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=1)
                    if client.info("replication")["role"] == "master":
                        return node
                except redis.RedisError:
                    pass
            time.sleep(0.05)
        raise TimeoutError(f"no failover from port {old.port} within {timeout}s")

    def restart_as_replica(self, node: RedisServer, timeout: float = 30.0) -> None:
        """Start a stopped node again as a replica of the current primary (what an operator or
        an orchestrator restarting it with Sentinel's view does), and return once it has synced.
        Started bare, the old primary would come back as a stale primary until Sentinel demotes
        it (~10-15 s), which clients following Sentinel never write to anyway.

        Until its first sync is done the node runs with `replica-priority 0`: Sentinel never
        promotes it. Otherwise a failover in that window may pick it as the only candidate and
        serve its stale data (with down-after-milliseconds 1000 spurious failovers came ~1 s
        after each promotion here: scheduler_svc/local/redis_ha.py)."""
        primary = self.primary()
        node.extra_args = (
            *NODE_ARGS,
            "--replicaof",
            "127.0.0.1",
            str(primary.port),
            "--replica-priority",
            "0",
        )
        node.start()
        client = redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=2)
        deadline = time.monotonic() + timeout
        while True:
            try:
                info = client.info("replication")
                if (
                    info.get("master_link_status") == "up"
                    and not client.info("persistence")["loading"]
                ):
                    break
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {node.port} did not sync within {timeout}s")
            time.sleep(0.05)
        client.config_set("replica-priority", 100)
        client.close()

    def pause(self, node: RedisServer) -> None:
        """SIGSTOP: the node stays connected but answers nothing (a stalled replica)."""
        assert node.proc is not None
        node.proc.send_signal(signal.SIGSTOP)

    def resume(self, node: RedisServer) -> None:
        assert node.proc is not None
        node.proc.send_signal(signal.SIGCONT)

    def replicas(self) -> list[RedisServer]:
        primary = self.primary()
        return [n for n in self.nodes if n is not primary and n.proc is not None]
