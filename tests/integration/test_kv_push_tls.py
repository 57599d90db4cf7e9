"""PushKV between two executors that serve mutual TLS (issue 47): A dials B with its own
certificate as the client's and checks B's against its --tls-ca, under the name the scheduler
gives it; an executor whose certificate B's CA did not sign pushes nothing. Certificates come
from a throwaway CA (trustme); both executors run in this process on the tiny model."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc
import pytest
import torch
import trustme

from executor_svc.kv_transfer.client import block_lists
from protos import executor_pb2 as pb
from protos import executor_pb2_grpc as pb_grpc
from tests.support.executor_driver import running_executor
from tests.support.model_factory import make_tiny_checkpoint

KWARGS = dict(device="cpu", dtype="float32", block_size=4, num_device_blocks=16)


def _tls(ca: trustme.CA, *names: str) -> tuple[bytes, bytes, bytes]:
    """(certificate chain, key, CA) PEM as an executor serves them."""
    cert = ca.issue_cert(*names)
    return cert.cert_chain_pems[0].bytes(), cert.private_key_pem.bytes(), ca.cert_pem.bytes()


@contextlib.contextmanager
def _stub(port: int, tls: tuple[bytes, bytes, bytes]) -> Iterator[pb_grpc.ExecutorStub]:
    """A scheduler's channel: its client certificate, the name `executor` checked."""
    cert, key, ca = tls
    credentials = grpc.ssl_channel_credentials(ca, key, cert)
    options = [("grpc.ssl_target_name_override", "executor")]
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=options) as channel:
        yield pb_grpc.ExecutorStub(channel)


def _push(a: pb_grpc.ExecutorStub, b_port: int, server_name: str) -> pb.ImportKVResponse:
    request = pb.PushKVRequest(
        export=pb.ExportKVRequest(sequences=block_lists({"x": [1, 2]})),
        dst_address=f"127.0.0.1:{b_port}",
        dst_sequences=block_lists({"x": [5, 6]}),
        dst_tls_server_name=server_name,
    )
    return a.PushKV(request, timeout=30)


@pytest.mark.parametrize("signed_by", ["the same CA", "another CA"])
def test_a_push_between_mutual_tls_executors(tmp_path, signed_by: str):
    ca = trustme.CA()
    a_ca = ca if signed_by == "the same CA" else trustme.CA()
    scheduler = _tls(ca, "scheduler")
    a_tls = _tls(a_ca, "executor")  # its name only: executors are dialed by address here
    a_tls = (*a_tls[:2], ca.cert_pem.bytes())  # A trusts B's CA either way
    model = make_tiny_checkpoint(tmp_path / "m", "llama")
    with (
        running_executor(model, tls=a_tls, **KWARGS) as (srv_a, port_a),
        running_executor(model, tls=_tls(ca, "executor"), **KWARGS) as (srv_b, port_b),
        _stub(port_a, (*scheduler[:2], a_ca.cert_pem.bytes())) as a,
    ):
        assert a.Describe(pb.DescribeRequest()).kv_push
        srv_a.servicer.runner.kv_cache.key.normal_()
        if signed_by == "another CA":  # B does not know A's certificate: nothing written
            with pytest.raises(grpc.RpcError) as err:
                _push(a, port_b, "executor")
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert f"push to 127.0.0.1:{port_b}" in err.value.details()
            assert not srv_b.servicer.runner.kv_cache.key[:, [5, 6]].any()
            return
        # Without the name B's certificate holds (it has no IP in it), A refuses B.
        with pytest.raises(grpc.RpcError) as err:
            _push(a, port_b, "")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert _push(a, port_b, "executor").num_blocks == 2
        key_a, key_b = srv_a.servicer.runner.kv_cache.key, srv_b.servicer.runner.kv_cache.key
        assert torch.equal(key_b[:, [5, 6]], key_a[:, [1, 2]])
