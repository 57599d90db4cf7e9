"""How a KV payload's bytes get from the exporting executor to the importing one.

The control path is always the gRPC stream of ``KVChunk`` messages (its first chunk carries the
``KVHeader``: layout, checksum, blocks); a transport decides where the bytes go:

* ``stage(num_bytes)`` (exporter): the host buffer ``gather`` writes the blocks into, and the
  header fields that name it;
* ``send(header, staged)`` (exporter): the chunks to stream;
* ``receive(first, rest)`` (importer): the payload's bytes, as a host tensor, and what to
  release once they are written into the cache.

``GrpcTransport`` puts the bytes in the chunks (any two hosts; gRPC's stream flow control paces
the sender); ``shm.ShmTransport`` writes them into a shared memory file whose name the one chunk
carries (one host). An RDMA transport (NIXL, UCX, libfabric) fits the same three calls:
``stage`` returns a buffer registered with the NIC (or the device cache itself: a GPU's memory
registered once, no staging at all), ``send`` one chunk whose header carries the memory
descriptors and the agent's connection metadata, ``receive`` posts RDMA READs of those
descriptors into a local registered buffer and waits for them, ``release`` tells the exporter
(a notification) that its buffer is free. See docs/internals.md, "KV transfer".
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from executor_svc.kv_transfer.payload import Refusal, TransferError, as_bytes
from protos import executor_pb2 as pb

DEFAULT_CHUNK_BYTES = 2 << 20  # under a client channel's default 4 MiB receive limit
MAX_CHUNK_BYTES = 64 << 20


@dataclass(slots=True)
class Staged:
    """An exporter's buffer for one payload and the header fields that name it."""

    data: torch.Tensor  # [num_bytes] uint8, contiguous, on the host
    fields: dict[str, str | bool] = field(default_factory=dict)  # e.g. shm_name, shm_reuse


@dataclass(slots=True)
class Received:
    """An importer's view of a payload's bytes, valid until ``release()``."""

    data: torch.Tensor  # [num_bytes] uint8, contiguous, on the host
    release: Callable[[], None] = lambda: None


class Transport(ABC):
    """One way of moving a payload's bytes; instances are long-lived, one per kind."""

    kind: int  # pb.KVTransport value

    @abstractmethod
    def stage(self, num_bytes: int) -> Staged: ...

    @abstractmethod
    def send(
        self, header: pb.KVHeader, staged: Staged, chunk_bytes: int
    ) -> Iterator[pb.KVChunk]: ...

    @abstractmethod
    def receive(self, first: pb.KVChunk, rest: Iterator[pb.KVChunk]) -> Received: ...

    def close(self) -> None:  # noqa: B027 -- optional: most transports hold nothing
        """Free what the transport still holds (server shutdown)."""


class GrpcTransport(Transport):
    """The bytes in the stream's chunks, ``chunk_bytes`` each."""

    kind = pb.KV_TRANSPORT_GRPC

    def stage(self, num_bytes: int) -> Staged:
        return Staged(torch.empty(num_bytes, dtype=torch.uint8))

    def send(self, header: pb.KVHeader, staged: Staged, chunk_bytes: int) -> Iterator[pb.KVChunk]:
        view = as_bytes(staged.data)
        n = len(view)
        # The first chunk holds the header and the first bytes; bytes() is the one copy into
        # the message (protobuf owns its bytes).
        yield pb.KVChunk(header=header, offset=0, data=bytes(view[:chunk_bytes]))
        for offset in range(chunk_bytes, n, chunk_bytes):
            yield pb.KVChunk(offset=offset, data=bytes(view[offset : offset + chunk_bytes]))

    def receive(self, first: pb.KVChunk, rest: Iterator[pb.KVChunk]) -> Received:
        num_bytes = first.header.num_bytes
        data = torch.empty(num_bytes, dtype=torch.uint8)
        view = as_bytes(data)
        filled = 0
        for chunk in _chain(first, rest):
            if chunk.offset != filled:
                raise TransferError(
                    Refusal.INVALID,
                    f"chunk at offset {chunk.offset}, expected {filled}: chunks come in order",
                )
            end = filled + len(chunk.data)
            if end > num_bytes:
                raise TransferError(
                    Refusal.INVALID, f"chunks hold more than the header's {num_bytes} bytes"
                )
            view[filled:end] = chunk.data
            filled = end
        if filled != num_bytes:
            raise TransferError(
                Refusal.INVALID, f"the stream ended after {filled} of {num_bytes} bytes"
            )
        return Received(data)


def _chain(first: pb.KVChunk, rest: Iterator[pb.KVChunk]) -> Iterator[pb.KVChunk]:
    yield first
    yield from rest
