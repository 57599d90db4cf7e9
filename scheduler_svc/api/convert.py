"""Public API protobuf <-> the engine's records; no other module builds public messages.

(The executor's step message is built on the engine's side, in engine/step_message.py.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from protos import scheduler_pb2 as pb
from scheduler_svc.core.sampling_params import SamplingParams, ValidationError
from scheduler_svc.engine.config import GenerateInput

if TYPE_CHECKING:
    from scheduler_svc.engine.streams import EngineEvent, RequestHandle, RequestView

_FINISH = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}
_STATUS = {
    "waiting": pb.REQUEST_STATUS_WAITING,
    "running": pb.REQUEST_STATUS_RUNNING,
    "swapped": pb.REQUEST_STATUS_SWAPPED,
    "finished": pb.REQUEST_STATUS_FINISHED,
}
_MAX_U32 = 2**32 - 1
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


# ------------------------------------------------------------------ public API, inbound


def params_from_proto(p: pb.SamplingParams) -> SamplingParams:
    out = SamplingParams()
    for name in ("n", "max_tokens", "temperature", "top_p", "top_k", "repetition_penalty"):
        if p.HasField(name):
            setattr(out, name, getattr(p, name))
    out.min_tokens = p.min_tokens
    out.min_p = p.min_p
    out.presence_penalty = p.presence_penalty
    out.frequency_penalty = p.frequency_penalty
    out.seed = p.seed if p.HasField("seed") else None
    out.stop = list(p.stop)
    out.stop_token_ids = list(p.stop_token_ids)
    out.include_stop_str_in_output = p.include_stop_str_in_output
    out.ignore_eos = p.ignore_eos
    out.logprobs = p.logprobs if p.HasField("logprobs") else None
    if p.HasField("skip_special_tokens"):
        out.skip_special_tokens = p.skip_special_tokens
    return out


def generate_input_from_proto(r: pb.GenerateRequest) -> GenerateInput:
    params = params_from_proto(r.params)
    kind = r.WhichOneof("prompt")
    if kind is None:
        raise ValidationError("prompt must be set (text, token_ids or chat)")
    inp = GenerateInput(req_id=r.request_id, params=params, priority=r.priority)
    if kind == "text":
        inp.text = r.text
    elif kind == "token_ids":
        inp.token_ids = list(r.token_ids.ids)
    else:
        for i, m in enumerate(r.chat.messages):
            if m.role not in CHAT_ROLES:
                raise ValidationError(
                    f"prompt.chat.messages[{i}].role must be one of "
                    f"{', '.join(sorted(CHAT_ROLES))}, got {m.role[:32]!r}"
                )
        inp.chat = [{"role": m.role, "content": m.content} for m in r.chat.messages]
        if r.chat.HasField("add_generation_prompt"):
            inp.add_generation_prompt = r.chat.add_generation_prompt
    return inp


# ------------------------------------------------------------------ public API, outbound


def event_to_proto(handle: RequestHandle, e: EngineEvent) -> pb.GenerateResponse:
    # One per streamed delta: fields that keep their default on most deltas are set only when
    # they carry something (each keyword costs a conversion).
    msg = pb.GenerateResponse(
        request_id=handle.req_id,
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
        for lp in e.logprobs:
            entry = msg.logprobs.add(token_id=lp["token_id"], logprob=lp["logprob"])
            for tok, logprob, text in lp["top"]:
                entry.top.add(token_id=tok, logprob=logprob, text=text)
    return msg


def request_view_to_proto(v: RequestView) -> pb.GetRequestResponse:
    msg = pb.GetRequestResponse(
        request_id=v.req_id,
        status=_STATUS[v.status],
        prompt_token_ids=v.prompt_token_ids,
        arrival_time=v.arrival_time,
        error=v.error,
        priority=v.priority,
    )
    for i, (tokens, text, finish, stop) in enumerate(v.sequences):
        msg.sequences.add(
            index=i,
            token_ids=tokens,
            text=text,
            finish_reason=_FINISH[finish],
            stop_reason="" if stop is None else str(stop),
        )
    return msg


def server_info_to_proto(info: dict[str, Any]) -> pb.GetServerInfoResponse:
    from scheduler_svc import __version__

    executors = [pb.ExecutorInfo(**e) for e in info["executors"]]
    fields = {k: v for k, v in info.items() if k != "executors"}
    return pb.GetServerInfoResponse(executors=executors, version=__version__, **fields)
