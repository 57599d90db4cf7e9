"""Collectives between the CPU ranks of one host through a shared memory segment.

The protocol and the reduction order are in ``kernels/csrc/shm_collective.cpp``: each call is one
ctypes call that copies this rank's part into its slot, publishes a sequence number, waits for
the others' (spin, then yield, then short sleeps) and reads; every rank sums the parts in rank
order, so every rank gets the same bits whatever the timing. Gloo stays for ranks on different
hosts and wherever the segment cannot be had (``ShmComm.connect`` returns None), NCCL on CUDA.

Rank 0 creates ``/dev/shm/llmserve-tp-<pid>-<token>`` and names it to the others through the
group's store; once every rank has mapped it (a gloo all-reduce), rank 0 unlinks the name, so
the segment goes away with the last rank whatever way they end.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
from pathlib import Path

import structlog
import torch

from executor_svc.kernels import library

log = structlog.get_logger(__name__)

SHM_DIR = Path("/dev/shm")
# Bytes per slot (two per rank): one all-reduce of a [1024, 1024] fp32 tensor fits one round;
# larger ones take several rounds, the result being the same.
SLOT_BYTES = 4 << 20
# A collective with no progress for this long ends in TimeoutError; a dead peer is noticed
# within ~50 ms of the wait turning to sleeps (its pid is checked), whatever this is.
COLLECTIVE_TIMEOUT_S = 300.0

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_ERRORS = {-1: "no progress for {timeout:.0f} s", -2: "the process is gone", -3: "bad arguments"}


class ShmCommError(RuntimeError):
    """A peer rank died or stopped making progress inside a collective."""


class ShmComm:
    """This rank's mapping of the segment and the collectives over it (CPU tensors only)."""

    def __init__(self, rank: int, world_size: int, path: Path, create: bool) -> None:
        self.lib = library.load()
        if self.lib is None or not hasattr(self.lib, "llmserve_shm_all_reduce"):
            raise OSError("the CPU kernel library (shm collectives) is not available")
        self.rank, self.world_size, self.slot_bytes = rank, world_size, SLOT_BYTES
        self.timeout_s = COLLECTIVE_TIMEOUT_S
        size = self.lib.llmserve_shm_size(world_size, SLOT_BYTES)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)  # zero-filled: every sequence number starts at 0
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._buf = (ctypes.c_char * size).from_buffer(self._mm)
        self.base = ctypes.addressof(self._buf)
        self._bad_rank = ctypes.c_int(-1)
        self._bad_ptr = ctypes.addressof(self._bad_rank)
        self._check(self.lib.llmserve_shm_register(self.base, rank, world_size, SLOT_BYTES), "join")

    @classmethod
    def connect(cls, store: object, rank: int, world_size: int, group: object) -> ShmComm | None:
        """Every rank of ``group`` (a gloo group over the same ranks) calls this: the segment
        when every rank could map it, else None on every rank (then gloo does the work)."""
        import torch.distributed as dist

        key = "llmserve/tp_shm_path"
        comm: ShmComm | None = None
        path: Path | None = None
        try:
            if rank == 0:
                path = SHM_DIR / f"llmserve-tp-{os.getpid()}-{secrets.token_hex(4)}"
                comm = cls(rank, world_size, path, create=True)
                store.set(key, str(path))  # type: ignore[attr-defined]
            else:
                path = Path(store.get(key).decode())  # type: ignore[attr-defined]
                comm = cls(rank, world_size, path, create=False)
        except (OSError, ValueError) as err:  # no /dev/shm, another host, no library
            log.info("tp.shm_unavailable", rank=rank, error=str(err))
            if rank == 0 and path is not None:
                store.set(key, "")  # type: ignore[attr-defined]
            comm = None
        ok = torch.tensor([1 if comm is not None else 0], dtype=torch.long)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        if rank == 0 and path is not None and path.exists():
            path.unlink()  # every rank has mapped it (or given up): the name is no longer needed
        if not ok.item():
            return None
        return comm

    def _check(self, rc: int, what: str) -> None:
        if rc == 0:
            return
        peer = self._bad_rank.value
        why = _ERRORS.get(rc, f"error {rc}").format(timeout=self.timeout_s)
        raise ShmCommError(
            f"tensor-parallel {what} on rank {self.rank}: rank {peer} failed ({why}); the "
            "executor cannot go on without every rank's shard"
        )

    def all_reduce(self, x: torch.Tensor) -> bool:
        """Sum ``x`` over the ranks in place; False (nothing done) for a tensor it cannot take."""
        code = _DTYPES.get(x.dtype)
        if code is None or not x.is_contiguous() or x.device.type != "cpu":
            return False
        rc = self.lib.llmserve_shm_all_reduce(
            self.base, self.rank, self.world_size, SLOT_BYTES, x.data_ptr(), x.numel(), code,
            self.timeout_s, self._bad_ptr,
        )  # fmt: skip
        self._check(rc, "all-reduce")
        return True

    def gather_last_dim(self, x: torch.Tensor, out: torch.Tensor | None) -> bool:
        """Every rank's ``x`` [..., n] side by side into ``out`` [..., world * n] (None on ranks
        that do not want it); False when it cannot take ``x``."""
        row_bytes = x.shape[-1] * x.element_size()
        if not x.is_contiguous() or x.device.type != "cpu" or row_bytes > SLOT_BYTES:
            return False
        rows = x.numel() // max(x.shape[-1], 1)
        rc = self.lib.llmserve_shm_all_gather(
            self.base, self.rank, self.world_size, SLOT_BYTES, x.data_ptr(), rows, row_bytes,
            None if out is None else out.data_ptr(), self.timeout_s, self._bad_ptr,
        )  # fmt: skip
        self._check(rc, "gather")
        return True

    def broadcast(self, x: torch.Tensor, timeout_s: float | None = None) -> bool:
        """Rank 0's ``x`` into every rank's ``x``; ``timeout_s`` <= 0 waits for ever (a worker
        waiting for the next step; a dead rank 0 is still noticed)."""
        if not x.is_contiguous() or x.device.type != "cpu":
            return False
        timeout = self.timeout_s if timeout_s is None else timeout_s
        rc = self.lib.llmserve_shm_broadcast(
            self.base, self.rank, self.world_size, SLOT_BYTES, x.data_ptr(),
            x.numel() * x.element_size(), timeout, self._bad_ptr,
        )  # fmt: skip
        self._check(rc, "broadcast")
        return True


def pin_rank(rank: int, world_size: int) -> list[int] | None:
    """Pin this process (all its threads) to its share of the cores it may run on: rank r gets
    the r-th of ``world_size`` equal runs of them. None (nothing done) with fewer cores than
    ranks or where affinity is not supported."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    per_rank = len(allowed) // world_size
    if per_rank < 1:
        return None
    cores = allowed[rank * per_rank : (rank + 1) * per_rank]
    try:
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), cores)
    except OSError:
        return None
    return cores
