"""Schedulers with `--leader-election` as real processes: a leader and its standbys on one Redis.

Each `Scheduler` is one `python -m scheduler_svc --leader-election` process. It can be started on
a given port, so that one killed and started again is found where clients already look for it
(a frontend's or client's channel over every scheduler address follows the SERVING one).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.async_client import channel_target
from protos import scheduler_pb2 as pb
from protos import scheduler_pb2_grpc as pb_grpc
from scheduler_svc.local.redis_server import RedisServer, _free_port
from tests.support.api_helpers import Collected
from tests.support.redis_ha import RedisHA
from tests.support.stack import Stack, _env, _wait_port_file, stop_process, tiny_model_dir

LEADER_KEY = "llmserve:leader"
SERVING = health_pb2.HealthCheckResponse.SERVING


class Scheduler:
    def __init__(
        self,
        workdir: Path,
        executor: str,
        redis_url: str,
        *extra: str,
        port: int = 0,
        log_level: str = "info",
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        # A fresh port file per start: a restarted process must not be taken as up from the
        # file its predecessor wrote.
        self.port_file = workdir / f"scheduler-{time.monotonic_ns()}.port"
        log = open(workdir / "scheduler.log", "ab")  # noqa: SIM115 -- owned by the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "scheduler_svc", "--executor", executor, "--redis-url",
             redis_url, "--port", str(port), "--port-file", str(self.port_file),
             "--leader-election", "--log-level", log_level, *extra],
            env=_env(), stdout=log, stderr=log,
        )  # fmt: skip
        try:
            self.port = _wait_port_file(self.port_file, self.proc, 60, "scheduler")
        except BaseException:
            stop_process(self.proc)  # nobody else holds it yet to stop it
            raise
        self.address = f"127.0.0.1:{self.port}"

    def health(self) -> int | None:
        try:
            with grpc.insecure_channel(self.address) as ch:
                reply = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=1
                )
            return reply.status
        except grpc.RpcError:
            return None

    def wait_serving(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.health() != SERVING:
            assert time.monotonic() < deadline, self.log()[-3000:]
            time.sleep(0.05)

    def wait_standing_by(self, timeout: float) -> None:
        """Until it has found the lease held by another and polls it (its first "leader.standby"
        since its last start as a standby)."""
        deadline = time.monotonic() + timeout
        while "leader.standby" not in self.log().rsplit("scheduler.restarting_as_standby", 1)[-1]:
            assert time.monotonic() < deadline, self.log()[-3000:]
            time.sleep(0.05)

    def log(self) -> str:
        return (self.workdir / "scheduler.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused one could not act on SIGTERM
        stop_process(self.proc)


def follow_channel(*schedulers: Scheduler) -> grpc.Channel:
    """One channel over every scheduler's address; calls go to the SERVING one (the leader)."""
    target, options = channel_target(",".join(s.address for s in schedulers))
    return grpc.insecure_channel(target, options=options)


def resuming_client(
    schedulers: tuple[Scheduler, ...], req: pb.GenerateRequest, got: Collected, codes: list
) -> None:
    """Generate, and after any broken call Resume from the last token received."""
    deadline = time.monotonic() + 180
    with follow_channel(*schedulers) as channel:
        stub = pb_grpc.SchedulerStub(channel)
        while 0 not in got.finish and time.monotonic() < deadline:
            try:
                if not got.messages:
                    stream = stub.Generate(req, timeout=120, wait_for_ready=True)
                else:
                    resume = pb.ResumeRequest(
                        request_id=req.request_id, from_token_index=len(got.tokens[0])
                    )
                    stream = stub.Resume(resume, timeout=120, wait_for_ready=True)
                for msg in stream:
                    got.add(msg)
            except grpc.RpcError as e:
                codes.append(e.code())
                time.sleep(0.05)


def resume_in_threads(
    schedulers: tuple[Scheduler, ...], reqs: list[pb.GenerateRequest], *, min_tokens: int = 2
) -> tuple[list[Collected], list[grpc.StatusCode], list[threading.Thread]]:
    """One `resuming_client` per request in its own thread; return once every stream has
    delivered `min_tokens` tokens (the threads keep collecting, and the status codes of the
    broken calls they re-attached after go into the returned list)."""
    results = [Collected() for _ in reqs]
    codes: list[grpc.StatusCode] = []
    threads = [
        threading.Thread(target=resuming_client, args=(schedulers, r, results[i], codes))
        for i, r in enumerate(reqs)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while min(len(r.tokens.get(0, [])) for r in results) < min_tokens:
        if time.monotonic() > deadline:
            raise TimeoutError("the streams did not start")
        time.sleep(0.01)
    return results, codes, threads


@contextlib.contextmanager
def electing_schedulers(
    tmp_path: Path, redis: RedisServer | None = None
) -> Iterator[tuple[Callable[[str], Scheduler], RedisServer]]:
    """One executor on the tiny demo model, and `start(name)`: a `--leader-election` scheduler
    in tmp_path/name on that executor and `redis` (the first one started becomes the leader).
    Without `redis`, a Redis of its own in tmp_path/redis. Every scheduler started, then the
    executor (then its own Redis), is stopped at the end."""
    with contextlib.ExitStack() as cleanup:
        if redis is None:
            redis = RedisServer(data_dir=tmp_path / "redis")
            redis.start()
            cleanup.callback(redis.close)
        stack = Stack(
            workdir=tmp_path,
            model_dir=tiny_model_dir(tmp_path.parent / "models"),
            redis=redis,
            executor_args=["--num-device-blocks", "512", "--swap-space", "0.05"],
        )
        cleanup.callback(stack.stop)
        stack.start_executor()
        url = redis.url

        def start(name: str) -> Scheduler:
            scheduler = Scheduler(tmp_path / name, stack.executor_address, url)
            cleanup.callback(scheduler.stop)  # last in, first out: before the executor
            return scheduler

        yield start, redis


@contextlib.contextmanager
def leader_and_standby(
    tmp_path: Path, *extra: str, num_device_blocks: int = 512, min_replicas: str = "1"
) -> Iterator[tuple[RedisHA, Stack, tuple[Scheduler, Scheduler]]]:
    """Redis HA (1 primary, 2 replicas, 3 Sentinels), one executor on the tiny demo model, and a
    leader and a standby on --redis-sentinel with --redis-min-replicas 1 (or `min_replicas`);
    `extra` goes to both schedulers. `--max-backlog-steps 8` makes the engine pause during a failover instead of
    generating far ahead in memory, so a kill lands mid-stream."""
    ha = RedisHA(tmp_path / "redis-ha").start()
    stack = Stack(
        workdir=tmp_path,
        model_dir=tiny_model_dir(tmp_path.parent / "models"),
        redis=ha.primary(),
        executor_args=["--num-device-blocks", str(num_device_blocks), "--swap-space", "0.05"],
    )
    schedulers: list[Scheduler] = []
    try:
        stack.start_executor()
        args = ("--redis-sentinel", ha.sentinel_arg, "--redis-min-replicas", min_replicas,
                "--max-backlog-steps", "8", *extra)  # fmt: skip
        url = "redis://"  # with Sentinels only credentials and db count
        # Fixed ports: a leader that loses its lease restarts as a standby in the same process,
        # and must be found where clients look for it.
        leader = Scheduler(tmp_path / "a", stack.executor_address, url, *args, port=_free_port())
        schedulers.append(leader)
        leader.wait_serving(60)
        standby = Scheduler(tmp_path / "b", stack.executor_address, url, *args, port=_free_port())
        schedulers.append(standby)
        standby.wait_standing_by(30)
        yield ha, stack, (leader, standby)
    finally:
        for s in schedulers:
            s.stop()
        stack.stop()
        ha.close()
