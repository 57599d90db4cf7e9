"""Blocking client: the asyncio client driven on a private event loop in a background thread.

One implementation serves both APIs, and `generate` keeps thousands of streams in flight on
one channel without a thread per request.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

from client.async_client import AsyncLLMClient
from client.features import ClientFeatures
from client.outputs import (
    AbortOutcome,
    LoraAdapterInfo,
    RequestOutput,
    RequestState,
    ServerInfo,
    StreamDelta,
)
from client.params import SamplingParams

T = TypeVar("T")


class LLMClient(ClientFeatures):
    """Synchronous client of one scheduler; see AsyncLLMClient for the semantics of each call."""

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout: float | None = 30.0,
        stream_timeout: float | None = None,
        api_key: str | None = None,
        tls_ca: str | os.PathLike | None = None,
    ):
        self._async = AsyncLLMClient(
            address,
            timeout=timeout,
            stream_timeout=stream_timeout,
            api_key=api_key,
            tls_ca=tls_ca,
        )
        self.address = self._async.address
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="llmserve-client", daemon=True
        )
        self._thread.start()
        self._closed = False

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise RuntimeError("LLMClient is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            # Ctrl-C in the caller's thread: cancel the work on the loop so that its streams are
            # cancelled and the server aborts the requests instead of finishing them for nobody.
            future.cancel()
            raise

    def close(self) -> None:
        if self._closed:
            return
        self._run(self._async.close())
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> LLMClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # best effort for clients never closed
        if not getattr(self, "_closed", True) and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)

    def generate(
        self,
        prompts: Any,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        request_id_prefix: str | None = None,
        priority: int | Sequence[int] = 0,
        lora_adapter: str = "",
    ) -> list[RequestOutput]:
        return self._run(
            self._async.generate(
                prompts,
                params,
                use_tqdm=use_tqdm,
                request_id_prefix=request_id_prefix,
                priority=priority,
                lora_adapter=lora_adapter,
            )
        )

    def load_lora_adapter(self, name: str, path: str) -> LoraAdapterInfo:
        return self._run(self._async.load_lora_adapter(name, path))

    def unload_lora_adapter(self, name: str) -> None:
        self._run(self._async.unload_lora_adapter(name))

    def _iterate(self, agen: AsyncIterator[StreamDelta]) -> Iterator[StreamDelta]:
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            # Runs when the caller breaks out early: closing the async generator cancels the
            # call (and so aborts a non-detached request).
            if not self._closed:
                self._run(agen.aclose())  # type: ignore[attr-defined]

    def stream(
        self,
        prompt: Any,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        detached: bool = False,
        priority: int = 0,
        lora_adapter: str = "",
        timeout_s: float | None = None,
    ) -> Iterator[StreamDelta]:
        async def start() -> AsyncIterator[StreamDelta]:
            # The gRPC call must be created on the client's loop.
            return self._async.stream(
                prompt,
                params,
                request_id=request_id,
                detached=detached,
                priority=priority,
                lora_adapter=lora_adapter,
                timeout_s=timeout_s,
            )

        return self._iterate(self._run(start()))

    def resume(self, request_id: str, from_token_index: int = 0) -> Iterator[StreamDelta]:
        async def start() -> AsyncIterator[StreamDelta]:
            return self._async.resume(request_id, from_token_index)

        return self._iterate(self._run(start()))

    def abort(self, request_id: str) -> AbortOutcome:
        return self._run(self._async.abort(request_id))

    def get_request(self, request_id: str) -> RequestState:
        return self._run(self._async.get_request(request_id))

    def server_info(self) -> ServerInfo:
        return self._run(self._async.server_info())

    def wait_ready(self, timeout: float = 30.0) -> None:
        self._run(self._async.wait_ready(timeout))
