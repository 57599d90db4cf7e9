"""Which failed streams the frontend resumes (frontend_svc/generation.py)."""

import grpc
import pytest

from client.errors import LLMServeError
from frontend_svc.generation import retryable


@pytest.mark.parametrize(
    ("code", "message", "expected"),
    [
        (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses", True),
        # The scheduler killed mid-stream: grpc reports the cut connection in its own words.
        (grpc.StatusCode.UNKNOWN, "Stream removed", True),
        (grpc.StatusCode.UNKNOWN, "recvmsg:Connection reset by peer (104)", True),
        (grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2", True),
        # The server's own answers are final.
        (grpc.StatusCode.UNKNOWN, "Exception calling application: boom", False),
        (grpc.StatusCode.INVALID_ARGUMENT, "params.max_tokens must be >= 1", False),
        (grpc.StatusCode.NOT_FOUND, "unknown request id", False),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", False),
    ],
)
def test_only_outages_and_cut_connections_are_resumed(code, message, expected):
    assert retryable(LLMServeError(code, message)) is expected


def test_mid_stream_unary_calls_retry_an_outage_and_not_an_answer():
    import asyncio

    from frontend_svc.generation import retrying

    calls = []

    async def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise LLMServeError(grpc.StatusCode.UNKNOWN, "Stream removed")
        return "ok"

    assert asyncio.run(retrying(flaky, timeout_s=5)) == "ok" and len(calls) == 3

    async def refused():
        calls.append(1)
        raise LLMServeError(grpc.StatusCode.INVALID_ARGUMENT, "bad token id")

    calls.clear()
    with pytest.raises(LLMServeError):
        asyncio.run(retrying(refused, timeout_s=5))
    assert len(calls) == 1
