"""Embed under API keys, as Generate: no or a wrong key is UNAUTHENTICATED (gRPC) or 401
(HTTP); each tenant's key works."""

from __future__ import annotations

import grpc
import pytest

from client import LLMClient, LLMServeError
from tests.integration.test_auth import KEY, OTHER_KEY, secured  # noqa: F401 - the fixture


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_embed_without_a_valid_key_is_refused(secured, key, monkeypatch):  # noqa: F811
    stack, fe = secured
    monkeypatch.delenv("LLMSERVE_API_KEY", raising=False)
    with LLMClient(stack.address, timeout=10, api_key=key) as client:
        with pytest.raises(LLMServeError) as e:
            client.embed([1, 2, 3])
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    headers = {"authorization": f"Bearer {key}"} if key else {}
    status, body = fe.request("POST", "/v1/embeddings", {"input": [1, 2, 3]}, headers)
    assert status == 401 and "error" in body


def test_embed_with_a_key_works(secured):  # noqa: F811
    stack, fe = secured
    for key in (KEY, OTHER_KEY):
        with LLMClient(stack.address, timeout=30, api_key=key) as client:
            (out,) = client.embed("hello")
            assert out.num_prompt_tokens > 0 and len(out.embedding) == 64
        auth = {"authorization": f"Bearer {key}"}
        status, body = fe.request("POST", "/v1/embeddings", {"input": ["a", "b"]}, auth)
        assert status == 200 and len(body["data"]) == 2, body
