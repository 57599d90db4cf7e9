"""Embeddings on the scheduler's hooks: the Embed RPC (public RPC: each input a prompt-only
pooled request, embeds.py; converted at the edge by proto.py; nothing is stored), each new
embedding input's pooling parameters into the step message, the Embed requests get each step's
pooled vectors (apply reply), and GetServerInfo lists the task "embed" (server info)."""

from __future__ import annotations

from typing import Any

from protos import executor_pb2 as epb
from protos import scheduler_pb2 as pb
from scheduler_svc import tracing
from scheduler_svc.core.scheduler_output import SchedulerOutput
from scheduler_svc.features.base import Feature, RpcCall
from scheduler_svc.features.pooling.embeds import EmbedRequests
from scheduler_svc.features.pooling.proto import embed_input_from_proto, embed_result_to_proto

__all__ = ["Pooling", "add_pooling", "with_pooling"]


class Pooling(Feature):
    name = "pooling"
    rpcs = ("Embed",)

    def __init__(self, embeds: EmbedRequests) -> None:
        self.embeds = embeds  # Embed calls in flight

    def step_message(self, msg: epb.ExecuteModelRequest, out: SchedulerOutput) -> None:
        add_pooling(msg, out)

    def server_info(self, info: Any) -> None:
        # Every model llmserve loads is a decoder LLM: its last hidden states pool into
        # embeddings (as vLLM's pooling runner does for decoder checkpoints).
        info.tasks.append("embed")

    async def serve(self, method: str, request: pb.EmbedRequest, call: RpcCall) -> Any:
        inp = embed_input_from_proto(request, call.owner)
        span = tracing.rpc_span("llmserve.embed", call.metadata,
                                **{"llmserve.num_inputs": len(request.inputs)})  # fmt: skip
        try:
            return embed_result_to_proto(await self.embeds.embed(inp))
        finally:
            tracing.end(span)

    def after_reply(self, ex: Any, resp: epb.ExecuteModelResponse) -> None:
        if resp.pooled:  # embedding inputs whose prompt completed
            self.embeds.on_pooled(ex, list(resp.pooled))


def add_pooling(msg: epb.ExecuteModelRequest, out: SchedulerOutput) -> None:
    """An embedding input's pooling (``params.py``) onto its NewSequence's sampling params;
    the message has one new sequence per ``out.new_seqs``, in order. Only new sequences carry
    it (a step without any costs one test)."""
    if not out.new_seqs:
        return
    for new, s in zip(msg.new_sequences, out.new_seqs, strict=True):
        with_pooling(new.sampling_params, s.sampling_params)


def with_pooling(msg: epb.SamplingParams, params: Any) -> epb.SamplingParams:
    """``msg``, the executor's form of ``params`` (step_message.executor_params), with the
    pooling of an embedding input's parameters (``EmbedSamplingParams``) when it has one."""
    pooling = getattr(params, "pooling", None)
    if pooling is not None:
        p = msg.pooling
        p.type, p.normalize, p.dimensions = pooling.type, pooling.normalize, pooling.dimensions
    return msg
