"""An executor's end of KV transfers: ExportKV and ImportKV, from request to cache and back.

Everything is checked before any cache block is written: the header against this cache's
layout, the destination block ids, the byte count, the checksum, and (under the step lock,
where steps cannot change it) that no live sequence holds a destination block. A refused
import raises ``TransferError`` and leaves the cache as it was.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import structlog
import torch

from executor_svc.config import envs
from executor_svc.kv_transfer.payload import (
    DTYPES,
    CacheTensors,
    KVLayout,
    Refusal,
    TransferError,
    check_block_ids,
    crc32,
    gather,
    scatter,
)
from executor_svc.kv_transfer.shm import ShmTransport
from executor_svc.kv_transfer.transport import (
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    GrpcTransport,
    Transport,
)
from protos import executor_pb2 as pb

log = structlog.get_logger(__name__)


class KVEndpoint:
    """Reads and writes blocks of one KV cache for transfers, one step lock shared with steps."""

    def __init__(
        self,
        cache: CacheTensors,
        step_lock: threading.Lock,
        live_blocks: Callable[[], dict[int, str]],
        instance_id: str,
        transports: list[Transport] | None = None,
        run: Callable[..., Any] | None = None,
    ) -> None:
        """``live_blocks``: block id -> seq_id of every live sequence's blocks (asked under the
        step lock). ``run``: where the copies run, the lock taken there (the executor's compute
        thread, api/compute.py; default: the calling thread)."""
        self._run = run or (lambda fn, *args: fn(*args))
        self.cache = cache
        self.layout = KVLayout.of(cache)
        self.num_device_blocks = cache.key.shape[1]
        self._lock = step_lock
        self._live_blocks = live_blocks
        self.instance_id = instance_id
        self.transports = {t.kind: t for t in transports or [GrpcTransport(), ShmTransport()]}

    def export(self, request: pb.ExportKVRequest) -> Iterator[pb.KVChunk]:
        """The payload's chunks; the blocks are copied before this returns (under the lock)."""
        self._check_instance(request.instance_id)
        transport = self._transport(request.transport)
        chunk_bytes = request.chunk_bytes or DEFAULT_CHUNK_BYTES
        if chunk_bytes > MAX_CHUNK_BYTES:
            raise TransferError(
                Refusal.INVALID, f"chunk_bytes {chunk_bytes} is over {MAX_CHUNK_BYTES}"
            )
        block_ids = [b for s in request.sequences for b in s.block_ids]
        check_block_ids(block_ids, self.num_device_blocks, "source")
        num_blocks = len(block_ids)
        num_bytes = self.layout.num_bytes(num_blocks)
        staged = transport.stage(num_bytes)
        payload = staged.data.view(DTYPES[self.layout.dtype]).view(self.layout.shape(num_blocks))
        self._run(self._locked, gather, self.cache, block_ids, payload)
        header = pb.KVHeader(
            sequences=request.sequences,
            dtype=self.layout.dtype,
            shape=self.layout.shape(num_blocks),
            num_bytes=num_bytes,
            crc32=crc32(staged.data),
            transport=transport.kind,
            instance_id=self.instance_id,
            leader_epoch=request.leader_epoch,
            **staged.fields,
        )
        log.info(
            "kv.exported", num_blocks=num_blocks, num_bytes=num_bytes, transport=transport.kind
        )
        chunks = transport.send(header, staged, chunk_bytes)
        pause = envs.failpoint_delay("executor.export_kv")
        return _paused_after_first(chunks, pause) if pause else chunks

    def import_(self, chunks: Iterator[pb.KVChunk]) -> pb.ImportKVResponse:
        first = next(chunks, None)
        if first is None or not first.HasField("header"):
            raise TransferError(Refusal.INVALID, "the first chunk must carry the KVHeader")
        header = first.header
        self._check_instance(header.instance_id)
        layout = KVLayout.from_shape(list(header.shape), header.dtype)
        if layout != self.layout:
            raise TransferError(
                Refusal.INVALID,
                f"payload layout {layout} does not match this executor's cache {self.layout}",
            )
        block_ids = [b for s in header.sequences for b in s.block_ids]
        check_block_ids(block_ids, self.num_device_blocks, "destination")
        if len(block_ids) != header.shape[2]:
            raise TransferError(
                Refusal.INVALID,
                f"{len(block_ids)} destination blocks for a payload of {header.shape[2]} blocks",
            )
        num_bytes = layout.num_bytes(len(block_ids))
        if header.num_bytes != num_bytes:
            raise TransferError(
                Refusal.INVALID, f"num_bytes {header.num_bytes} is not the shape's {num_bytes}"
            )
        received = self._transport(header.transport).receive(first, chunks)
        try:
            if crc32(received.data) != header.crc32:
                raise TransferError(
                    Refusal.CORRUPT,
                    "the payload's CRC-32 does not match its header: import refused, the "
                    "destination blocks are unchanged",
                )
            payload = received.data.view(DTYPES[layout.dtype]).view(layout.shape(len(block_ids)))
            self._run(self._locked, self._scatter, header.sequences, block_ids, payload)
        except TransferError as e:
            # A corrupt payload is dropped; one refused for its destination may be retried
            # (a shared memory segment stays until the exporter's expiry).
            if e.refusal is Refusal.CORRUPT:
                received.release()
            raise
        received.release()
        log.info("kv.imported", num_blocks=len(block_ids), num_bytes=num_bytes)
        return pb.ImportKVResponse(num_blocks=len(block_ids), num_bytes=num_bytes)

    def _locked(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self._lock:
            return fn(*args)

    def _scatter(self, sequences: Any, block_ids: list[int], payload: torch.Tensor) -> None:
        self._check_not_live(sequences)
        scatter(self.cache, block_ids, payload)

    def close(self) -> None:
        for t in self.transports.values():
            t.close()

    def _transport(self, kind: int) -> Transport:
        transport = self.transports.get(kind or pb.KV_TRANSPORT_GRPC)
        if transport is None:
            raise TransferError(Refusal.INVALID, f"unknown KV transport {kind}")
        return transport

    def _check_instance(self, instance_id: str) -> None:
        if instance_id and instance_id != self.instance_id:
            raise TransferError(
                Refusal.ELSEWHERE,
                f"transfer meant for executor instance {instance_id}, this is {self.instance_id} "
                "(restarted: its KV cache is gone)",
            )

    def _check_not_live(self, sequences: list[pb.KVBlockList]) -> None:
        live = self._live_blocks()
        for s in sequences:
            for b in s.block_ids:
                if b in live:
                    raise TransferError(
                        Refusal.INVALID,
                        f"destination block {b} (for {s.seq_id!r}) holds live sequence "
                        f"{live[b]!r}'s KV",
                    )


def _paused_after_first(chunks: Iterator[pb.KVChunk], seconds: float) -> Iterator[pb.KVChunk]:
    """Failpoint ``executor.export_kv=delay:S`` (tests): the first chunk goes out, then the
    stream stands still for S seconds, so that the exporter can be killed while the importer
    holds the header and the first bytes of a stream that never ends."""
    yield next(chunks)
    log.info("kv.export_paused", seconds=seconds)
    time.sleep(seconds)
    yield from chunks
