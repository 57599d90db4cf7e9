"""Prompt logprobs and prompt-only requests on the scheduler's hooks.

The request's prompt logprobs themselves are its handle's state (engine/streams.py, stored with
it); here: taking them from a reply, and ending a prompt-only request (max_tokens 0) with the
step that completed its prompt.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from scheduler_svc.core.request import RequestStatus, Sequence, req_id_of
from scheduler_svc.features.base import Feature, StepReply

__all__ = ["PromptLogprobs"]


class PromptLogprobs(Feature):
    name = "prompt_logprobs"

    def admit(self, handle: Any) -> None:
        if not handle.params.max_tokens:
            handle.take = take_prompt_only

    def on_reply(self, requests: Mapping[str, Any], reply: StepReply) -> None:
        # Before the tokens: the step that completes a prompt's logprobs also samples its first
        # token, and both must reach Redis in the same write.
        msgs = reply.resp.prompt_logprobs
        if not msgs:  # most steps (a length check; iterating an empty one costs 3x as much)
            return
        for msg in msgs:
            handle = requests.get(req_id_of(msg.seq_id))
            if handle is not None and not handle.finished_in_engine:
                handle.add_prompt_logprobs(msg, reply.record)


def take_prompt_only(handle: Any, seq: Sequence, reply: StepReply) -> RequestStatus:
    """The executor sampled nothing for a prompt-only request: it ends with the step that
    completed its prompt, its prompt logprobs (on_reply) in hand."""
    handle.finish_seq(seq.index, RequestStatus.FINISHED_LENGTH, None, reply.record)
    return RequestStatus.FINISHED_LENGTH
