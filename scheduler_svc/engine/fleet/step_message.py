"""The executor's step message (llmserve.executor.v1.ExecuteModelRequest) from a scheduling
step: new sequences in full, running ones as differences, the decode lane packed."""

from __future__ import annotations

from protos import executor_pb2 as epb
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.scheduler_output import SchedulerOutput

__all__ = ["execute_request", "executor_params"]


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
    if params.logit_bias:
        msg.logit_bias.update(params.logit_bias)
    if params.prompt_logprobs is not None:
        msg.num_prompt_logprobs = params.prompt_logprobs
    if not params.max_tokens:
        msg.prompt_only = True
    if params.min_tokens > 0:
        # EOS is masked too, but the executor knows its own EOS ids: only stop ids travel, and
        # only for the (rare) requests that ask for min_tokens.
        msg.min_tokens = params.min_tokens
        if params.stop_token_ids:
            msg.min_tokens_suppressed_ids.extend(params.stop_token_ids)
    return msg


def execute_request(out: SchedulerOutput, step_id: int) -> epb.ExecuteModelRequest:
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
    _add_cached(msg, out)
    for src, dst in out.blocks_to_swap_out:
        msg.blocks_to_swap_out.add(src=src, dst=dst)
    for src, dst in out.blocks_to_swap_in:
        msg.blocks_to_swap_in.add(src=src, dst=dst)
    for src, dst in out.blocks_to_copy:
        msg.blocks_to_copy.add(src=src, dst=dst)
    return msg


def _add_cached(msg: epb.ExecuteModelRequest, out: SchedulerOutput) -> None:
    """Running sequences as differences. add(...) builds each entry in place (constructing a
    message and appending it copies it); unset fields are left out of the call (an empty list
    argument costs a conversion)."""
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
