"""Embeddings on the scheduler's hooks: the Embed RPC's requests (embeds.py) get each step's
pooled vectors (apply reply)."""

from __future__ import annotations

from typing import Any

from protos import executor_pb2 as epb
from scheduler_svc.features.base import Feature
from scheduler_svc.features.pooling.embeds import EmbedRequests

__all__ = ["Pooling"]


class Pooling(Feature):
    name = "pooling"

    def __init__(self, embeds: EmbedRequests) -> None:
        self.embeds = embeds  # Embed calls in flight

    def after_reply(self, ex: Any, resp: epb.ExecuteModelResponse) -> None:
        if resp.pooled:  # embedding inputs whose prompt completed
            self.embeds.on_pooled(ex, list(resp.pooled))
