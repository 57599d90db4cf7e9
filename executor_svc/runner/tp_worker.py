"""A tensor-parallel worker: ranks 1..N-1 of an executor, started by rank 0 (``tp_launcher``).

``python -m executor_svc.runner.tp_worker --rank R ...``: joins the group, loads its shard of
the model, builds its KV cache (the block count agreed with the other ranks), then runs every
step rank 0 broadcasts until told to stop. It serves nothing itself and keeps no per-sequence
state. It dies with its parent: PR_SET_PDEATHSIG on Linux, and a thread that polls the parent
pid everywhere else (or should the signal be missed).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
import threading
import time
from typing import Any

import structlog
import torch

log = structlog.get_logger(__name__)

PR_SET_PDEATHSIG = 1
PARENT_POLL_S = 0.5
EXIT_PARENT_GONE = 3


def die_with_parent(parent_pid: int) -> None:
    """Exit as soon as the process that started this one is gone (SIGKILL included)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the polling thread below still covers it

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(EXIT_PARENT_GONE)

    # Also catches a parent that died before prctl took effect.
    if os.getppid() != parent_pid:
        os._exit(EXIT_PARENT_GONE)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


@torch.inference_mode()
def run_steps(runner: Any, tp: Any) -> int:
    """Apply every step rank 0 sends, in order, until the shutdown message; returns steps run.

    Mirrors ``ModelRunner.execute`` on rank 0 collective for collective: cache operations, the
    forward, the LM-head passes for prompt logprobs, then the one for the sampling rows.
    """
    from executor_svc.runner.tp_step import recv_step

    kv, model = runner.kv_cache, runner.model
    on_workers = runner.features.on_workers
    num_steps = 0
    while (msg := recv_step(tp)) is not None:
        kv.swap_out(msg.blocks_to_swap_out)
        kv.swap_in(msg.blocks_to_swap_in)
        kv.copy(msg.blocks_to_copy)
        if msg.batch is not None:
            b = msg.batch.to(runner.device)
            for f in on_workers:  # what features set on the model for the step
                f.worker_before_forward(msg.feature_data.get(f.name))
            try:
                hidden = model(b.input_ids, b.positions, kv.layers, b.attn_metadata)
            finally:
                for f in on_workers:
                    f.worker_after_forward()
            for first, end in msg.logit_row_ranges:
                model.compute_logits(hidden[first:end])
            if b.sample_rows.numel():
                model.compute_logits(hidden.index_select(0, b.sample_rows))
        num_steps += 1
    return num_steps


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmserve-executor-worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--store-port", type=int, required=True, help="rank 0's TCPStore on loopback")
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--runner-kwargs", default="{}", help="ModelRunner keyword arguments (JSON)")
    p.add_argument("--cpu-threads", type=int, default=None)
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--runtime-flags",
        default="{}",
        help="rank 0's config.envs.RuntimeFlags (JSON): its command line's settings",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    die_with_parent(args.parent_pid)
    # Ctrl-C reaches the whole process group; rank 0 decides how the executor stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from executor_svc.config import envs
    from executor_svc.config.logs import configure_logging

    # Before anything reads them: the numerics mode, the load format and the like are rank 0's.
    envs.install(envs.RuntimeFlags.from_json(args.runtime_flags))
    configure_logging(args.log_level)
    structlog.contextvars.bind_contextvars(tp_rank=args.rank)
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)

    import torch.distributed as dist

    from executor_svc.parallel.group import close_group, init_group
    from executor_svc.runner.model_runner import ModelRunner
    from executor_svc.runner.tp_launcher import worker_device

    kwargs = json.loads(args.runner_kwargs)  # features' options as JSON (features/registry.py)
    device = worker_device(kwargs.get("device", "auto"), args.rank)
    kwargs["device"] = str(device)
    store = dist.TCPStore("127.0.0.1", args.store_port, args.world_size, is_master=False)
    tp = init_group(store, args.rank, args.world_size, device)
    try:
        runner = ModelRunner(args.model_dir, tp=tp, **kwargs)
        log.info(
            "tp.worker_ready",
            device=str(device),
            num_kv_heads=runner.info.num_kv_heads,
            num_device_blocks=runner.num_device_blocks,
        )
        num_steps = run_steps(runner, tp)
    except Exception:
        log.exception("tp.worker_failed")
        return 1
    log.info("tp.worker_stopped", num_steps=num_steps)
    close_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
