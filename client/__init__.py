"""Python client of llmserve: `LLMClient` (blocking) and `AsyncLLMClient` (asyncio) over gRPC.

The client talks to the scheduler's public API (`protos/scheduler.proto`) only; it never imports
the services.
"""

from client.async_client import AsyncLLMClient
from client.envs import DEFAULT_ADDRESS
from client.envs import address as default_address
from client.errors import LLMServeError
from client.features import EmbeddingOutput
from client.offline import LLM
from client.outputs import (
    AbortOutcome,
    CompletionOutput,
    ExecutorInfo,
    Logprob,
    RequestMetrics,
    RequestOutput,
    RequestState,
    ServerInfo,
    StreamDelta,
)
from client.params import SamplingParams
from client.prompts import ChatPrompt, InfillPrompt
from client.sync_client import LLMClient

__all__ = [
    "AbortOutcome",
    "DEFAULT_ADDRESS",
    "AsyncLLMClient",
    "ChatPrompt",
    "InfillPrompt",
    "CompletionOutput",
    "EmbeddingOutput",
    "ExecutorInfo",
    "LLM",
    "LLMClient",
    "LLMServeError",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "RequestState",
    "SamplingParams",
    "ServerInfo",
    "StreamDelta",
    "default_address",
]
