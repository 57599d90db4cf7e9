"""The one way to start a local stack: Redis (unless REDIS_URL is set), one executor and the
scheduler, in the foreground. `make run` runs it, and so does the client's offline `LLM` (as a
child process, on ports the OS picks: `--executor-port 0 --scheduler-port 0 --frontend-port 0`).

`make run-ha` (`--redis-ha`): instead of one Redis, a primary, two replicas and three Sentinels
on loopback (scheduler_svc/local/redis_ha.py), the scheduler following Sentinel with
`--redis-min-replicas 1` (docs/redis-ha.md). Ctrl-C (or SIGTERM) stops all of it: the scheduler
drains, the executor and Redis exit. The scheduler runs in this process, through its own command
line (`scheduler_svc.cli.main`), so it checks its flags and exits with its status as
`llmserve-scheduler` would.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import structlog

from scheduler_svc import cli as scheduler_cli
from scheduler_svc import envs
from scheduler_svc.features.flags import add_launch_flags, launch_args
from scheduler_svc.logging import configure_logging

log = structlog.get_logger(__name__)


def start_executor(
    model: str, host: str, port: int, extra: list[str]
) -> tuple[subprocess.Popen, int]:
    """The executor as a child process, and its port (`port` 0: the one the OS picked), once it
    has loaded the model (the first run builds the demo)."""
    workdir = Path(tempfile.mkdtemp(prefix="llmserve-launch-"))
    port_file = workdir / "executor.port"
    cmd = [
        sys.executable, "-m", "executor_svc",
        "--model", model, "--host", host, "--port", str(port),
        "--port-file", str(port_file), *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd)
    try:
        # The executor writes the file (write, then rename) once it listens.
        while not port_file.exists():
            if proc.poll() is not None:
                raise SystemExit(f"executor exited with code {proc.returncode}")
            time.sleep(0.2)
        return proc, int(port_file.read_text())
    except BaseException:
        stop_process(proc, timeout=15)  # a stop during start-up stops what was started
        raise
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, then SIGKILL if it is still there after `timeout` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmserve-launch", description=__doc__)
    p.add_argument("--model", default=envs.local_model())
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--executor-port", type=int, default=50061, help="0 = one the OS picks")
    p.add_argument(
        "--scheduler-port",
        type=int,
        default=50051,
        help="0 = one the OS picks (find it with --scheduler-arg=--port-file=PATH)",
    )
    p.add_argument(
        "--frontend-port", type=int, default=8000, help="OpenAI-compatible HTTP; 0 = none"
    )
    p.add_argument("--redis-dir", default=".cache/redis")
    p.add_argument(
        "--redis-ha",
        action="store_true",
        help="Redis with 2 replicas and 3 Sentinels (data under --redis-dir/ha, empty at each "
        "start: their ports are new each time) instead of one",
    )
    p.add_argument(
        "--metrics-port", type=int, default=0, help="scheduler /metrics; 0 = none (executor: +1)"
    )
    p.add_argument(
        "--log-level", default="info", help="this launcher's, the executor's and the scheduler's"
    )
    p.add_argument("--executor-arg", action="append", default=[], help="passed to the executor")
    p.add_argument(
        "--scheduler-arg",
        action="append",
        default=[],
        help="passed to the scheduler, after the launcher's own (so it wins), e.g. "
        "--scheduler-arg=--max-num-seqs=64",
    )
    add_launch_flags(p)  # features' own (features/flags.py)
    return p


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.frontend_port and not args.scheduler_port:
        parser.error("the frontend needs a fixed --scheduler-port (or --frontend-port 0)")
    configure_logging(args.log_level)
    # SIGTERM (how the offline LLM stops this) stops the executor too, even before the
    # scheduler's own handler is installed.
    signal.signal(signal.SIGTERM, _interrupt)
    log.info("launch.executor_starting", model=args.model)
    executor_args = ["--log-level", args.log_level, *args.executor_arg]
    executor_args += launch_args(args)[0]
    if args.metrics_port:
        executor_args += ["--metrics-port", str(args.metrics_port + 1)]
    redis_args: list[str] = []
    ha = None
    if args.redis_ha:
        from scheduler_svc.local.redis_ha import MASTER, RedisHA

        ha_dir = Path(args.redis_dir) / "ha"
        shutil.rmtree(ha_dir, ignore_errors=True)  # Sentinel rewrites its config: start afresh
        ha = RedisHA(ha_dir).start()
        redis_args = ["--redis-url", "redis://", "--redis-sentinel", ha.sentinel_arg,
                      "--redis-sentinel-master", MASTER, "--redis-min-replicas", "1"]  # fmt: skip
        log.info("launch.redis_ha", sentinels=ha.sentinel_arg, primary=ha.primary().port)
    try:
        executor, executor_port = start_executor(
            args.model, args.host, args.executor_port, executor_args
        )
        serve(args, executor, executor_port, redis_args)
    finally:
        if ha is not None:
            ha.close()


def scheduler_argv(
    args: argparse.Namespace, executor_port: int, redis_args: list[str]
) -> list[str]:
    """The scheduler's command line; `--scheduler-arg`s last, so that they win."""
    return [
        "--executor", f"{args.host}:{executor_port}", "--host", args.host,
        "--port", str(args.scheduler_port), "--redis-dir", args.redis_dir,
        "--log-level", args.log_level,
        *(["--metrics-port", str(args.metrics_port)] if args.metrics_port else []),
        *launch_args(args)[1],
        *redis_args, *args.scheduler_arg,
    ]  # fmt: skip


def serve(
    args: argparse.Namespace, executor: subprocess.Popen, executor_port: int, redis_args: list[str]
) -> None:
    """Run the scheduler (and the frontend) in the foreground until Ctrl-C or SIGTERM."""
    sched_argv = scheduler_argv(args, executor_port, redis_args)
    frontend = None
    if args.frontend_port:
        frontend = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "frontend_svc",
                "--host",
                args.host,
                "--port",
                str(args.frontend_port),
                "--scheduler",
                f"{args.host}:{args.scheduler_port}",
            ]  # fmt: skip
        )
    if args.scheduler_port:
        print(
            f"\nllmserve is up: scheduler on {args.host}:{args.scheduler_port} "
            f'(try: .venv/bin/llmserve generate "Hello" --stream)'
            + (f", OpenAI API on http://{args.host}:{args.frontend_port}/v1" if frontend else "")
            + (
                f", metrics on http://{args.host}:{args.metrics_port}/metrics (executor: "
                f"{args.metrics_port + 1})"
                if args.metrics_port
                else ""
            )
            + ". Ctrl-C stops it.\n",
            flush=True,
        )
    try:
        with contextlib.suppress(KeyboardInterrupt):
            scheduler_cli.main(sched_argv)
    finally:
        if frontend is not None:
            stop_process(frontend, timeout=10)
        stop_process(executor, timeout=15)
        log.info("launch.stopped")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):  # stopped during start-up: nothing to add
        main()
