"""Rank 0's side of tensor parallelism: start the worker ranks, watch them, stop them.

The gRPC server process is rank 0. ``TPWorkers.start`` opens a TCPStore on loopback (OS-chosen
port), starts ranks 1..N-1 as ``python -m executor_svc.runner.tp_worker`` and joins the group
with them. One watchdog thread per worker waits on its process: a worker that exits while the
executor is not stopping takes the executor down (log line ``tp.rank_died`` naming the rank,
exit code ``EXIT_RANK_DIED``), since its shard of every layer is gone; the scheduler then moves
the requests as for any dead executor. ``stop`` sends the shutdown message and reaps them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist

from executor_svc.config import envs
from executor_svc.parallel.group import TPGroup, close_group, init_group, tp_shape_error
from executor_svc.runner.loader import resolve_device

log = structlog.get_logger(__name__)

EXIT_RANK_DIED = 70
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def worker_device(device: str, rank: int) -> torch.device:
    """Rank ``rank``'s device: CUDA device ``rank`` (one per rank), or the CPU."""
    dev = resolve_device(device)
    return torch.device("cuda", rank) if dev.type == "cuda" else dev


def tensor_parallel_error(config: dict[str, Any], world_size: int, device: str) -> str | None:
    """Why ``config.json`` (a dict) cannot run on ``world_size`` ranks of ``device``, or None."""
    if world_size < 1:
        return f"--tensor-parallel-size must be >= 1, got {world_size}"
    heads = config.get("num_attention_heads", 0)
    error = tp_shape_error(
        heads,
        config.get("num_key_value_heads") or heads,
        config.get("intermediate_size", 0),
        world_size,
    )
    if error is not None:
        return error
    uses_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if uses_cuda and world_size > torch.cuda.device_count():
        return (
            f"--tensor-parallel-size {world_size} needs {world_size} CUDA devices, "
            f"{torch.cuda.device_count()} visible"
        )
    return None


class TPWorkers:
    """The worker processes of one executor (ranks 1..world_size-1) and rank 0's group."""

    def __init__(
        self,
        world_size: int,
        model_dir: str | Path,
        runner_kwargs: dict[str, Any],
        *,
        log_level: str = "info",
    ) -> None:
        self.world_size = world_size
        self.model_dir = str(model_dir)
        self.runner_kwargs = runner_kwargs
        self.log_level = log_level
        self.procs: dict[int, subprocess.Popen] = {}
        self.tp: TPGroup | None = None
        self._stopping = threading.Event()
        self._store: dist.TCPStore | None = None

    def start(self) -> TPGroup:
        """Start the workers and join the group with them (returns once all have joined)."""
        if sys.platform.startswith("linux"):
            envs.use_loopback_for_gloo()
        device = worker_device(self.runner_kwargs.get("device", "auto"), 0)
        self._store = dist.TCPStore(
            "127.0.0.1", 0, self.world_size, is_master=True, wait_for_workers=False
        )
        env = envs.child_environment(str(PACKAGE_ROOT))
        # A dataclass option (an adapter config) goes as its fields (tp_worker builds it again).
        kwargs = json.dumps(self.runner_kwargs, default=dataclasses.asdict)
        # The command line's settings (--load-format, ...) go as an object, not as variables.
        flags = envs.runtime_flags().to_json()
        for rank in range(1, self.world_size):
            cmd = [
                sys.executable, "-m", "executor_svc.runner.tp_worker",
                "--rank", str(rank), "--world-size", str(self.world_size),
                "--store-port", str(self._store.port), "--parent-pid", str(os.getpid()),
                "--model-dir", self.model_dir, "--runner-kwargs", kwargs,
                "--cpu-threads", str(torch.get_num_threads()), "--log-level", self.log_level,
                "--runtime-flags", flags,
            ]  # fmt: skip
            proc = subprocess.Popen(cmd, env=env)
            self.procs[rank] = proc
            log.info("tp.worker_started", rank=rank, pid=proc.pid)
            threading.Thread(
                target=self._watch, args=(rank, proc), name=f"tp-watch-{rank}", daemon=True
            ).start()
        self.tp = init_group(self._store, 0, self.world_size, device)
        return self.tp

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self._stopping.is_set():
            return
        log.error("tp.rank_died", rank=rank, pid=proc.pid, exit_code=code)
        self._kill_all()
        # Rank 0 cannot go on without the shard; a step in flight may be stuck in a collective,
        # so no graceful path is safe: exit now and let the scheduler fail the requests over.
        sys.stderr.flush()
        os._exit(EXIT_RANK_DIED)

    def _kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()

    def stop(self, step_lock: threading.Lock | None = None, timeout: float = 10.0) -> None:
        """Tell every worker to exit (after the step in flight, if any) and reap them."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        # A step still running holds the lock; the shutdown message must not overtake it.
        locked = step_lock.acquire(timeout=timeout) if step_lock is not None else True
        try:
            if locked and self.tp is not None:
                from executor_svc.runner.tp_step import send_shutdown

                send_shutdown(self.tp)
        except Exception as e:  # a worker already gone: the others are reaped below
            log.warning("tp.shutdown_send_failed", error=str(e))
        finally:
            if locked and step_lock is not None:
                step_lock.release()
        for rank, proc in self.procs.items():
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("tp.worker_killed", rank=rank, pid=proc.pid)
                proc.kill()
                proc.wait()
        close_group()
        log.info("tp.workers_stopped", num_workers=len(self.procs))
