"""The shared memory collectives of CPU tensor parallelism (parallel/shm.py over
kernels/csrc/shm_collective.cpp), between real processes: results against a reference computed
in rank order (bitwise), the same bits on every rank, odd sizes and tensors larger than a slot,
many calls back to back, and a peer that dies or stalls is reported, not waited on for ever."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import secrets
import time
from pathlib import Path

import pytest
import torch

from executor_svc.kernels import library
from executor_svc.parallel import shm
from executor_svc.parallel.shm import ShmComm, ShmCommError

pytestmark = pytest.mark.skipif(
    not (library.available() and shm.SHM_DIR.is_dir()), reason="no kernel library or /dev/shm"
)

# Element counts: one, a vector's tail, several vectors plus a tail, and more than one slot.
SIZES = [1, 17, 4099, shm.SLOT_BYTES // 4 + 333]
NUM_BACK_TO_BACK = 300


def make_segment(world: int) -> Path:
    path = shm.SHM_DIR / f"llmserve-test-{os.getpid()}-{secrets.token_hex(4)}"
    size = library.load().llmserve_shm_size(world, shm.SLOT_BYTES)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def part(rank: int, n: int, call: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * call + rank)
    return (torch.randn(n, generator=g) * 10 ** (rank - 1)).to(dtype)


def reference_sum(world: int, n: int, call: int, dtype: torch.dtype) -> torch.Tensor:
    acc = part(0, n, call, dtype).float()
    for r in range(1, world):
        acc = acc + part(r, n, call, dtype).float()
    return acc.to(dtype)


def _collectives(rank: int, world: int, path: str, out: str) -> None:
    torch.set_num_threads(1)
    comm = ShmComm(rank, world, Path(path), create=False)
    digest = hashlib.sha256()
    call = 0
    for dtype in (torch.float32, torch.bfloat16):
        for n in SIZES:
            x = part(rank, n, call, dtype)
            assert comm.all_reduce(x)
            assert torch.equal(x, reference_sum(world, n, call, dtype)), (dtype, n)
            digest.update(x.view(torch.uint8).numpy().tobytes())
            call += 1
    for i in range(NUM_BACK_TO_BACK):  # alternating kinds, sizes and slots: no stale data
        n = 1 + (i * 37) % 700
        x = part(rank, n, call, torch.float32)
        assert comm.all_reduce(x)
        assert torch.equal(x, reference_sum(world, n, call, torch.float32)), i
        rows, cols = 1 + i % 5, 1 + i % 13
        y = torch.full((rows, cols), float(rank * 1000 + i))
        got = torch.empty(rows, cols * world) if rank == i % world else None
        assert comm.gather_last_dim(y, got)
        if got is not None:
            want = torch.cat(
                [torch.full((rows, cols), float(r * 1000 + i)) for r in range(world)], 1
            )
            assert torch.equal(got, want), i
        b = torch.full((i % 9,), float(i)) if rank == 0 else torch.zeros(i % 9)
        assert comm.broadcast(b)
        assert torch.equal(b, torch.full((i % 9,), float(i))), i
        call += 1
    big_rows = shm.SLOT_BYTES // (4 * 1000) + 3  # a gather of more than one slot
    y = part(rank, big_rows * 1000, call, torch.float32).view(big_rows, 1000)
    got = torch.empty(big_rows, 1000 * world)
    assert comm.gather_last_dim(y, got)
    want = torch.cat(
        [part(r, big_rows * 1000, call, torch.float32).view(big_rows, 1000) for r in range(world)],
        1,
    )
    assert torch.equal(got, want)
    Path(f"{out}.{rank}").write_text(digest.hexdigest())


def run_ranks(target, world: int, path: Path, *extra) -> list[int]:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, world, str(path), *extra)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    codes = []
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
        codes.append(p.exitcode)
    return codes


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_equal_the_rank_order_reference_on_every_rank(world: int, tmp_path: Path):
    path = make_segment(world)
    try:
        codes = run_ranks(_collectives, world, path, str(tmp_path / "digest"))
    finally:
        path.unlink()
    assert codes == [0] * world
    digests = {(tmp_path / f"digest.{r}").read_text() for r in range(world)}
    assert len(digests) == 1  # every rank holds the same bits


def _dies_or_stalls(rank: int, world: int, path: str, how: str, out: str) -> None:
    comm = ShmComm(rank, world, Path(path), create=False)
    x = torch.ones(10)
    comm.all_reduce(x)  # one good round first
    if rank == 1:
        if how == "dies":
            os._exit(9)
        time.sleep(5)
        return
    comm.timeout_s = 1.0
    t0 = time.monotonic()
    try:
        comm.all_reduce(x)
        Path(out).write_text("no error")
    except ShmCommError as err:
        Path(out).write_text(f"{time.monotonic() - t0:.2f} {err}")


@pytest.mark.parametrize(
    ("how", "why"), [("dies", "the process is gone"), ("stalls", "no progress")]
)
def test_a_dead_or_stalled_rank_is_an_error_naming_it(how: str, why: str, tmp_path: Path):
    path = make_segment(2)
    out = tmp_path / "result"
    try:
        run_ranks(_dies_or_stalls, 2, path, how, str(out))
    finally:
        path.unlink()
    seconds, message = out.read_text().split(" ", 1)
    assert "rank 1 failed" in message and why in message, message
    assert float(seconds) < 4.0


def _group(rank: int, world: int, port: str, use_shm: str, out: str) -> None:
    import torch.distributed as dist

    from executor_svc.parallel.group import close_group, init_group

    os.environ["LLMSERVE_TP_SHM"] = use_shm
    torch.set_num_threads(4)
    store = dist.TCPStore("127.0.0.1", int(port), world, is_master=rank == 0)
    tp = init_group(store, rank, world, torch.device("cpu"))
    x = part(rank, 1000, 7, torch.float32).view(10, 100)
    tp.all_reduce(x)
    gathered = tp.gather_last_dim(part(rank, 30, 8, torch.float32).view(3, 10))
    step = torch.arange(5) if rank == 0 else torch.zeros(5, dtype=torch.long)
    tp.broadcast_host(step)
    assert torch.equal(step, torch.arange(5))
    assert torch.equal(x.view(-1), reference_sum(world, 1000, 7, torch.float32))
    if rank == 0:
        want = torch.cat([part(r, 30, 8, torch.float32).view(3, 10) for r in range(world)], 1)
        assert torch.equal(gathered, want)
    else:
        assert gathered is None
    Path(f"{out}.{rank}").write_text(
        f"{tp.shm is not None} {sorted(os.sched_getaffinity(0))} {torch.get_num_threads()}"
    )
    close_group()


@pytest.mark.parametrize("use_shm", ["1", "0"])
def test_a_cpu_group_takes_the_shared_memory_path_and_pins_its_ranks(use_shm: str, tmp_path):
    from tests.support.prom import free_port

    port = free_port()
    codes = run_ranks(_group, 2, Path(str(port)), use_shm, str(tmp_path / "r"))
    assert codes == [0, 0]
    allowed = sorted(os.sched_getaffinity(0))
    for rank in range(2):
        shm_used, rest = (tmp_path / f"r.{rank}").read_text().split(" ", 1)
        cores, threads = rest.rsplit(" ", 1)
        assert shm_used == str(use_shm == "1")
        if len(allowed) >= 2:  # each rank on its own share of the cores, threads capped to it
            share = len(allowed) // 2
            assert cores == str(allowed[rank * share : (rank + 1) * share])
            assert int(threads) == share
