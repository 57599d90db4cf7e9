"""The tensor-parallel group of one executor and how a model's heads split over it.

Rank 0 is the gRPC server process; ranks 1..N-1 are its worker processes. Every rank joins one
``torch.distributed`` group: gloo on the CPU, NCCL on CUDA (one device per rank). On the CPU the
ranks, all on one host, also map one shared memory segment (``parallel/shm.py``) and each is
pinned to its own cores: the model's collectives and the step broadcast then go through it, one
ctypes call each; gloo is the fallback (no segment, ``LLMSERVE_TP_SHM=0``). On CUDA steps are
broadcast over a gloo group (``cpu_group``), so a worker waiting for the next step sleeps in a
socket read instead of spinning on a device stream.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import structlog
import torch
import torch.distributed as dist

from executor_svc.config import envs
from executor_svc.parallel.shm import ShmComm, pin_rank

log = structlog.get_logger(__name__)

# Workers wait for the next step inside a broadcast for as long as the executor is idle, so
# the group's timeout must outlast any idle period; a dead peer is noticed by the watchdogs
# (runner/tp_launcher.py, runner/tp_worker.py), not by this timeout.
GROUP_TIMEOUT = datetime.timedelta(days=365)


@dataclass(frozen=True, slots=True)
class HeadShard:
    """Which attention heads one rank holds."""

    num_heads: int  # query heads on this rank
    num_kv_heads: int  # K/V heads on this rank (and in its KV cache)
    first_head: int  # global index of its first query head
    first_kv_head: int  # global index of its first K/V head


def tp_shape_error(
    num_heads: int, num_kv_heads: int, intermediate_size: int, world_size: int
) -> str | None:
    """Why a model cannot be split over ``world_size`` ranks, or None when it can."""
    error = _heads_error(num_heads, num_kv_heads, world_size)
    if error is None and intermediate_size % world_size:
        error = (
            f"tensor-parallel size {world_size} does not divide the MLP width {intermediate_size}"
        )
    return error


def _heads_error(num_heads: int, num_kv_heads: int, world_size: int) -> str | None:
    if world_size < 1:
        return f"tensor-parallel size must be >= 1, got {world_size}"
    if num_heads % world_size:
        return (
            f"tensor-parallel size {world_size} does not divide the model's {num_heads} "
            "attention heads"
        )
    if num_kv_heads % world_size and world_size % num_kv_heads:
        return (
            f"tensor-parallel size {world_size} and the model's {num_kv_heads} KV heads: one "
            "must divide the other (KV heads are split, or replicated when fewer than ranks)"
        )
    return None


def shard_heads(num_heads: int, num_kv_heads: int, world_size: int, rank: int) -> HeadShard:
    """Whole heads per rank: query heads split evenly; K/V heads split too, or, when there are
    fewer K/V heads than ranks, each rank keeps the one head its query heads attend to (several
    ranks then hold copies of it, as vLLM does)."""
    error = _heads_error(num_heads, num_kv_heads, world_size)
    if error is not None:
        raise ValueError(error)
    heads = num_heads // world_size
    if num_kv_heads >= world_size:
        kv_heads = num_kv_heads // world_size
        first_kv = rank * kv_heads
    else:
        kv_heads = 1
        first_kv = rank // (world_size // num_kv_heads)
    return HeadShard(heads, kv_heads, rank * heads, first_kv)


class TPGroup:
    """One rank's view of the group, with the few collectives the model and the step use.

    ``comm_seconds`` adds up the wall time spent inside the model's collectives (all-reduce and
    logits gather) on this rank; on CUDA it only measures launch, NCCL being asynchronous.
    """

    def __init__(
        self, rank: int, world_size: int, device: torch.device, shm: ShmComm | None = None
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.cpu_group = (
            dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)
            if dist.get_backend() != "gloo"
            else dist.group.WORLD
        )
        self.comm_seconds = 0.0
        self.num_collectives = 0
        self.shm = shm  # the one-host shared memory path (CPU), None: torch.distributed

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        t0 = time.perf_counter()
        if self.shm is None or not self.shm.all_reduce(x):
            dist.all_reduce(x)
        self.comm_seconds += time.perf_counter() - t0
        self.num_collectives += 1
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``x`` concatenated along the last dimension, on rank 0 only."""
        t0 = time.perf_counter()
        x = x.contiguous()
        out = None
        if self.is_first:
            out = x.new_empty(*x.shape[:-1], x.shape[-1] * self.world_size)
        if self.shm is None or not self.shm.gather_last_dim(x, out):
            parts = (
                [torch.empty_like(x) for _ in range(self.world_size)] if out is not None else None
            )
            dist.gather(x, parts, dst=0)
            out = torch.cat(parts, dim=-1) if parts is not None else None
        self.comm_seconds += time.perf_counter() - t0
        self.num_collectives += 1
        return out

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's ``value`` (each rank gets the same answer)."""
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def broadcast_host(self, t: torch.Tensor) -> None:
        """Rank 0's CPU tensor into every rank's ``t`` (same shape and dtype everywhere).

        Over shared memory it waits with no timeout: a worker idles here between steps (in
        short sleeps), and a dead rank is still noticed by its pid."""
        if self.shm is None or not self.shm.broadcast(t, timeout_s=0.0):
            dist.broadcast(t, src=0, group=self.cpu_group)


def init_group(store: dist.Store, rank: int, world_size: int, device: torch.device) -> TPGroup:
    """Join the executor's group (blocks until every rank has joined)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT
    )
    shm = None
    if device.type == "cpu" and world_size > 1:
        if envs.tp_pin():
            cores = pin_rank(rank, world_size)
            if cores is not None and torch.get_num_threads() > len(cores):
                torch.set_num_threads(len(cores))
            log.info("tp.pinned", rank=rank, cores=cores, threads=torch.get_num_threads())
        if envs.tp_shm():
            shm = ShmComm.connect(store, rank, world_size, dist.group.WORLD)
        log.info("tp.collectives", rank=rank, path="shm" if shm is not None else "gloo")
    return TPGroup(rank, world_size, device, shm)


def close_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
