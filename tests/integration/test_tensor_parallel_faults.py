"""Tensor-parallel executors under faults: bad sizes, a dead worker rank, a dead rank 0.

A worker rank that dies takes its executor down (exit code EXIT_RANK_DIED, log line naming the
rank); behind a scheduler its requests then finish on another executor with the output an
undisturbed run gives. Stopping rank 0, gracefully or with SIGKILL, leaves no worker behind.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from executor_svc.runner.tp_launcher import EXIT_RANK_DIED
from protos import executor_pb2 as pb
from protos import scheduler_pb2 as spb
from scheduler_svc.local.redis_server import RedisServer
from tests.integration.test_failover import EXECUTOR_ARGS, MAX_TOKENS, check_outputs, workload
from tests.support.api_helpers import collect, run_in_threads, stream_in_threads, stub_for
from tests.support.executor_driver import ExecutorDriver, executor_channel, executor_subprocess
from tests.support.model_factory import make_tiny_checkpoint
from tests.support.stack import start_two_executor_stack

ROOT = Path(__file__).resolve().parents[2]
TP_ARGS = [
    "--device", "cpu", "--block-size", "4", "--num-device-blocks", "64",
    "--swap-space", "0.0005", "--tensor-parallel-size", "2", "--cpu-threads", "1",
]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tp-faults") / "m", "llama")


def worker_pids(pid: int) -> list[int]:
    return [
        c.pid
        for c in psutil.Process(pid).children()
        if "executor_svc.runner.tp_worker" in c.cmdline()
    ]


def wait_gone(pid: int, timeout: float) -> bool:
    """The process exited (a zombie nobody reaped yet counts as gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize(
    ("size", "message"),
    [
        ("3", "tensor-parallel size 3 does not divide the model's 4 attention heads"),
        ("0", "--tensor-parallel-size must be >= 1, got 0"),
    ],
)
def test_a_size_the_model_cannot_take_is_a_usage_error(model_dir: Path, size: str, message: str):
    proc = subprocess.run(
        [sys.executable, "-m", "executor_svc", "--model", str(model_dir), "--port", "0",
         "--device", "cpu", "--tensor-parallel-size", size],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "listening" not in proc.stdout  # refused before the port opened


def test_killed_worker_rank_takes_the_executor_down(model_dir: Path, tmp_path: Path) -> None:
    with executor_subprocess(model_dir, tmp_path, *TP_ARGS) as (proc, port):
        (worker,) = worker_pids(proc.pid)
        with executor_channel(port) as stub:
            driver = ExecutorDriver(stub)
            driver.add("a", [5, 6, 7, 8, 9])
            driver.add("b", [10, 11])
            for _ in range(3):
                driver.step()
            assert len(driver.seqs["a"].outputs) == 3
            psutil.Process(worker).send_signal(signal.SIGKILL)
            assert proc.wait(timeout=30) == EXIT_RANK_DIED
    log = (tmp_path / "executor.log").read_text()
    assert "event='tp.rank_died' rank=1" in log
    assert f"pid={worker} exit_code=-9" in log


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_no_worker_outlives_rank_0(model_dir: Path, tmp_path: Path, sig: signal.Signals):
    with executor_subprocess(model_dir, tmp_path, *TP_ARGS) as (proc, port):
        (worker,) = worker_pids(proc.pid)
        with executor_channel(port) as stub:
            ExecutorDriver(stub).generate([[5, 6, 7]], 2)
        proc.send_signal(sig)
        code = proc.wait(timeout=30)
        assert wait_gone(worker, timeout=10), f"worker {worker} outlived rank 0 ({sig.name})"
    assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
    if sig == signal.SIGTERM:
        log = (tmp_path / "executor.log").read_text()
        assert "tp.worker_stopped" in log and "tp.workers_stopped" in log
        assert "tp.rank_died" not in log


def test_requests_of_a_tp_executor_whose_worker_died_finish_elsewhere(tmp_path: Path) -> None:
    """test_failover's shape with the doomed executor running at TP = 2: kill -9 its worker
    rank mid-generation; every request finishes on the other executor, output unchanged."""
    redis = RedisServer(data_dir=tmp_path / "redis")
    redis.start()
    stack, doomed = start_two_executor_stack(
        tmp_path,
        redis,
        EXECUTOR_ARGS,
        second_args=[*EXECUTOR_ARGS, "--tensor-parallel-size", "2", "--cpu-threads", "1"],
        scheduler_args=["--executor-failover", "0.5"],
    )
    try:
        channel, stub = stub_for(stack.address)
        info = stub.GetServerInfo(spb.GetServerInfoRequest())
        assert len(info.executors) == 2
        with executor_channel(doomed.executor_port) as estub:
            assert estub.Describe(pb.DescribeRequest()).tensor_parallel_size == 2
        reference = run_in_threads([lambda r=r: collect(stub.Generate(r)) for r in workload("a")])
        assert all(r.error is None and len(r.tokens[0]) == MAX_TOKENS for r in reference)

        (worker,) = worker_pids(doomed.executor_proc.pid)
        results, threads = stream_in_threads(stub, workload("b"))
        info = stub.GetServerInfo(spb.GetServerInfoRequest())
        on_tp = next(e for e in info.executors if e.address == doomed.executor_address)
        assert on_tp.num_free_blocks < on_tp.num_device_blocks, "nothing ran on it"
        psutil.Process(worker).send_signal(signal.SIGKILL)
        assert doomed.executor_proc.wait(timeout=30) == EXIT_RANK_DIED
        for t in threads:
            t.join(timeout=180)

        check_outputs(results, reference)
        info = stub.GetServerInfo(spb.GetServerInfoRequest())
        health = {e.address: e.healthy for e in info.executors}
        assert health == {stack.executor_address: True, doomed.executor_address: False}
        assert "executor.failed_over" in stack.logs()
        assert "event='tp.rank_died' rank=1" in doomed.logs()
        channel.close()
    finally:
        stack.stop()
        doomed.stop()
        redis.close()
