"""What the engine knows of the model it serves: the tokenizer and the limits every request is
checked against, learned from the first executor at start-up."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from protos import executor_pb2 as epb
from scheduler_svc import failpoints
from scheduler_svc.engine.fleet.executor_handle import ExecutorHandle
from scheduler_svc.output.detokenizer import token_byte_table
from scheduler_svc.output.tokenizer import load_tokenizer

__all__ = ["ModelInfo"]


@dataclass(slots=True)
class ModelInfo:
    """Filled in place during start-up (before the engine serves), then read only."""

    tokenizer: Any = None
    eos_token_ids: list[int] = field(default_factory=list)
    vocab_size: int = 0
    block_size: int = 0
    max_model_len: int = 0

    async def load_tokenizer(self, ex: ExecutorHandle) -> None:
        """The executor's tokenizer files, loaded off the loop."""
        reply = await ex.stub.GetTokenizer(epb.GetTokenizerRequest())
        files = {f.name: f.content for f in reply.files}
        self.tokenizer = await asyncio.to_thread(load_tokenizer, files, reply.tokenizer_class)
        # Built here, off the loop, rather than by the first request's detokenizer.
        await asyncio.to_thread(token_byte_table, self.tokenizer)
        if failpoints.ARMED:  # tests widen the window before the limits are known
            await asyncio.sleep(failpoints.delay("engine.start"))

    def set_limits(self, d: epb.DescribeResponse, max_model_len: int | None) -> None:
        """From the first executor's Describe; `max_model_len` caps what it reports."""
        self.eos_token_ids = list(d.eos_token_ids)
        self.vocab_size = d.vocab_size
        self.block_size = d.block_size
        self.max_model_len = min(d.max_model_len, max_model_len or d.max_model_len)
