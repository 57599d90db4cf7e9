"""KV transfer throughput on one host (issue 47): gRPC relayed, gRPC pushed, shared memory,
against a memcpy.

Two real executors run as subprocesses (``python -m executor_svc``) on a small random model
whose KV is 256 KiB a block (4 layers, 8 KV heads of 64, 16 tokens a block, fp32), each with
a cache big enough for the largest size asked. For each size, this process moves that many
bytes of blocks from A to B with ``kv_transfer.client.move_kv`` (ExportKV on A piped through
this process into ImportKV on B) and times the whole call: gather under A's step lock, the
CRC-32, the transport, the CRC-32 check and the scatter on B. ``grpc``: the chunks pass through
this process (the scheduler's relay); ``push``: this process only asks, A streams the chunks
to B itself (PushKV); ``shm``: a shared memory segment, only the header through this process.
The three alternate, one move each in turn, ``--repeats`` rounds. The reference is the plain
copy of the same bytes in one process (``dst.copy_(src)`` on warmed buffers) and the CRC-32
alone.

    .venv/bin/python benchmarks/bench_kv_transfer.py [--sizes-mb 64,256,512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from executor_svc.kv_transfer.client import block_lists, move_kv  # noqa: E402
from protos import executor_pb2 as pb  # noqa: E402
from protos import executor_pb2_grpc as pb_grpc  # noqa: E402
from tests.support.executor_driver import executor_subprocess  # noqa: E402
from tests.support.model_factory import make_tiny_checkpoint  # noqa: E402

MODEL = dict(
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    intermediate_size=512,
    vocab_size=512,
)
BLOCK_SIZE = 16
BLOCK_BYTES = 2 * 4 * BLOCK_SIZE * 8 * 64 * 4  # K and V, 4 layers, fp32: 256 KiB
MB = 1 << 20


@contextlib.contextmanager
def channel(port: int) -> Iterator[pb_grpc.ExecutorStub]:
    """A stub whose channel takes chunks over gRPC's default 4 MiB (--chunk-mb above 4)."""
    options = [("grpc.max_receive_message_length", 128 * MB)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as ch:
        yield pb_grpc.ExecutorStub(ch)


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def rate(num_bytes: int, seconds: list[float]) -> str:
    best, median = min(seconds), statistics.median(seconds)
    return f"{num_bytes / best / 1e9:6.2f} GB/s best, {num_bytes / median / 1e9:6.2f} median"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes-mb", default="64,256,512")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk-mb", type=float, default=2.0)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    num_blocks = max(sizes) * MB // BLOCK_BYTES
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    for size in sizes:
        n = size * MB
        src, dst = torch.rand(n // 4), torch.empty(n // 4)
        dst.copy_(src)  # fault the pages in
        warm = timed(lambda s=src, d=dst: d.copy_(s), args.repeats)
        print(f"{size:4d} MB memcpy  : {rate(n, warm)}")
        # What a transfer's staging buffer costs at least: a copy into pages never touched.
        fresh = timed(lambda s=src: torch.empty_like(s).copy_(s), args.repeats)
        print(f"{size:4d} MB memcpy to new pages: {rate(n, fresh)}")
        view = memoryview(src.numpy()).cast("B")
        crc = timed(lambda v=view: zlib.crc32(v), args.repeats)
        print(f"{size:4d} MB crc32   : {rate(n, crc)}")
        del src, dst, view
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_checkpoint(Path(tmp) / "model", "llama", **MODEL)
        flags = ["--device", "cpu", "--dtype", "float32", "--block-size", str(BLOCK_SIZE)]
        flags += ["--num-device-blocks", str(num_blocks), "--swap-space", "0"]
        (Path(tmp) / "a").mkdir()
        (Path(tmp) / "b").mkdir()
        with (
            executor_subprocess(model, Path(tmp) / "a", *flags) as (_, port_a),
            executor_subprocess(model, Path(tmp) / "b", *flags) as (_, port_b),
            channel(port_a) as a,
            channel(port_b) as b,
        ):
            assert a.Describe(pb.DescribeRequest()).num_device_blocks == num_blocks
            chunk = int(args.chunk_mb * MB)
            for size in sizes:
                n_blocks = size * MB // BLOCK_BYTES
                blocks = {"s": list(range(n_blocks))}
                moves = {
                    "grpc": lambda b_=blocks: move_kv(
                        a, b, b_, b_, transport=pb.KV_TRANSPORT_GRPC, chunk_bytes=chunk
                    ),
                    "push": lambda b_=blocks: a.PushKV(
                        pb.PushKVRequest(
                            export=pb.ExportKVRequest(sequences=block_lists(b_), chunk_bytes=chunk),
                            dst_address=f"127.0.0.1:{port_b}",
                            dst_sequences=block_lists(b_),
                        )
                    ),
                    "shm": lambda b_=blocks: move_kv(
                        a, b, b_, b_, transport=pb.KV_TRANSPORT_SHM, chunk_bytes=chunk
                    ),
                }
                secs: dict[str, list[float]] = {name: [] for name in moves}
                for move in moves.values():
                    move()  # warm: B's cache pages and the channels
                for _ in range(args.repeats):  # alternated: each in turn, round after round
                    for name, move in moves.items():
                        secs[name] += timed(move, 1)
                for name in moves:
                    print(f"{size:4d} MB {name:4s}    : {rate(size * MB, secs[name])}")


if __name__ == "__main__":
    main()
