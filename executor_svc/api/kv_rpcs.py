"""The servicer's KV transfer RPCs (issue 47): ExportKV, ImportKV and PushKV, on the endpoint
(``kv_transfer.endpoint``) and the channels to other executors (``kv_transfer.push``) that the
servicer makes at the first transfer."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

from executor_svc.api.compute import Runner
from executor_svc.api.rpc_errors import Refused, rpc
from executor_svc.api.seq_state import SeqState
from executor_svc.kv_transfer.endpoint import KVEndpoint
from executor_svc.kv_transfer.payload import Refusal, TransferError
from executor_svc.kv_transfer.push import TLS, Peers, push
from executor_svc.runner.model_runner import ModelRunner
from protos import executor_pb2 as pb

_NO_DEADLINE = 1e7  # seconds: more is gRPC's "no deadline"


class KVTransferRpcs:
    """Mixed into ExecutorServicer, whose step lock, sequences, instance id and epoch it uses."""

    # Set by the servicer.
    kv: KVEndpoint | None  # made at the first transfer
    peers: Peers  # channels to other executors (PushKV), dialed with this executor's TLS
    instance_id: str
    last_step_time: float
    _lock: threading.Lock
    compute: Runner
    _seqs: dict[str, SeqState]

    @property
    def runner(self) -> ModelRunner:  # the servicer's
        raise NotImplementedError

    def _check_epoch(self, epoch: int) -> None:  # the servicer's
        raise NotImplementedError

    def init_kv_transfer(self, peer_tls: TLS | None = None) -> None:
        """``peer_tls``: this executor's TLS (certificate chain, key, CA), dialing peers."""
        self.kv = None
        self.peers = Peers(peer_tls)

    @rpc
    def ExportKV(self, request: pb.ExportKVRequest, context: grpc.ServicerContext) -> Any:
        # A scheduler moving sequences off a draining executor steps it no more meanwhile: the
        # export counts as its activity, so the drain does not give up on it (server.drain).
        self.last_step_time = time.monotonic()
        self._check_epoch(request.leader_epoch)
        # The blocks are copied before the stream starts: errors come out as a status here.
        return self._kv_endpoint().export(request)

    @rpc
    def ImportKV(self, request_iterator: Any, context: grpc.ServicerContext) -> Any:
        stream = _until_cut(request_iterator)
        first = next(stream, None)
        if first is not None:  # a deposed leader never writes into its successor's cache
            self._check_epoch(first.header.leader_epoch)
        chunks = itertools.chain([first] if first is not None else [], stream)
        return self._kv_endpoint().import_(chunks)

    @rpc
    def PushKV(self, request: pb.PushKVRequest, context: grpc.ServicerContext) -> Any:
        self.last_step_time = time.monotonic()  # as ExportKV
        self._check_epoch(request.export.leader_epoch)
        endpoint = self._kv_endpoint()
        # The caller's deadline bounds the import; without one gRPC reports ~infinity, which
        # as a client timeout would overflow into an immediate DEADLINE_EXCEEDED.
        remaining = context.time_remaining()
        timeout = remaining if remaining is not None and remaining < _NO_DEADLINE else None
        try:
            return push(endpoint, self.peers, request, timeout)
        except grpc.RpcError as e:  # the destination's status, its message naming it
            code: grpc.StatusCode = e.code()  # type: ignore[attr-defined]
            details = e.details()  # type: ignore[attr-defined]
            raise Refused(code, f"push to {request.dst_address}: {details}") from None

    def close_kv_transfer(self) -> None:
        """Shared memory segments no importer took, channels to peers (server shutdown)."""
        if self.kv is not None:
            self.kv.close()
        self.peers.close()

    def _kv_endpoint(self) -> KVEndpoint:
        runner = self.runner
        if runner.tp is not None and runner.tp.world_size > 1:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                "KV transfer is not supported with tensor parallelism yet",
            )
        if self.kv is None:
            self.kv = KVEndpoint(
                runner.kv_cache, self._lock, self._live_blocks, self.instance_id, run=self.compute
            )
        return self.kv

    def _live_blocks(self) -> dict[int, str]:
        return {b: s.seq_id for s in self._seqs.values() for b in s.block_table}


def _until_cut(chunks: Iterator[pb.KVChunk]) -> Iterator[pb.KVChunk]:
    """An import's stream, cut short by its sender (a relay or pusher that failed or died: a
    move's fallback path, not a fault here) ending as a refusal (nothing written) instead of
    an internal error with a traceback."""
    try:
        yield from chunks
    except grpc.RpcError:
        raise TransferError(
            Refusal.INVALID, "the stream was cut short by its sender: nothing written"
        ) from None
