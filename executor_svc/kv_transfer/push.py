"""Pushing blocks to another executor (``PushKV``): this executor's export streamed over its own
channel into the destination's ``ImportKV``, so the bytes go from one executor to the other
without passing through the scheduler that asked.

The destination authenticates this executor as it authenticates schedulers: with TLS, this
executor dials with its own certificate and key as the client's (mutual TLS: the destination's
``--tls-ca`` must have signed it, as it signs every executor's certificate in one deployment)
and checks the destination's certificate against its own ``--tls-ca`` (the system's roots
without one), under the name the scheduler checks (``PushKVRequest.dst_tls_server_name``).
"""

from __future__ import annotations

import threading

import grpc
import structlog

from executor_svc.kv_transfer.client import retarget
from executor_svc.kv_transfer.endpoint import KVEndpoint
from executor_svc.kv_transfer.payload import Refusal, TransferError
from protos import executor_pb2 as pb
from protos import executor_pb2_grpc as pb_grpc

# (certificate chain, private key, CA or None) PEM, as the executor serves TLS.
TLS = tuple[bytes, bytes, bytes | None]
log = structlog.get_logger(__name__)
_OPTIONS = [("grpc.max_send_message_length", 256 << 20)]


class Peers:
    """Channels to other executors, one per (address, TLS name), kept until ``close()``."""

    def __init__(self, tls: TLS | None = None) -> None:
        self.tls = tls
        self._stubs: dict[tuple[str, str], tuple[grpc.Channel, pb_grpc.ExecutorStub]] = {}
        self._lock = threading.Lock()

    def stub(self, address: str, server_name: str = "") -> pb_grpc.ExecutorStub:
        with self._lock:
            entry = self._stubs.get((address, server_name))
            if entry is None:
                entry = self._dial(address, server_name)
                self._stubs[(address, server_name)] = entry
            return entry[1]

    def _dial(self, address: str, server_name: str) -> tuple[grpc.Channel, pb_grpc.ExecutorStub]:
        options = list(_OPTIONS)
        if self.tls is None:
            channel = grpc.insecure_channel(address, options=options)
        else:
            cert, key, ca = self.tls
            credentials = grpc.ssl_channel_credentials(
                root_certificates=ca, private_key=key, certificate_chain=cert
            )
            if server_name:
                options.append(("grpc.ssl_target_name_override", server_name))
            channel = grpc.secure_channel(address, credentials, options=options)
        return channel, pb_grpc.ExecutorStub(channel)

    def forget(self, address: str, server_name: str = "") -> None:
        """Drop a channel (its peer failed): the next push dials afresh."""
        with self._lock:
            entry = self._stubs.pop((address, server_name), None)
        if entry is not None:
            entry[0].close()

    def close(self) -> None:
        with self._lock:
            entries, self._stubs = list(self._stubs.values()), {}
        for channel, _ in entries:
            channel.close()


def push(
    endpoint: KVEndpoint, peers: Peers, request: pb.PushKVRequest, timeout: float | None
) -> pb.ImportKVResponse:
    """Export ``request.export``'s blocks here and import them into the destination's
    ``dst_sequences``. The export's refusals raise before anything is sent (TransferError); the
    destination's failure raises its grpc.RpcError (the blocks there unchanged or unreferenced)."""
    if len(request.dst_sequences) != len(request.export.sequences) or any(
        len(d.block_ids) != len(s.block_ids)
        for d, s in zip(request.dst_sequences, request.export.sequences, strict=True)
    ):
        raise TransferError(
            Refusal.INVALID, "dst_sequences must have as many blocks per sequence as export's"
        )
    export = pb.ExportKVRequest()
    export.CopyFrom(request.export)
    export.transport = pb.KV_TRANSPORT_GRPC
    chunks = endpoint.export(export)
    stub = peers.stub(request.dst_address, request.dst_tls_server_name)
    relayed = retarget(chunks, list(request.dst_sequences), request.dst_instance_id)
    try:
        reply: pb.ImportKVResponse = stub.ImportKV(relayed, timeout=timeout)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNAVAILABLE:  # type: ignore[attr-defined]
            peers.forget(request.dst_address, request.dst_tls_server_name)
        raise
    log.info("kv.pushed", dst=request.dst_address, num_bytes=reply.num_bytes)
    return reply
