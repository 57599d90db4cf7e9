"""Moving blocks from one executor to another: ExportKV on the source piped into ImportKV on
the destination, with the header's blocks and instance rewritten for the destination.

The chunks flow through the caller one at a time (gRPC's flow control on both streams bounds
what is buffered). Tests and benchmarks call it; an executor pushing its blocks to another
(``push.py``, PushKV) uses ``retarget``.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from protos import executor_pb2 as pb
from protos import executor_pb2_grpc as pb_grpc


def block_lists(blocks: dict[str, list[int]]) -> list[pb.KVBlockList]:
    return [pb.KVBlockList(seq_id=k, block_ids=v) for k, v in blocks.items()]


def move_kv(
    src: pb_grpc.ExecutorStub,
    dst: pb_grpc.ExecutorStub,
    src_blocks: dict[str, list[int]],
    dst_blocks: dict[str, list[int]],
    *,
    transport: int = pb.KV_TRANSPORT_GRPC,
    chunk_bytes: int = 0,
    src_instance_id: str = "",
    dst_instance_id: str = "",
    timeout: float | None = None,
) -> pb.ImportKVResponse:
    """Copy ``src_blocks`` (seq_id -> device blocks of ``src``) into ``dst_blocks`` (the same
    seq_ids, as many blocks each) of ``dst``. gRPC errors propagate (grpc.RpcError)."""
    if {k: len(v) for k, v in src_blocks.items()} != {k: len(v) for k, v in dst_blocks.items()}:
        raise ValueError("src_blocks and dst_blocks must name the same sequences, as many blocks")
    request = pb.ExportKVRequest(
        sequences=block_lists(src_blocks),
        transport=transport,
        chunk_bytes=chunk_bytes,
        instance_id=src_instance_id,
    )
    chunks = src.ExportKV(request, timeout=timeout)
    export_failed: list[grpc.RpcError] = []

    def relayed() -> Iterator[pb.KVChunk]:
        try:
            yield from retarget(chunks, block_lists(dst_blocks), dst_instance_id)
        except grpc.RpcError as e:  # the import is cancelled, nothing written there
            export_failed.append(e)
            raise

    try:
        return dst.ImportKV(relayed(), timeout=timeout)
    except grpc.RpcError:
        # The export's own status (e.g. a bad source block), not gRPC's "Exception iterating
        # requests!" on the import it cut short.
        if export_failed:
            raise export_failed[0] from None
        raise


def retarget(
    chunks: Iterator[pb.KVChunk], dst: list[pb.KVBlockList], dst_instance_id: str
) -> Iterator[pb.KVChunk]:
    """An export's chunks with the header naming the destination's blocks and instance."""
    for chunk in chunks:
        if chunk.HasField("header"):
            del chunk.header.sequences[:]
            chunk.header.sequences.extend(dst)
            chunk.header.instance_id = dst_instance_id
        yield chunk
