"""Protobuf <-> internal dataclasses for the scheduler; no other module builds messages."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from protos import executor_pb2 as epb
from protos import scheduler_pb2 as pb
from scheduler_svc.sampling_params import SamplingParams, ValidationError

if TYPE_CHECKING:
    from scheduler_svc.engine import GenerateInput
    from scheduler_svc.handles import EngineEvent, RequestHandle, RequestView

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
    from scheduler_svc.engine import GenerateInput

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


def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    return dataclasses.asdict(params)


def params_from_dict(d: dict[str, Any]) -> SamplingParams:
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    return SamplingParams(**{k: v for k, v in d.items() if k in known})


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


# ------------------------------------------------------------------ executor step


def executor_params(params: SamplingParams, seed: int | None) -> epb.SamplingParams:
    msg = epb.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k if params.top_k > 0 else 0,
        top_p=params.top_p,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        num_logprobs=params.logprobs or 0,
    )
    if seed is not None:
        msg.seed = seed
    return msg


def execute_request(out: Any, step_id: int) -> epb.ExecuteModelRequest:
    """The step message: new sequences in full, running ones as differences."""
    msg = epb.ExecuteModelRequest(
        step_id=step_id,
        finished_seq_ids=out.finished_seq_ids,
        decode_seq_ids=out.decode_seq_ids,
        decode_num_computed_tokens=out.decode_num_computed_tokens,
    )
    for s in out.new_seqs:
        msg.new_sequences.append(
            epb.NewSequence(
                seq_id=s.seq_id,
                token_ids=s.token_ids,
                num_prompt_tokens=s.num_prompt_tokens,
                sampling_params=executor_params(s.sampling_params, s.seed),
                block_table=s.block_table,
                num_computed_tokens=s.num_computed_tokens,
                num_scheduled_tokens=s.num_scheduled_tokens,
            )
        )
    # add(...) builds each entry in place; constructing a message and appending it copies it.
    # Unset fields are left out of the call: an empty list argument costs a conversion.
    add_cached = msg.cached_sequences.add
    for c in out.cached_seqs:
        if c.new_block_ids or c.replaced_blocks:
            cached = add_cached(
                seq_id=c.seq_id,
                new_block_ids=c.new_block_ids,
                num_scheduled_tokens=c.num_scheduled_tokens,
                num_computed_tokens=c.num_computed_tokens,
            )
            for logical_index, block_id in c.replaced_blocks:
                cached.replaced_blocks.add(logical_index=logical_index, block_id=block_id)
        else:
            add_cached(
                seq_id=c.seq_id,
                num_scheduled_tokens=c.num_scheduled_tokens,
                num_computed_tokens=c.num_computed_tokens,
            )
    for src, dst in out.blocks_to_swap_out:
        msg.blocks_to_swap_out.add(src=src, dst=dst)
    for src, dst in out.blocks_to_swap_in:
        msg.blocks_to_swap_in.add(src=src, dst=dst)
    for src, dst in out.blocks_to_copy:
        msg.blocks_to_copy.add(src=src, dst=dst)
    return msg
