"""Decode step time at tensor-parallel size 1 and 2, and where the TP = 2 time goes.

Model: the SmolLM-135M shape of bench_decode.py (hidden 576, 30 layers, intermediate 1536,
vocab 49152, tied embeddings), except that its 9 query / 3 KV heads of 64 become 12 / 4 heads
of 48: 9 heads do not split over 2 ranks. Widths, parameter count and KV bytes per token are
unchanged. fp32, random weights, CONTEXT tokens per sequence in the KV cache, one decode token
per sequence per step (the same step each time, as in bench_decode.py).

TP = 1 is ``ModelRunner.execute`` in this process; TP = 2 is rank 0 in this process plus one
worker process started by ``TPWorkers`` exactly as the executor starts it, both with
``--threads`` torch threads and the executor's default attention backend (``--attention-backend``;
the CPU kernel). TP = 2 uses what the executor uses: on the CPU the shared memory collectives with
each rank pinned to its own cores (rank 0, this process, runs the TP = 1 steps on its core too),
or gloo with ``LLMSERVE_TP_SHM=0``; ``LLMSERVE_TP_PIN=0`` leaves the ranks unpinned. Both
runners live in the same run and are timed alternately, ``--repeats`` rounds of ``--iters``
steps; the table shows medians. For TP = 2, rank 0's step time splits into: the step broadcast
(flattening the batch and sending it), time inside the model's collectives (61 all-reduces and
one logits gather; this includes waiting for the other rank to reach the collective), and the
rest (rank 0's own compute and sampling). A separate pair of processes then times the bare
collectives of one step (the same 61 all-reduces of ``[batch, 576]`` fp32, the logits gather,
the two broadcasts) with no model work, over gloo and over shared memory: the communication
floor; time in collectives above it is one rank waiting for the other.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_tp_decode.py --threads 1
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_tp_decode.py --threads 1 --quantization int4
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_decode import BLOCK_SIZE, CONTEXT, SMOLLM_135M  # noqa: E402
from executor_svc.parallel.shm import ShmComm  # noqa: E402
from executor_svc.runner.model_runner import ModelRunner, ScheduledSequence  # noqa: E402
from executor_svc.runner.sampler import SamplingParams  # noqa: E402
from executor_svc.runner.tp_launcher import TPWorkers  # noqa: E402
from tests.support.model_factory import make_tiny_checkpoint  # noqa: E402

SHAPE = {**SMOLLM_135M, "num_attention_heads": 12, "num_key_value_heads": 4}


def decode_seqs(batch: int) -> list[ScheduledSequence]:
    blocks_per_seq = -(-(CONTEXT + 1) // BLOCK_SIZE)
    g = torch.Generator().manual_seed(batch)
    seqs = []
    for i in range(batch):
        tokens = torch.randint(3, SHAPE["vocab_size"], (CONTEXT + 1,), generator=g).tolist()
        table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        seqs.append(ScheduledSequence(str(i), tokens, CONTEXT, table, CONTEXT, 1, SamplingParams()))
    return seqs


def timed(runner: ModelRunner, seqs: list[ScheduledSequence], iters: int) -> dict[str, float]:
    """Median step seconds, and for a TP runner the mean broadcast / collective seconds."""
    tp = runner.tp
    bcast0 = runner.phase_seconds.get("broadcast", 0.0)
    comm0 = tp.comm_seconds if tp is not None else 0.0
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        runner.execute(seqs, [], [], [])
        times.append(time.perf_counter() - t0)
    return {
        "step": statistics.median(times),
        "broadcast": (runner.phase_seconds.get("broadcast", 0.0) - bcast0) / iters,
        "collectives": ((tp.comm_seconds if tp is not None else 0.0) - comm0) / iters,
    }


def _collectives_floor(rank: int, port: int, batches: list[int], iters: int, out: Path) -> None:
    """One rank of the bare-collectives measurement: seconds per step's worth of them."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    num_all_reduces = 2 * SHAPE["num_hidden_layers"] + 1
    shm = ShmComm.connect(store, rank, 2, dist.group.WORLD)
    results = {}
    for path in ("gloo", "shm"):
        for b in batches:
            x = torch.randn(b, SHAPE["hidden_size"])
            logits = torch.randn(b, SHAPE["vocab_size"] // 2)
            parts = [torch.empty_like(logits) for _ in range(2)] if rank == 0 else None
            header = torch.zeros(13, dtype=torch.long)
            payload = torch.zeros(16 * b, dtype=torch.long)
            gathered = torch.empty(b, SHAPE["vocab_size"]) if rank == 0 else None
            times = []
            for _ in range(iters + 2):
                t0 = time.perf_counter()
                if path == "gloo":
                    dist.broadcast(header, 0)
                    dist.broadcast(payload, 0)
                    for _ in range(num_all_reduces):
                        dist.all_reduce(x)
                    dist.gather(logits, parts, dst=0)
                elif shm is not None:
                    shm.broadcast(header, 0.0)
                    shm.broadcast(payload, 0.0)
                    for _ in range(num_all_reduces):
                        shm.all_reduce(x)
                    shm.gather_last_dim(logits, gathered)
                times.append(time.perf_counter() - t0)
            results[(path, b)] = statistics.median(times[2:])
    if rank == 0:
        out.write_text(repr(results))
    dist.destroy_process_group()


def collectives_floor(batches: list[int], iters: int) -> dict[tuple[str, int], float]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:  # a free port for this throw-away store (benchmark only)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "floor"
        mp.start_processes(
            _collectives_floor, args=(port, batches, iters, out), nprocs=2, start_method="spawn"
        )
        return ast.literal_eval(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds")
    parser.add_argument("--iters", type=int, default=5, help="timed steps per round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument(
        "--attention-backend", default="auto", help="auto (the executor's default: cpu) or torch"
    )
    parser.add_argument(
        "--quantization", default=None, help="int8 or int4: both sizes quantized at load"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    kwargs = {
        "device": "cpu",
        "dtype": "float32",
        "block_size": BLOCK_SIZE,
        "num_device_blocks": max(batches) * -(-(CONTEXT + 1) // BLOCK_SIZE),
        "swap_space_gib": 0.01,
        "attention_backend": args.attention_backend,
        **({"quantization": args.quantization} if args.quantization else {}),
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_checkpoint(
            Path(tmp) / "smollm-shape-12h", "llama", tie_word_embeddings=True, **SHAPE
        )
        tp1 = ModelRunner(model_dir, **kwargs)
        workers = TPWorkers(2, model_dir, kwargs, log_level="warning")
        tp2 = ModelRunner(model_dir, tp=workers.start(), **kwargs)
    try:
        runners = {1: tp1, 2: tp2}
        steps = {b: decode_seqs(b) for b in batches}
        for r in runners.values():  # warm-up
            for seqs in steps.values():
                timed(r, seqs, 2)
        got: dict[tuple[int, int], list[dict[str, float]]] = {}
        for _ in range(args.repeats):
            for b, seqs in steps.items():
                for size, r in runners.items():
                    got.setdefault((size, b), []).append(timed(r, seqs, args.iters))
    finally:
        workers.stop()
    floor = collectives_floor(batches, args.iters * args.repeats)

    def med(size: int, b: int, key: str) -> float:
        return statistics.median(x[key] for x in got[(size, b)]) * 1e3

    lines = [
        f"cpu: {os.cpu_count()} CPUs, {args.threads} torch thread(s) per rank, "
        f"torch {torch.__version__}, TP=2 collectives: {tp2.tp.shm and 'shared memory' or 'gloo'}, "
        f"ranks pinned: {os.environ.get('LLMSERVE_TP_PIN', '1') != '0'}",
        "",
        "| batch | TP=1 ms/step | TP=2 ms/step | TP=1 / TP=2 | TP=2 broadcast ms "
        "| TP=2 in collectives ms | TP=2 rest (compute) ms | bare collectives ms (gloo / shm) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for b in batches:
        t1, t2 = med(1, b, "step"), med(2, b, "step")
        bc, cc = med(2, b, "broadcast"), med(2, b, "collectives")
        lines.append(
            f"| {b} | {t1:.1f} | {t2:.1f} | {t1 / t2:.2f} | {bc:.2f} | {cc:.2f} "
            f"| {t2 - bc - cc:.1f} | {floor[('gloo', b)] * 1e3:.2f} / {floor[('shm', b)] * 1e3:.2f} |"
        )
    lines.append("")
    lines.append(
        "per-round medians (ms), TP=1 / TP=2: "
        + "; ".join(
            f"b{b}: "
            + ", ".join(
                f"{x['step'] * 1e3:.0f}/{y['step'] * 1e3:.0f}"
                for x, y in zip(got[(1, b)], got[(2, b)], strict=True)
            )
            for b in batches
        )
    )
    # On a shared machine the fastest round is the one least disturbed by other work.
    lines.append(
        "fastest round (ms), TP=1 / TP=2 (ratio): "
        + "; ".join(
            f"b{b}: {min(x['step'] for x in got[(1, b)]) * 1e3:.1f}/"
            f"{min(y['step'] for y in got[(2, b)]) * 1e3:.1f} "
            f"({min(x['step'] for x in got[(1, b)]) / min(y['step'] for y in got[(2, b)]):.2f})"
            for b in batches
        )
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
