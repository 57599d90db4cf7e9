"""Public API protobuf <-> the engine's records; no other module builds public messages.

(The executor's step message is built on the engine's side, in engine/fleet/step_message.py.)
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

from protos import scheduler_pb2 as pb
from scheduler_svc.core.request import FinishReason, RequestStatus
from scheduler_svc.core.sampling_params import SamplingParams, ValidationError
from scheduler_svc.engine.config import GenerateInput, ServerInfo, public_id
from scheduler_svc.features.deadlines.timeouts import check_timeout
from scheduler_svc.output.tokenizer import Conversation

if TYPE_CHECKING:
    from scheduler_svc.engine.streams import EngineEvent, RequestHandle, RequestView

# The single map from the engine's vocabulary (core/request.py) to the public proto's.
_FINISH = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
    FinishReason.DEADLINE: pb.FINISH_REASON_DEADLINE,
}
_STATUS = {
    RequestStatus.WAITING: pb.REQUEST_STATUS_WAITING,
    RequestStatus.RUNNING: pb.REQUEST_STATUS_RUNNING,
    RequestStatus.SWAPPED: pb.REQUEST_STATUS_SWAPPED,
    **{s: pb.REQUEST_STATUS_FINISHED for s in RequestStatus if RequestStatus.is_finished(s)},
}
_MAX_U32 = 2**32 - 1
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


# ------------------------------------------------------------------ public API, inbound


def params_from_proto(p: pb.SamplingParams) -> SamplingParams:
    """The shared model's conversion (protos/sampling.py): unset optionals take vLLM's
    defaults; a constraint set with no kind is ValidationError."""
    return SamplingParams.from_proto(p)


def generate_input_from_proto(r: pb.GenerateRequest) -> GenerateInput:
    params = params_from_proto(r.params)
    kind = r.WhichOneof("prompt")
    if kind is None:
        raise ValidationError("prompt must be set (text, token_ids or chat)")
    inp = GenerateInput(req_id=r.request_id, params=params, priority=r.priority)
    if r.HasField("timeout_s"):
        inp.timeouts = (check_timeout(r.timeout_s),)
    if kind == "text":
        inp.text = r.text
    elif kind == "token_ids":
        inp.token_ids = list(r.token_ids.ids)
    elif kind == "infill":
        inp.infill = (r.infill.prefix, r.infill.suffix)
    else:
        inp.chat = chat_from_proto(r.chat)
        if r.chat.HasField("add_generation_prompt"):
            inp.add_generation_prompt = r.chat.add_generation_prompt
    return inp


def chat_from_proto(chat: pb.ChatPrompt) -> Conversation:
    """A chat prompt as the chat template is handed it: messages as dicts (with their tool
    calls, tool call id and name where set) and the tools."""
    messages = []
    for i, m in enumerate(chat.messages):
        if m.role not in CHAT_ROLES:
            raise ValidationError(
                f"prompt.chat.messages[{i}].role must be one of "
                f"{', '.join(sorted(CHAT_ROLES))}, got {m.role[:32]!r}"
            )
        msg: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls_json:
            calls = _json_list(m.tool_calls_json, f"prompt.chat.messages[{i}].tool_calls_json")
            msg["tool_calls"] = calls
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.name:
            msg["name"] = m.name
        messages.append(msg)
    tools = _json_list(chat.tools_json, "prompt.chat.tools_json") if chat.tools_json else None
    return Conversation(messages, tools=tools)


def _json_list(text: str, field: str) -> list[dict[str, Any]]:
    """A JSON list of objects (tools, tool calls), or INVALID_ARGUMENT naming `field`."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValidationError(f"{field} is not valid JSON: {e}") from None
    if not isinstance(value, list) or not all(isinstance(x, dict) for x in value):
        raise ValidationError(f"{field} must be a JSON list of objects")
    return value


def tokenize_input_from_proto(r: pb.TokenizeRequest) -> GenerateInput:
    """A Tokenize request as the prompt part of a GenerateInput (default parameters)."""
    kind = r.WhichOneof("prompt")
    if kind is None:
        raise ValidationError("prompt must be set (text or chat)")
    gen = pb.GenerateRequest()
    if kind == "text":
        gen.text = r.text
    else:
        gen.chat.CopyFrom(r.chat)
    return generate_input_from_proto(gen)


# ------------------------------------------------------------------ public API, outbound


def event_to_proto(handle: RequestHandle, e: EngineEvent) -> pb.GenerateResponse:
    # One per streamed delta: fields that keep their default on most deltas are set only when
    # they carry something (each keyword costs a conversion).
    msg = pb.GenerateResponse(
        request_id=public_id(handle.req_id),
        index=e.index,
        text=e.text,
        token_ids=e.token_ids,
        token_offset=e.token_offset,
        num_prompt_tokens=len(handle.prompt_token_ids),
    )
    if e.finish_reason is not None:
        msg.finish_reason = _FINISH[e.finish_reason]
        if e.stop_reason is not None:
            msg.stop_reason = str(e.stop_reason)
        if e.error:
            msg.error = e.error
    if e.logprobs:
        _add_logprobs(msg.logprobs, e.logprobs)
    if e.prompt_logprobs:
        _add_logprobs(msg.prompt_logprobs, e.prompt_logprobs)
    return msg


def _add_logprobs(field: Any, entries: list[dict[str, Any]]) -> None:
    for lp in entries:
        entry = field.add(token_id=lp["token_id"], logprob=lp["logprob"])
        for tok, logprob, text in lp["top"]:
            entry.top.add(token_id=tok, logprob=logprob, text=text)


def request_view_to_proto(v: RequestView) -> pb.GetRequestResponse:
    msg = pb.GetRequestResponse(
        request_id=public_id(v.req_id),
        status=_STATUS[v.status],
        prompt_token_ids=v.prompt_token_ids,
        arrival_time=v.arrival_time,
        error=v.error,
        priority=v.priority,
    )
    for i, seq in enumerate(v.sequences):
        msg.sequences.add(
            index=i,
            token_ids=seq.token_ids,
            text=seq.text,
            finish_reason=_FINISH[seq.finish_reason],
            stop_reason="" if seq.stop_reason is None else str(seq.stop_reason),
        )
    return msg


def server_info_to_proto(info: ServerInfo) -> pb.GetServerInfoResponse:
    from scheduler_svc import __version__

    fields = {f.name: getattr(info, f.name) for f in dataclasses.fields(info)}
    fields["executors"] = [pb.ExecutorInfo(**dataclasses.asdict(e)) for e in info.executors]
    fields.update(fields.pop("features"))  # the features' own, under the proto's names
    return pb.GetServerInfoResponse(version=__version__, **fields)
