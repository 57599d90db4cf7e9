"""The same-host transport: the payload in a shared memory file the importer maps.

The exporter creates ``llmserve-kv-<random>`` under ``/dev/shm`` (a tmpfs: memory, never
disk), gathers the blocks straight into its mapping (one copy), and streams one chunk naming
it. The importer checks the name, the host and the size, maps the file, and removes it once
the import is done or refused: a segment is imported once. Segments no importer took are
removed by the exporter after ``ttl_s`` (at its next export) and when it stops.
"""

from __future__ import annotations

import mmap
import os
import re
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch

from executor_svc.kv_transfer.payload import Refusal, TransferError
from executor_svc.kv_transfer.transport import Received, Staged, Transport
from protos import executor_pb2 as pb

PREFIX = "llmserve-kv-"
_NAME = re.compile(re.escape(PREFIX) + r"[0-9a-f]{32}")
DEFAULT_TTL_S = 300.0


def shm_dir() -> Path:
    """/dev/shm where it exists (Linux), else the temporary directory."""
    dev_shm = Path("/dev/shm")
    return dev_shm if dev_shm.is_dir() else Path(tempfile.gettempdir())


def host_id() -> str:
    """This host's boot id: equal on both ends only when they run on one machine."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return f"host:{os.uname().nodename}"


def _map(fd: int, num_bytes: int) -> torch.Tensor:
    """The file as a uint8 tensor, its pages faulted in by one call (MAP_POPULATE) rather than
    one 4 KiB fault at a time during the copy (on the loaded 2-core dev box the difference was
    within the noise; it is the kernel's cheaper path either way)."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return torch.frombuffer(mmap.mmap(fd, num_bytes, flags=flags), dtype=torch.uint8)


class ShmTransport(Transport):
    kind = pb.KV_TRANSPORT_SHM

    def __init__(self, directory: Path | None = None, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.directory = directory or shm_dir()
        self.ttl_s = ttl_s
        self.host_id = host_id()
        self._lock = threading.Lock()
        self._created: dict[Path, float] = {}  # segments exported, by creation time

    def stage(self, num_bytes: int) -> Staged:
        self._expire()
        path = self.directory / f"{PREFIX}{uuid.uuid4().hex}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, num_bytes)
            with self._lock:
                self._created[path] = time.monotonic()
            data = _map(fd, num_bytes)
        finally:
            os.close(fd)
        return Staged(data, {"shm_name": path.name, "host_id": self.host_id})

    def send(self, header: pb.KVHeader, staged: Staged, chunk_bytes: int) -> Iterator[pb.KVChunk]:
        yield pb.KVChunk(header=header)

    def receive(self, first: pb.KVChunk, rest: Iterator[pb.KVChunk]) -> Received:
        header = first.header
        if any(True for _ in rest) or first.data:
            raise TransferError(Refusal.INVALID, "a shared memory payload comes in one chunk")
        if header.host_id != self.host_id:
            raise TransferError(
                Refusal.ELSEWHERE,
                "the shared memory segment is on another host; use KV_TRANSPORT_GRPC",
            )
        if not _NAME.fullmatch(header.shm_name):
            raise TransferError(
                Refusal.INVALID, f"{header.shm_name!r} is not a KV segment name ({PREFIX}<hex>)"
            )
        path = self.directory / header.shm_name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise TransferError(
                Refusal.ELSEWHERE,
                f"no shared memory segment {header.shm_name} here (imported already, expired, "
                "or the two ends do not share /dev/shm)",
            ) from None
        if size != header.num_bytes:
            path.unlink(missing_ok=True)
            raise TransferError(
                Refusal.CORRUPT,
                f"segment {header.shm_name} holds {size} bytes, the header says {header.num_bytes}",
            )
        fd = os.open(path, os.O_RDWR)
        try:
            data = _map(fd, size)
        finally:
            os.close(fd)
        return Received(data, lambda: path.unlink(missing_ok=True))

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            old = [p for p, t in self._created.items() if now - t > self.ttl_s]
            for p in old:
                del self._created[p]
        for p in old:
            p.unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            paths, self._created = list(self._created), {}
        for p in paths:
            p.unlink(missing_ok=True)
