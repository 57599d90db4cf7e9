"""`make run`: Redis (unless REDIS_URL is set), one executor and the scheduler, in the foreground.

`make run-ha` (`--redis-ha`): instead of one Redis, a primary, two replicas and three Sentinels
on loopback (scheduler_svc/local/redis_ha.py), the scheduler following Sentinel with
`--redis-min-replicas 1` (docs/redis-ha.md). Ctrl-C (or SIGTERM) stops all of it: the scheduler
drains, the executor and Redis exit.
"""

from __future__ import annotations

import argparse
import asyncio
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
from scheduler_svc.core.spec_decode import SpeculativeConfig
from scheduler_svc.logging import configure_logging
from scheduler_svc.settings import SchedulerSettings

log = structlog.get_logger(__name__)


def start_executor(model: str, host: str, port: int, extra: list[str]) -> subprocess.Popen:
    port_file = Path(tempfile.mkdtemp(prefix="llmserve-launch-")) / "executor.port"
    cmd = [
        sys.executable, "-m", "executor_svc",
        "--model", model, "--host", host, "--port", str(port),
        "--port-file", str(port_file), *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd)
    # The executor writes its port file once the model is loaded (first run builds the demo).
    while not port_file.exists():
        if proc.poll() is not None:
            raise SystemExit(f"executor exited with code {proc.returncode}")
        time.sleep(0.2)
    return proc


def speculative_executor_args(speculative_config: str | None) -> list[str]:
    """The executor's share of a ``--speculative-config``: a draft model's checkpoint."""
    if not speculative_config:
        return []
    try:
        config = SpeculativeConfig.from_json(speculative_config)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"--speculative-config: {e}") from None
    return ["--speculative-model", config.model] if config.uses_draft else []


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="llmserve-launch", description=__doc__)
    p.add_argument("--model", default=envs.local_model())
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--executor-port", type=int, default=50061)
    p.add_argument("--scheduler-port", type=int, default=50051)
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
    p.add_argument("--executor-arg", action="append", default=[], help="passed to the executor")
    p.add_argument(
        "--speculative-config",
        default=None,
        help="the scheduler's --speculative-config; a draft_model's checkpoint is also passed to "
        "the executor (--speculative-model)",
    )
    args = p.parse_args(argv)
    configure_logging("info")
    log.info("launch.executor_starting", model=args.model)
    executor_args = list(args.executor_arg) + speculative_executor_args(args.speculative_config)
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
        executor = start_executor(args.model, args.host, args.executor_port, executor_args)
        serve(args, executor, redis_args)
    finally:
        if ha is not None:
            ha.close()


def serve(args: argparse.Namespace, executor: subprocess.Popen, redis_args: list[str]) -> None:
    """Run the scheduler (and the frontend) in the foreground until Ctrl-C."""
    sched_args = scheduler_cli.build_parser().parse_args(
        [
            "--executor",
            f"{args.host}:{args.executor_port}",
            "--host",
            args.host,
            "--port",
            str(args.scheduler_port),
            "--redis-dir",
            args.redis_dir,
            *(["--metrics-port", str(args.metrics_port)] if args.metrics_port else []),
            *(["--speculative-config", args.speculative_config] if args.speculative_config else []),
            *redis_args,
        ]  # fmt: skip
    )
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
            asyncio.run(scheduler_cli.run(SchedulerSettings.from_args(sched_args)))
    finally:
        if frontend is not None and frontend.poll() is None:
            frontend.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                frontend.wait(timeout=10)
        if executor.poll() is None:
            executor.send_signal(signal.SIGTERM)
            try:
                executor.wait(timeout=15)
            except subprocess.TimeoutExpired:
                executor.kill()
        log.info("launch.stopped")


if __name__ == "__main__":
    main()
