"""The whole stack on loopback for end-to-end tests: Redis, executor and scheduler processes.

Every part is real: a Redis server, `python -m executor_svc` on the tiny demo model and
`python -m scheduler_svc` in front of it, each on an OS-chosen port. The scheduler and Redis can
be killed and restarted to test recovery.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scheduler_svc.local.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _wait_port_file(path: Path, proc: subprocess.Popen, timeout: float, what: str) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} (see {path.parent})")
        time.sleep(0.05)
    raise TimeoutError(f"{what} did not start within {timeout}s")


def stop_process(proc: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM, then SIGKILL if it is still there after `timeout` seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_serving(address: str, timeout: float = 60.0) -> None:
    """Block until the server's grpc.health.v1 status is SERVING."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    raise TimeoutError(f"{address} not SERVING within {timeout}s")


@dataclass
class Stack:
    workdir: Path
    model_dir: Path
    redis: RedisServer
    executor_args: list[str] = field(default_factory=list)
    scheduler_args: list[str] = field(default_factory=list)
    executor_proc: subprocess.Popen | None = None
    scheduler_proc: subprocess.Popen | None = None
    executor_port: int = 0
    port: int = 0
    # The scheduler finds executors in the Redis registry (--discover-executors) instead of
    # being given this stack's executor address.
    discover: bool = False
    _restarts: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def executor_address(self) -> str:
        return f"127.0.0.1:{self.executor_port}"

    def start_executor(self) -> None:
        port_file = self.workdir / f"executor-{self._restarts}.port"
        log = open(self.workdir / "executor.log", "ab")  # noqa: SIM115 - owned by the process
        cmd = [
            sys.executable, "-m", "executor_svc", "--model", str(self.model_dir),
            "--port", str(self.executor_port), "--port-file", str(port_file),
            "--log-level", "warning", *self.executor_args,
        ]  # fmt: skip
        self.executor_proc = subprocess.Popen(cmd, env=_env(), stdout=log, stderr=log)
        self.executor_port = _wait_port_file(port_file, self.executor_proc, 120, "executor")

    def start_scheduler(self) -> None:
        self._restarts += 1
        port_file = self.workdir / f"scheduler-{self._restarts}.port"
        log = open(self.workdir / "scheduler.log", "ab")  # noqa: SIM115
        cmd = [
            sys.executable, "-m", "scheduler_svc",
            *(["--discover-executors"] if self.discover else ["--executor", self.executor_address]),
            "--redis-url", self.redis.url,
            "--port", str(self.port), "--port-file", str(port_file),
            "--log-level", "warning", *self.scheduler_args,
        ]  # fmt: skip
        self.scheduler_proc = subprocess.Popen(cmd, env=_env(), stdout=log, stderr=log)
        self.port = _wait_port_file(port_file, self.scheduler_proc, 120, "scheduler")
        wait_serving(self.address)

    def kill_scheduler(self) -> None:
        """kill -9: no shutdown code runs."""
        assert self.scheduler_proc is not None
        self.scheduler_proc.send_signal(signal.SIGKILL)
        self.scheduler_proc.wait()

    def stop(self) -> None:
        for proc in (self.scheduler_proc, self.executor_proc):
            if proc is not None:
                stop_process(proc)

    def logs(self) -> str:
        out = []
        for name in ("scheduler.log", "executor.log"):
            p = self.workdir / name
            if p.exists():
                out.append(f"--- {name}\n" + p.read_text(errors="replace")[-4000:])
        return "\n".join(out)


def tiny_model_dir(root: Path) -> Path:
    return demo_model_dir(root, size="tiny")


def demo_model_dir(root: Path, size: str = "demo") -> Path:
    """The demo checkpoint of `size` under `root` ("demo": what `python -m executor_svc` serves
    by default), built on first use."""
    from executor_svc.demo.demo_model import ensure_demo_model

    return ensure_demo_model(root, size=size, seed=0)


def make_stack(
    tmp: Path,
    redis: RedisServer,
    *,
    executor_args: list[str] | None = None,
    scheduler_args: list[str] | None = None,
    model_dir: Path | None = None,
) -> Stack:
    stack = Stack(
        workdir=tmp,
        model_dir=model_dir or tiny_model_dir(tmp.parent / "models"),
        redis=redis,
        executor_args=executor_args or ["--num-device-blocks", "512", "--swap-space", "0.05"],
        scheduler_args=scheduler_args or [],
    )
    stack.start_executor()
    try:
        stack.start_scheduler()
    except BaseException:
        stack.stop()
        print(stack.logs())
        raise
    return stack


@contextlib.contextmanager
def serving_stack(
    tmp: Path,
    model_dir: Path,
    executor_args: list[str],
    scheduler_args: list[str] | None = None,
) -> Iterator[Stack]:
    """Redis (in tmp/redis), an executor serving `model_dir` and a scheduler, all under `tmp`;
    on a failure (starting or in the body) the processes' logs are printed before it goes on."""
    redis = RedisServer(data_dir=tmp / "redis")
    redis.start()
    stack = Stack(
        workdir=tmp,
        model_dir=model_dir,
        redis=redis,
        executor_args=executor_args,
        scheduler_args=scheduler_args or [],
    )
    try:
        stack.start_executor()
        stack.start_scheduler()
        yield stack
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack.stop()
        redis.close()


@pytest.fixture(scope="module")
def llmserve_stack(tmp_path_factory) -> Iterator[Stack]:
    """A running stack shared by a test module: `.address` is the scheduler's host:port."""
    tmp = tmp_path_factory.mktemp("stack")
    redis = RedisServer(data_dir=tmp / "redis")
    redis.start()
    try:
        stack = make_stack(tmp, redis)
        try:
            yield stack
        finally:
            stack.stop()
    finally:
        redis.close()


def start_two_executor_stack(
    tmp: Path,
    redis: RedisServer,
    executor_args: list[str],
    *,
    second_args: list[str] | None = None,
    scheduler_args: list[str] = (),  # type: ignore[assignment]
    model_dir: Path | None = None,
) -> tuple[Stack, Stack]:
    """A scheduler with two executors: `stack` (its own executor and the scheduler) and
    `second` (an executor alone, in tmp/second, with `second_args` or `executor_args`). The
    scheduler reaches the second one with --executor; stop both stacks when done. Both serve
    `model_dir` (default: the tiny demo model)."""
    (tmp / "second").mkdir()
    model_dir = model_dir or tiny_model_dir(tmp.parent / "models")
    second = Stack(
        workdir=tmp / "second",
        model_dir=model_dir,
        redis=redis,
        executor_args=second_args if second_args is not None else executor_args,
    )
    second.start_executor()
    try:
        stack = make_stack(
            tmp,
            redis,
            executor_args=executor_args,
            scheduler_args=["--executor", second.executor_address, *scheduler_args],
            model_dir=model_dir,
        )
    except BaseException:
        second.stop()
        raise
    return stack, second
