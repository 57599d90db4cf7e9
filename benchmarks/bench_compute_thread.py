"""A CPU executor's decode step over gRPC, two source trees alternated: what one compute thread
(executor_svc/api/compute.py) changes against steps run on whichever gRPC thread took the call.

Each round starts an executor process per tree on the same random SmolLM2-135M-shaped model,
drives it as a scheduler would (tests/support/executor_driver.py: one prefill, then decode steps
of `--batch` sequences while another client thread keeps calling Describe, so that successive
steps land on different gRPC threads as the scheduler's planned-ahead steps do) and reports the
median wall time of a step seen by the client, and the executor's threads at the end.

    python benchmarks/bench_compute_thread.py --base /path/to/other/tree --cpu-cores 0-1 \
        [--rounds 3] [--executors 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from protos import executor_pb2 as pb  # noqa: E402
from protos import executor_pb2_grpc as pb_grpc  # noqa: E402
from tests.support.executor_driver import ExecutorDriver  # noqa: E402

SHAPE = {
    "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
    "max_position_embeddings": 8192, "rope_theta": 100000.0, "tie_word_embeddings": True,
    "initializer_range": 0.02,
}  # fmt: skip


def make_model(path: Path) -> None:
    sets = [x for k, v in SHAPE.items() for x in ("--set", f"{k}={json.dumps(v).lower()}")]
    cmd = [sys.executable, "-m", "executor_svc.demo.demo_model", str(path), "--no-weights"]
    subprocess.run([*cmd, *sets], check=True, cwd=ROOT, capture_output=True)


def run_tree(tree: Path, model: Path, args: argparse.Namespace) -> tuple[float, int]:
    """(median step seconds, the first executor's threads at the end) of ``args.executors``
    executors of ``tree``, each on every core, driven at the same time."""
    with tempfile.TemporaryDirectory() as tmp:
        procs, ports = [], []
        try:
            for i in range(args.executors):
                port_file = Path(tmp) / f"port{i}"
                cmd = [sys.executable, "-m", "executor_svc", "--model", str(model)]
                cmd += ["--device", "cpu", "--load-format", "dummy", "--dtype", args.dtype]
                cmd += ["--port", "0", "--port-file", str(port_file), "--log-level", "warning"]
                cmd += ["--cpu-cores", args.cpu_cores] if args.cpu_cores else []
                env = {**os.environ, "PYTHONPATH": str(tree)}
                procs.append(subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL))
                while not port_file.exists():
                    if procs[-1].poll() is not None:
                        raise RuntimeError(f"the executor of {tree} exited")
                    time.sleep(0.1)
                ports.append(port_file.read_text().strip())
            times: list[list[float]] = [[] for _ in ports]

            def one(i: int) -> None:
                with grpc.insecure_channel(f"127.0.0.1:{ports[i]}") as ch:
                    times[i] = drive(pb_grpc.ExecutorStub(ch), args)

            drivers = [threading.Thread(target=one, args=(i,)) for i in range(len(ports))]
            for t in drivers:
                t.start()
            for t in drivers:
                t.join()
            threads = len(os.listdir(f"/proc/{procs[0].pid}/task"))
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=30)
    return statistics.median(x for ts in times for x in ts), threads


def drive(stub: pb_grpc.ExecutorStub, args: argparse.Namespace) -> list[float]:
    """Decode steps, each sent while the one before is still running (as the scheduler's
    planned-ahead steps are: another gRPC thread takes it), timed end to end."""
    d = ExecutorDriver(stub)
    for i in range(args.batch):
        d.add(f"s{i}", [(7 * i + j) % 1000 + 10 for j in range(args.prompt)], pb.SamplingParams())
    d.step()  # the prefill
    for _ in range(args.warmup):
        d.step()
    times: list[float] = []
    busy = threading.Event()

    def describe_loop() -> None:  # keeps other gRPC threads in use beside the steps
        while not busy.is_set():
            stub.Describe(pb.DescribeRequest())
            time.sleep(0.001)

    side = threading.Thread(target=describe_loop, daemon=True)
    side.start()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        d.step()
        times.append(time.perf_counter() - t0)
    busy.set()
    side.join()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="the other source tree")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--cpu-cores",
        help="the executors' --cpu-cores (the compute thread is used only with it); default: "
        "unpinned",
    )
    ap.add_argument(
        "--executors",
        type=int,
        default=1,
        help="executors of one tree side by side (2: two "
        "processes sharing the cores, each with every core's thread)",
    )
    args = ap.parse_args()
    flags = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
    isa = sorted(f for f in flags.split() if f in {"avx2", "avx512f", "avx512_bf16", "amx_tile"})
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {' '.join(isa)}")
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "m"
        make_model(model)
        results: dict[str, list[float]] = {"base": [], "this": []}
        for r in range(args.rounds):
            for name, tree in (("base", args.base), ("this", ROOT)):
                step, threads = run_tree(tree, model, args)
                results[name].append(step)
                print(f"round {r} {name}: {step * 1e3:.2f} ms/step, {threads} threads", flush=True)
    b, t = (statistics.median(results[k]) for k in ("base", "this"))
    print(f"median of rounds: base {b * 1e3:.2f} ms, this {t * 1e3:.2f} ms, this/base {t / b:.3f}")


if __name__ == "__main__":
    main()
