"""asyncio client of `llmserve.v1.Scheduler` (grpc.aio)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import client.envs as envs
from client.errors import LLMServeError
from client.features import AsyncClientFeatures
from client.outputs import (
    AbortOutcome,
    LoraAdapterInfo,
    RequestOutput,
    RequestState,
    ServerInfo,
    StreamDelta,
)
from client.params import SamplingParams
from client.progress import GenerateProgress
from client.prompts import (
    ChatPrompt,
    broadcast_params,
    build_request,
    normalize_prompts,
    to_prompt,
)
from protos import scheduler_pb2 as pb
from protos import scheduler_pb2_grpc as pb_grpc

SERVICE_NAME = "llmserve.v1.Scheduler"

# GetRequest of a long finished request can exceed gRPC's 4 MiB default.
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]


def channel_target(address: str) -> tuple[str, list[tuple[str, Any]]]:
    """The gRPC target and extra channel options for `address`.

    One `host:port` is used as is. Several, comma-separated (schedulers sharing one Redis with
    --leader-election), become one channel over all of them that sends calls only to those
    whose gRPC health is SERVING, which is the leader alone: standbys answer NOT_SERVING. When
    the leader changes, the channel follows within a health update.
    """
    parts = [a.strip() for a in address.split(",") if a.strip()]
    if len(parts) <= 1:
        return address, []
    ips = []
    for part in parts:
        host, _, port = part.rpartition(":")
        host = host.strip("[]")
        info = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        ip = info[0][4][0]
        ips.append(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
    scheme = "ipv6" if all(ip.startswith("[") for ip in ips) else "ipv4"
    config = {
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": ""},
    }
    options: list[tuple[str, Any]] = [("grpc.service_config", json.dumps(config))]
    first_host = parts[0].rpartition(":")[0].strip("[]")
    if not _is_ip(first_host):  # TLS checks certificates against the name, not the IP
        options.append(("grpc.ssl_target_name_override", first_host))
    return f"{scheme}:{','.join(ips)}", options


def _is_ip(host: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
    except OSError:
        return False
    return True


class _WithKey:
    def __init__(self, key: str) -> None:
        self._entry = ("authorization", f"Bearer {key}")

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(tuple(m) for m in (details.metadata or ())), self._entry)
        return details._replace(metadata=metadata)


# Two objects: grpc.aio files each interceptor under the first call kind it is an instance of.
class _BearerKey(_WithKey, grpc.aio.UnaryUnaryClientInterceptor):
    """Adds the API key to every unary call's metadata."""

    async def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001
        return await continuation(self._details(details), request)


class _BearerKeyStream(_WithKey, grpc.aio.UnaryStreamClientInterceptor):
    """Adds the API key to every server-streaming call's metadata."""

    async def intercept_unary_stream(self, continuation, details, request):  # noqa: ANN001
        return await continuation(self._details(details), request)


class AsyncLLMClient(AsyncClientFeatures):
    """Talks to one scheduler. `timeout` (seconds) bounds unary calls only: a generation may
    legitimately stream for minutes, so streams get `stream_timeout` (None = no deadline).

    The channel is opened lazily inside the running event loop, because grpc.aio binds a
    channel to the loop it was created in.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout: float | None = 30.0,
        stream_timeout: float | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
        api_key: str | None = None,
        tls_ca: str | os.PathLike | None = None,
        interceptors: Sequence[Any] = (),
    ):
        """`api_key` defaults to $LLMSERVE_API_KEY; sent as `authorization: Bearer <key>`.
        `tls_ca` (default $LLMSERVE_TLS_CA): connect over TLS, trusting this CA file (PEM).
        `interceptors`: more grpc.aio client interceptors (the frontend's trace propagation)."""
        env = envs.ClientConfig.from_env()
        tls_ca = tls_ca if tls_ca is not None else env.tls_ca
        self._tls_ca = Path(tls_ca).read_bytes() if tls_ca else None
        self.address = address or env.address
        self.api_key = api_key if api_key is not None else env.api_key
        self.timeout = timeout
        self.stream_timeout = stream_timeout
        self._channel_options = [*_CHANNEL_OPTIONS, *channel_options]
        self._interceptors = list(interceptors)
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.SchedulerStub | None = None

    def _get_stub(self) -> pb_grpc.SchedulerStub:
        if self._stub is None:
            keyed = (
                [_BearerKey(self.api_key), _BearerKeyStream(self.api_key)] if self.api_key else []
            )
            interceptors = [*keyed, *self._interceptors] or None
            target, extra = channel_target(self.address)
            options = [*self._channel_options, *extra]
            if self._tls_ca is None:
                self._channel = grpc.aio.insecure_channel(
                    target, options=options, interceptors=interceptors
                )
            else:
                credentials = grpc.ssl_channel_credentials(root_certificates=self._tls_ca)
                self._channel = grpc.aio.secure_channel(
                    target, credentials, options=options, interceptors=interceptors
                )
            self._stub = pb_grpc.SchedulerStub(self._channel)
        return self._stub

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = None
        self._stub = None

    async def __aenter__(self) -> AsyncLLMClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- unary calls -------------------------------------------------------------------------

    async def _unary(self, method: str, request: Any, request_id: str | None = None) -> Any:
        try:
            return await getattr(self._get_stub(), method)(request, timeout=self.timeout)
        except grpc.RpcError as err:
            raise LLMServeError.from_rpc_error(err, request_id=request_id) from None

    async def abort(self, request_id: str) -> AbortOutcome:
        """ABORTED when the request was still active and is now aborted, FINISHED if it had
        finished, PENDING if no request had this id yet: then a request started with it within
        the server's abort lifetime (60 s by default) ends at once as aborted. Truthy only when
        ABORTED. Either way, once this returns, the request is final and reads (get_request,
        resume) show it."""
        resp = await self._unary("Abort", pb.AbortRequest(request_id=request_id), request_id)
        return AbortOutcome.from_proto(resp)

    async def get_request(self, request_id: str) -> RequestState:
        req = pb.GetRequestRequest(request_id=request_id)
        return RequestState.from_proto(await self._unary("GetRequest", req, request_id))

    async def server_info(self) -> ServerInfo:
        return ServerInfo.from_proto(await self._unary("GetServerInfo", pb.GetServerInfoRequest()))

    async def load_lora_adapter(self, name: str, path: str) -> LoraAdapterInfo:
        """Register a LoRA adapter (a PEFT directory the executors can read) under `name`."""
        req = pb.LoadLoraAdapterRequest(name=name, path=path)
        a = (await self._unary("LoadLoraAdapter", req)).adapter
        return LoraAdapterInfo(a.name, a.path, a.rank)

    async def unload_lora_adapter(self, name: str) -> None:
        await self._unary("UnloadLoraAdapter", pb.UnloadLoraAdapterRequest(name=name))

    async def tokenize(self, prompt: Any) -> tuple[list[int], int]:
        """Token ids of a text or chat prompt as Generate would compute them, and the model's
        maximum length."""
        p = to_prompt(prompt)
        req = pb.TokenizeRequest()
        if isinstance(p, str):
            req.text = p
        elif isinstance(p, ChatPrompt):
            req.chat.CopyFrom(build_request(p, SamplingParams()).chat)
        else:
            return list(p), (await self.server_info()).max_model_len
        resp = await self._unary("Tokenize", req)
        return list(resp.token_ids), resp.max_model_len

    async def detokenize(
        self, token_ids: Sequence[int], *, skip_special_tokens: bool = True
    ) -> tuple[str, list[str]]:
        """The text of `token_ids`, and each token decoded on its own."""
        req = pb.DetokenizeRequest(
            token_ids=list(token_ids), skip_special_tokens=skip_special_tokens
        )
        resp = await self._unary("Detokenize", req)
        return resp.text, list(resp.token_texts)

    async def wait_ready(self, timeout: float = 30.0, *, poll_interval: float = 0.2) -> None:
        """Block until the scheduler's health service says SERVING (it does once an executor is
        connected); raise LLMServeError(DEADLINE_EXCEEDED) after `timeout` seconds."""
        self._get_stub()
        assert self._channel is not None
        health = health_pb2_grpc.HealthStub(self._channel)
        deadline = time.monotonic() + timeout
        last = "no answer"
        service = SERVICE_NAME
        while time.monotonic() < deadline:
            try:
                resp = await health.Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=poll_interval * 5
                )
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
            except grpc.RpcError as err:
                last = f"{err.code().name}: {err.details()}"
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    service = ""  # a server that only reports overall health
            await asyncio.sleep(poll_interval)
        raise LLMServeError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"scheduler at {self.address} not ready after {timeout:.0f}s ({last})",
        )

    # ---- streams -----------------------------------------------------------------------------

    async def _iterate(
        self, call: grpc.aio.UnaryStreamCall, request_id: str | None
    ) -> AsyncIterator[StreamDelta]:
        try:
            async for msg in call:
                yield StreamDelta.from_proto(msg)
        except grpc.RpcError as err:
            raise LLMServeError.from_rpc_error(err, request_id=request_id) from None
        finally:
            # Reached when the consumer stops early too: cancelling the call is what tells the
            # server to abort a non-detached request. A no-op once the call has ended.
            call.cancel()

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
    ) -> AsyncIterator[StreamDelta]:
        """Start (or attach to, when `request_id` is active) a request and yield its deltas.

        Leaving the iteration early aborts the request unless `detached` is set.
        `lora_adapter`: the name of a loaded LoRA adapter ("" = the base model).
        `timeout_s`: its deadline, in seconds from arrival: still waiting then, the stream
        raises DEADLINE_EXCEEDED; running, it finishes with finish_reason "deadline".
        """
        req = build_request(
            to_prompt(prompt),
            params or SamplingParams(),
            request_id=request_id,
            priority=priority,
            detached=detached,
            lora_adapter=lora_adapter,
            timeout_s=timeout_s,
        )
        call = self._get_stub().Generate(req, timeout=self.stream_timeout)
        return self._iterate(call, request_id)

    def resume(
        self, request_id: str, from_token_index: int | Sequence[int] = 0
    ) -> AsyncIterator[StreamDelta]:
        """Re-attach to a request: stored tokens from `from_token_index` on, then live ones.

        A list gives one first index per sequence (as many as the request has).
        """
        req = pb.ResumeRequest(request_id=request_id)
        if isinstance(from_token_index, int):
            req.from_token_index = from_token_index
        else:
            req.from_token_indices.extend(from_token_index)
        call = self._get_stub().Resume(req, timeout=self.stream_timeout)
        return self._iterate(call, request_id)

    # ---- batch generation --------------------------------------------------------------------

    async def generate(
        self,
        prompts: Any,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        request_id_prefix: str | None = None,
        priority: int | Sequence[int] = 0,
        lora_adapter: str = "",
    ) -> list[RequestOutput]:
        """Submit every prompt at once (the server batches them continuously) and return one
        finished RequestOutput per prompt, in prompt order.

        Request ids are `f"{request_id_prefix}-{i}"` when a prefix is given, else chosen by the
        server. On any failure the other requests are cancelled (hence aborted) and the first
        error is raised as LLMServeError.
        """
        prompt_list = normalize_prompts(prompts)
        params_list = broadcast_params(params, len(prompt_list))
        priorities = [priority] * len(prompt_list) if isinstance(priority, int) else list(priority)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompt_list)} prompts")
        progress = GenerateProgress(len(prompt_list), enabled=use_tqdm)

        async def one(i: int) -> RequestOutput:
            request_id = f"{request_id_prefix}-{i}" if request_id_prefix else None
            out = RequestOutput.start(request_id or "", prompt_list[i], params_list[i].n)
            stream = self.stream(
                prompt_list[i],
                params_list[i],
                request_id=request_id,
                priority=priorities[i],
                lora_adapter=lora_adapter,
            )
            async for delta in stream:
                out.add(delta)
            progress.update(out.num_prompt_tokens, out.num_output_tokens)
            return out

        tasks = [asyncio.ensure_future(one(i)) for i in range(len(prompt_list))]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            progress.close()
