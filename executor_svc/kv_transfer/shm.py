"""The same-host transport: the payload in a shared memory file the importer maps.

The exporter creates ``llmserve-kv-<random>`` under ``/dev/shm`` (a tmpfs: memory, never
disk), gathers the blocks straight into its mapping (one copy), and streams one chunk naming
it. The importer checks the name, the host and the size and maps the file; a segment is
imported once.

Segments are reused: a new tmpfs page costs more than the copy into it (docs/benchmarks.md,
"KV transfer": "memcpy to new pages"), so the exporter keeps up to ``MAX_KEPT`` segments and
their mappings. Its header says so (``shm_reuse``); the importer then, once it has read the
payload (or found it corrupt), renames the segment to ``<name>.free`` instead of removing it,
and the exporter's next payload takes it back under a new random name, truncated or grown to
the payload's exact length (which importers check): no page allocated again where it fits, no
new mapping on the exporter's side when the length is the same. The kept segments serve all
the exporter's peers (an export does not know where it goes); concurrent exports may keep a
few more than ``MAX_KEPT``. A segment in flight longer than
``ttl_s`` and a free one unused for ``idle_s`` are removed, as is every segment when the
exporter stops; an importer of an older build removes a segment as before, and the exporter
then forgets it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from executor_svc.kv_transfer.payload import Refusal, TransferError
from executor_svc.kv_transfer.transport import Received, Staged, Transport
from protos import executor_pb2 as pb

PREFIX = "llmserve-kv-"
_NAME = re.compile(re.escape(PREFIX) + r"[0-9a-f]{32}")
DEFAULT_TTL_S = 300.0
DEFAULT_IDLE_S = 60.0  # a free segment unused this long gives its memory back
MAX_KEPT = 4  # segments an exporter keeps (each as long as the last payload it held)
FREE_SUFFIX = ".free"


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


@dataclass(slots=True)
class _Segment:
    """One kept segment of the exporter: in flight while its name exists, free once the
    importer renamed it to ``<name>.free``, gone (forgotten) when neither exists."""

    path: Path  # its name while in flight
    data: torch.Tensor  # [size] uint8: the exporter's mapping of the whole file
    used: float  # time.monotonic() of its last stage

    @property
    def free_path(self) -> Path:
        return self.path.with_name(self.path.name + FREE_SUFFIX)


class ShmTransport(Transport):
    kind = pb.KV_TRANSPORT_SHM

    def __init__(
        self,
        directory: Path | None = None,
        ttl_s: float = DEFAULT_TTL_S,
        idle_s: float = DEFAULT_IDLE_S,
        max_kept: int = MAX_KEPT,
    ) -> None:
        self.directory = directory or shm_dir()
        self.ttl_s = ttl_s
        self.idle_s = idle_s
        self.max_kept = max_kept
        self.host_id = host_id()
        self._lock = threading.Lock()
        self._created: dict[Path, float] = {}  # segments exported and not kept, by creation time
        self._pool: list[_Segment] = []

    def stage(self, num_bytes: int) -> Staged:
        self._expire()
        path = self.directory / f"{PREFIX}{uuid.uuid4().hex}"
        fields: dict[str, str | bool] = {"shm_name": path.name, "host_id": self.host_id}
        with self._lock:
            segment = self._take_free(num_bytes)
            kept = segment is not None or len(self._pool) < self.max_kept
            if segment is not None:
                os.rename(segment.free_path, path)
                segment.path = path
            if kept:
                fields["shm_reuse"] = True
        if segment is not None:
            if segment.data.numel() != num_bytes:
                # Exactly the payload's length, which an importer of an older build checks:
                # growing allocates only the new pages, shrinking frees the tail.
                segment.data = self._open(path, num_bytes, os.O_RDWR)
            segment.used = time.monotonic()
            return Staged(segment.data, fields)
        data = self._open(path, num_bytes, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        with self._lock:
            if kept:
                self._pool.append(_Segment(path, data, time.monotonic()))
            else:
                self._created[path] = time.monotonic()
        return Staged(data, fields)

    @staticmethod
    def _open(path: Path, num_bytes: int, flags: int) -> torch.Tensor:
        fd = os.open(path, flags, 0o600)
        try:
            if os.fstat(fd).st_size != num_bytes:
                os.ftruncate(fd, num_bytes)
            return _map(fd, num_bytes)
        finally:
            os.close(fd)

    def _take_free(self, num_bytes: int) -> _Segment | None:
        """The free segment for a payload of ``num_bytes`` (under the lock): the shortest that
        holds it (shrunk), else the longest (grown); forgets those an importer removed."""
        free, gone = [], []
        for seg in self._pool:
            if seg.free_path.exists():
                free.append(seg)
            elif not seg.path.exists():
                gone.append(seg)
        for seg in gone:
            self._pool.remove(seg)
        if not free:
            return None
        fits = [s for s in free if s.data.numel() >= num_bytes]
        return (
            min(fits, key=lambda s: s.data.numel())
            if fits
            else max(free, key=lambda s: s.data.numel())
        )

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
        if header.shm_reuse:  # the exporter takes it back for its next payload
            free_path = path.with_name(path.name + FREE_SUFFIX)
            return Received(data, lambda: _rename_quietly(path, free_path))
        return Received(data, lambda: path.unlink(missing_ok=True))

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            old = [p for p, t in self._created.items() if now - t > self.ttl_s]
            for p in old:
                del self._created[p]
            dropped = [
                s
                for s in self._pool
                if now - s.used > (self.idle_s if s.free_path.exists() else self.ttl_s)
            ]
            for s in dropped:
                self._pool.remove(s)
        for p in old:
            p.unlink(missing_ok=True)
        for s in dropped:
            s.path.unlink(missing_ok=True)
            s.free_path.unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            paths, self._created = list(self._created), {}
            pool, self._pool = self._pool, []
        for p in paths:
            p.unlink(missing_ok=True)
        for s in pool:
            s.path.unlink(missing_ok=True)
            s.free_path.unlink(missing_ok=True)


def _rename_quietly(src: Path, dst: Path) -> None:
    """The importer hands a segment back (gone already: the exporter expired or closed it)."""
    with contextlib.suppress(FileNotFoundError):
        os.rename(src, dst)
