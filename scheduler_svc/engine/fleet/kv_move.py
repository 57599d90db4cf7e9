"""Moving device blocks from one executor to another (issue 47): ExportKV on the source piped
into ImportKV on the destination, the header's blocks and instance rewritten for the
destination (the asyncio twin of `executor_svc/kv_transfer/client.move_kv`, which this service
may not import).

Three routes (`transport_between`). "shm": the scheduler relays the stream, which holds only
the header; the bytes go from the exporter's shared memory segment straight into the importer's
cache (both executors on one host). "grpc": every chunk passes through the scheduler, paced by
both streams' flow control. "push" (`push_kv`): the scheduler asks the source to push the
blocks itself (PushKV): it streams them over its own channel into the destination's ImportKV,
and the scheduler only waits for the answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import structlog

from protos import executor_pb2 as epb
from scheduler_svc import failpoints
from scheduler_svc.engine.fleet.executor_handle import ExecutorHandle

log = structlog.get_logger(__name__)

__all__ = ["LOOPBACK_HOSTS", "ROUTES", "move_kv", "push_kv", "transport_between"]

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")


def _host(address: str) -> str:
    return address.rpartition(":")[0]


# The relayed routes' transports (the bytes in the stream, or in a shared memory segment).
ROUTES = {"grpc": epb.KV_TRANSPORT_GRPC, "shm": epb.KV_TRANSPORT_SHM}


def transport_between(src: ExecutorHandle, dst: ExecutorHandle, choice: str = "auto") -> str:
    """The route of a move: `choice` ("grpc", "shm" or "push") as it is, or for "auto": shared
    memory when both executors are on this scheduler's host (loopback addresses), else a push
    from source to destination when both take PushKV (`DescribeResponse.kv_push`; the
    destination only imports, but an older build may also refuse what a newer one sends), else
    the gRPC stream relayed through the scheduler."""
    if choice != "auto":
        return choice
    if _host(src.address) in LOOPBACK_HOSTS and _host(dst.address) in LOOPBACK_HOSTS:
        return "shm"
    return "push" if src.describe.kv_push and dst.describe.kv_push else "grpc"


def _block_lists(blocks: dict[str, list[int]]) -> list[epb.KVBlockList]:
    return [epb.KVBlockList(seq_id=k, block_ids=v) for k, v in blocks.items()]


def _export_request(
    src: ExecutorHandle, blocks: dict[str, list[int]], transport: int, epoch: int, chunk_bytes: int
) -> epb.ExportKVRequest:
    """ExportKV of `blocks` on `src` (checked to be the instance planned for, under `epoch`)."""
    return epb.ExportKVRequest(
        sequences=_block_lists(blocks),
        transport=transport,
        instance_id=src.describe.instance_id,
        leader_epoch=epoch,
        chunk_bytes=chunk_bytes,
    )


async def move_kv(
    src: ExecutorHandle,
    dst: ExecutorHandle,
    src_blocks: dict[str, list[int]],
    dst_blocks: dict[str, list[int]],
    *,
    transport: int,
    timeout_s: float,
    epoch: int = 0,
    chunk_bytes: int = 0,
) -> epb.ImportKVResponse:
    """Copy `src_blocks` (seq_id -> device blocks of `src`) into `dst_blocks` (as many each)
    of `dst`, each executor checked to be the instance the scheduler planned for. Raises
    grpc.aio.AioRpcError when either end fails or refuses; the destination's blocks are then
    unchanged or unreferenced (the caller frees them). `epoch`: this scheduler's leadership
    epoch, which both ends check as they check a step's. `chunk_bytes`: payload bytes per
    gRPC chunk (0: the exporter's default)."""
    request = _export_request(src, src_blocks, transport, epoch, chunk_bytes)
    chunks = src.stub.ExportKV(request, timeout=timeout_s)
    export_failed: list[grpc.aio.AioRpcError] = []
    header_to = _block_lists(dst_blocks)
    relayed = _retargeted(chunks, header_to, dst.describe.instance_id, export_failed)
    try:
        return await dst.stub.ImportKV(relayed, timeout=timeout_s)
    except (grpc.aio.AioRpcError, asyncio.CancelledError):
        # The export's own status, not the import's cancellation it caused.
        if export_failed:
            raise export_failed[0] from None
        raise
    finally:
        chunks.cancel()  # a no-op once the export ended; stops it when the import failed


async def push_kv(
    src: ExecutorHandle,
    dst: ExecutorHandle,
    src_blocks: dict[str, list[int]],
    dst_blocks: dict[str, list[int]],
    *,
    timeout_s: float,
    epoch: int = 0,
    chunk_bytes: int = 0,
    tls_server_name: str = "",
) -> epb.ImportKVResponse:
    """As `move_kv`, the bytes going straight from `src` to `dst` (PushKV on `src`, which dials
    `dst.address` with its own TLS identity, checking `tls_server_name` when given, as this
    scheduler does). Raises grpc.aio.AioRpcError when either end fails or refuses."""
    request = epb.PushKVRequest(
        export=_export_request(src, src_blocks, epb.KV_TRANSPORT_GRPC, epoch, chunk_bytes),
        dst_address=dst.address,
        dst_sequences=_block_lists(dst_blocks),
        dst_instance_id=dst.describe.instance_id,
        dst_tls_server_name=tls_server_name,
    )
    return await src.stub.PushKV(request, timeout=timeout_s)


async def _retargeted(
    chunks: AsyncIterator[epb.KVChunk],
    header_to: list[epb.KVBlockList],
    instance_id: str,
    export_failed: list[grpc.aio.AioRpcError],
) -> AsyncIterator[epb.KVChunk]:
    """The export's chunks with the header naming the destination's blocks and instance; an
    export that fails is noted in `export_failed` (the import is cut short, nothing written)."""
    try:
        async for chunk in chunks:
            if chunk.HasField("header"):
                del chunk.header.sequences[:]
                chunk.header.sequences.extend(header_to)
                chunk.header.instance_id = instance_id
                yield chunk
                if failpoints.ARMED:  # tests: a window to kill an end in, mid-stream
                    await _pause_mid_stream()
                continue
            yield chunk
    except grpc.aio.AioRpcError as e:
        export_failed.append(e)
        raise


async def _pause_mid_stream() -> None:
    """Failpoint `engine.kv_move=delay:S`: hold the relay for S seconds after the first chunk
    (the importer holds the header and the first bytes; the exporter may still be sending)."""
    seconds = failpoints.delay("engine.kv_move")
    if seconds:
        log.info("kv_move.paused_mid_stream", seconds=seconds)
        await asyncio.sleep(seconds)
