"""Checks of one ExecuteModelRequest against the executor's per-sequence state.

`validate_step` looks at the whole request without changing anything and returns the plan the
servicer applies; any problem is an `InvalidStep` whose message names the field (it goes back
to the client as INVALID_ARGUMENT). The decode lane, which carries most of a busy batch, is
checked in one tight loop and only a failing entry pays for the precise message. Each feature
checks its own fields at the validate hooks (features/base.py): a new sequence's sampling
parameters and state, a cached sequence's diff, and the whole step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from executor_svc.api.seq_state import BlockTable, SeqState
from executor_svc.features.base import Feature, Features, InvalidStep, check_len, check_tokens
from executor_svc.runner.model_runner import ModelRunner
from executor_svc.runner.sampler import SamplingParams
from protos import executor_pb2 as pb

__all__ = ["InvalidStep", "StepPlan", "validate_step"]


@dataclass(slots=True)
class StepPlan:
    new_states: list[SeqState]
    # Every sequence run this step (new ones first, then cached, in request order) with its
    # num_scheduled_tokens; the SeqState objects are the live ones once applied.
    scheduled: list[tuple[SeqState, int]]
    states: dict[str, SeqState]
    # The decode lane's sequences, in request order (also the tail of `scheduled`).
    lane: list[SeqState] = field(default_factory=list)
    block_size: int = 0  # what a sequence's blocks are counted in
    # The features this step uses (their check_step said so), in registry order, and their
    # per-step data by feature name.
    active: list[Feature] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Limits:
    """What every sequence of a step is checked against: the model's and the cache's sizes."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_device: int  # device blocks
    num_cpu: int  # CPU swap blocks
    max_blocks: int  # blocks one sequence may hold: enough for max_model_len
    max_logprobs: int
    eos_token_ids: Sequence[int]
    hidden_size: int

    @classmethod
    def of(cls, runner: ModelRunner, max_logprobs: int) -> _Limits:
        info = runner.info
        return cls(
            vocab_size=info.vocab_size,
            max_model_len=info.max_model_len,
            block_size=runner.block_size,
            num_device=runner.num_device_blocks,
            num_cpu=runner.num_cpu_blocks,
            max_blocks=-(-info.max_model_len // runner.block_size),
            max_logprobs=max_logprobs,
            eos_token_ids=info.eos_token_ids,
            hidden_size=getattr(info, "hidden_size", 0),
        )


def validate_step(
    request: pb.ExecuteModelRequest,
    seqs: dict[str, SeqState],
    runner: ModelRunner,
    max_logprobs: int,
) -> StepPlan:
    """Check the whole request against the current state without changing anything."""
    limits = _Limits.of(runner, max_logprobs)
    features: Features = runner.features
    finished = _check_finished(request.finished_seq_ids, seqs)
    _check_mappings(request, limits.num_device, limits.num_cpu)
    in_step: set[str] = set()  # seq_ids met so far in this step
    new_states: list[SeqState] = []
    scheduled: list[tuple[SeqState, int]] = []
    for i, n in enumerate(request.new_sequences):
        state = _new_state(f"new_sequences[{i}]", n, seqs, finished, in_step, limits, features)
        new_states.append(state)
        scheduled.append((state, n.num_scheduled_tokens))
    for i, c in enumerate(request.cached_sequences):
        field = f"cached_sequences[{i}]"
        state = _cached_state(field, c, seqs, finished, in_step, limits, features)
        scheduled.append((state, c.num_scheduled_tokens))
    lane = _validate_decode_lane(request, seqs, in_step, finished, limits.block_size)
    scheduled.extend((s, 1) for s in lane)
    states = {s.seq_id: s for s, _ in scheduled}
    plan = StepPlan(new_states, scheduled, states, lane, limits.block_size)
    plan.active = [f for f in features.check_step if f.check_step(request, plan, limits)]
    return plan


def _check_finished(finished_seq_ids: Sequence[str], seqs: dict[str, SeqState]) -> set[str]:
    finished: set[str] = set()
    for i, seq_id in enumerate(finished_seq_ids):
        field = f"finished_seq_ids[{i}]"
        if seq_id in finished:
            raise InvalidStep(f"{field}: duplicate seq_id {seq_id!r}")
        if seq_id not in seqs:
            raise InvalidStep(f"{field}: unknown seq_id {seq_id!r}")
        finished.add(seq_id)
    return finished


def _new_state(
    field: str,
    n: pb.NewSequence,
    seqs: dict[str, SeqState],
    finished: set[str],
    in_step: set[str],
    limits: _Limits,
    features: Features,
) -> SeqState:
    """The state a new sequence would start with, once every field of it is checked."""
    if not n.seq_id:
        raise InvalidStep(f"{field}.seq_id: must not be empty")
    if n.seq_id in in_step:
        raise InvalidStep(f"{field}.seq_id: {n.seq_id!r} appears twice in this step")
    if n.seq_id in seqs and n.seq_id not in finished:
        raise InvalidStep(f"{field}.seq_id: {n.seq_id!r} is already live")
    in_step.add(n.seq_id)
    token_ids = list(n.token_ids)
    if not token_ids:
        raise InvalidStep(f"{field}.token_ids: must not be empty")
    check_len(f"{field}.token_ids", len(token_ids), limits.max_model_len)
    check_tokens(f"{field}.token_ids", token_ids, limits.vocab_size)
    if not 1 <= n.num_prompt_tokens <= len(token_ids):
        raise InvalidStep(
            f"{field}.num_prompt_tokens: {n.num_prompt_tokens} not in [1, {len(token_ids)}]"
        )
    params = _check_params(f"{field}.sampling_params", n.sampling_params, limits, features)
    _check_new_block_table(f"{field}.block_table", n.block_table, limits)
    _check_schedule(
        field, n.num_computed_tokens, n.num_scheduled_tokens, len(token_ids),
        len(n.block_table), limits.block_size,
    )  # fmt: skip
    state = SeqState(
        seq_id=n.seq_id,
        token_ids=token_ids,
        num_prompt_tokens=n.num_prompt_tokens,
        sampling_params=params,
        block_table=BlockTable(n.block_table),
        num_computed_tokens=n.num_computed_tokens,
    )
    for f in features.check_new:
        f.check_new(field, n, state)
    return state


def _check_new_block_table(field: str, block_table: Sequence[int], limits: _Limits) -> None:
    _check_blocks(field, block_table, limits.num_device)
    if len(set(block_table)) != len(block_table):
        raise InvalidStep(f"{field}: a block id appears twice")
    if len(block_table) > limits.max_blocks:
        raise InvalidStep(
            f"{field}: {len(block_table)} blocks exceed the {limits.max_blocks} "
            f"needed for max_model_len {limits.max_model_len}"
        )


def _cached_state(
    field: str,
    c: pb.CachedSequence,
    seqs: dict[str, SeqState],
    finished: set[str],
    in_step: set[str],
    limits: _Limits,
    features: Features,
) -> SeqState:
    """The live state a cached sequence's diff applies to, once the diff is checked."""
    if c.seq_id in in_step:
        raise InvalidStep(f"{field}.seq_id: {c.seq_id!r} appears twice in this step")
    in_step.add(c.seq_id)
    s = seqs.get(c.seq_id)
    if s is None:
        raise InvalidStep(f"{field}.seq_id: unknown seq_id {c.seq_id!r}")
    if c.seq_id in finished:
        raise InvalidStep(f"{field}.seq_id: {c.seq_id!r} is also in finished_seq_ids")
    if c.num_computed_tokens != s.num_computed_tokens:
        raise InvalidStep(
            f"{field}.num_computed_tokens: {c.num_computed_tokens} does not match the "
            f"executor's {s.num_computed_tokens}"
        )
    _check_replaced(field, c, len(s.block_table), limits.num_device)
    _check_blocks(f"{field}.new_block_ids", c.new_block_ids, limits.num_device)
    num_blocks = len(s.block_table) + len(c.new_block_ids)
    if num_blocks > limits.max_blocks:
        raise InvalidStep(
            f"{field}.new_block_ids: block table of {num_blocks} blocks exceeds the "
            f"{limits.max_blocks} needed for max_model_len {limits.max_model_len}"
        )
    num_tokens = len(s.token_ids) + len(c.new_token_ids)
    check_len(f"{field}.new_token_ids", num_tokens, limits.max_model_len)
    check_tokens(f"{field}.new_token_ids", c.new_token_ids, limits.vocab_size)
    for f in features.check_cached:
        num_tokens = f.check_cached(field, c, s, num_tokens, limits)
    _check_schedule(
        field, s.num_computed_tokens, c.num_scheduled_tokens, num_tokens, num_blocks,
        limits.block_size,
    )  # fmt: skip
    return s


def _check_replaced(field: str, c: pb.CachedSequence, num_blocks: int, num_device: int) -> None:
    seen_idx: set[int] = set()
    for j, r in enumerate(c.replaced_blocks):
        rf = f"{field}.replaced_blocks[{j}]"
        if r.logical_index >= num_blocks:
            raise InvalidStep(
                f"{rf}.logical_index: {r.logical_index} out of range [0, {num_blocks})"
            )
        if r.logical_index in seen_idx:
            raise InvalidStep(f"{rf}.logical_index: {r.logical_index} replaced twice")
        seen_idx.add(r.logical_index)
        _check_block(f"{rf}.block_id", r.block_id, num_device)


def _validate_decode_lane(
    request: pb.ExecuteModelRequest,
    seqs: dict[str, SeqState],
    in_step: set[str],
    finished: set[str],
    block_size: int,
) -> list[SeqState]:
    """The decode lane's sequences, checked in one tight loop (it carries most of a batch)."""
    ids = request.decode_seq_ids
    computed = request.decode_num_computed_tokens
    if len(computed) != len(ids):
        raise InvalidStep(
            f"decode_num_computed_tokens: {len(computed)} entries for {len(ids)} decode_seq_ids"
        )
    lane: list[SeqState] = []
    get = seqs.get
    for seq_id, nc in zip(ids, computed, strict=True):
        s = get(seq_id)
        if (
            s is None
            or seq_id in in_step
            or nc != s.num_computed_tokens
            or nc + 1 != len(s.token_ids)
            or nc // block_size >= len(s.block_table)
            or s.sampling_params.num_logprobs
            or seq_id in finished
        ):
            _lane_error(len(lane), seq_id, nc, s, in_step, finished, block_size)
        in_step.add(seq_id)
        lane.append(s)
    return lane


def _lane_error(
    i: int,
    seq_id: str,
    nc: int,
    s: SeqState | None,
    in_step: set[str],
    finished: set[str],
    block_size: int,
) -> None:
    """Raise the precise InvalidStep for decode lane entry `i` (which failed a check)."""
    field = f"decode_seq_ids[{i}]"
    if s is None:
        raise InvalidStep(f"{field}: unknown seq_id {seq_id!r}")
    if seq_id in in_step:
        raise InvalidStep(f"{field}: {seq_id!r} appears twice in this step")
    if seq_id in finished:
        raise InvalidStep(f"{field}: {seq_id!r} is also in finished_seq_ids")
    if nc != s.num_computed_tokens:
        raise InvalidStep(
            f"decode_num_computed_tokens[{i}]: {nc} does not match the executor's "
            f"{s.num_computed_tokens}"
        )
    if nc + 1 != len(s.token_ids):
        raise InvalidStep(
            f"{field}: {seq_id!r} has {len(s.token_ids) - nc} tokens to compute; the decode "
            "lane computes exactly one (send it in cached_sequences)"
        )
    if nc // block_size >= len(s.block_table):
        raise InvalidStep(
            f"{field}: block table has {len(s.block_table)} blocks, {nc // block_size + 1} "
            f"needed for {nc + 1} tokens at block size {block_size} (new blocks go in "
            "cached_sequences)"
        )
    raise InvalidStep(
        f"{field}: {seq_id!r} asks for {s.sampling_params.num_logprobs} top logprobs, which "
        "the decode lane does not return (send it in cached_sequences)"
    )


def _check_schedule(
    field: str,
    num_computed: int,
    num_scheduled: int,
    num_tokens: int,
    num_blocks: int,
    block_size: int,
) -> None:
    if num_computed >= num_tokens:
        # At least the last known token must be computed to produce logits for it.
        raise InvalidStep(
            f"{field}.num_computed_tokens: {num_computed} must be below the {num_tokens} "
            "known tokens"
        )
    if num_scheduled == 0:
        raise InvalidStep(f"{field}.num_scheduled_tokens: must be >= 1")
    if num_computed + num_scheduled > num_tokens:
        raise InvalidStep(
            f"{field}.num_scheduled_tokens: {num_computed} computed + {num_scheduled} scheduled "
            f"exceeds the {num_tokens} known tokens"
        )
    needed = -(-(num_computed + num_scheduled) // block_size)
    if num_blocks < needed:
        raise InvalidStep(
            f"{field}: block table has {num_blocks} blocks, {needed} needed for "
            f"{num_computed + num_scheduled} tokens at block size {block_size}"
        )


def _check_block(field: str, block_id: int, num_blocks: int) -> None:
    if block_id >= num_blocks:
        raise InvalidStep(f"{field}: block id {block_id} out of range [0, {num_blocks})")


def _check_blocks(field: str, block_ids: Sequence[int], num_blocks: int) -> None:
    for j, b in enumerate(block_ids):
        _check_block(f"{field}[{j}]", b, num_blocks)


def _check_mappings(request: pb.ExecuteModelRequest, num_device: int, num_cpu: int) -> None:
    """Ranges per pool, and no write conflicts between the three ordered cache operations."""
    lists = (
        ("blocks_to_swap_out", request.blocks_to_swap_out, num_device, num_cpu),
        ("blocks_to_swap_in", request.blocks_to_swap_in, num_cpu, num_device),
        ("blocks_to_copy", request.blocks_to_copy, num_device, num_device),
    )
    dsts: dict[str, set[int]] = {}
    for name, mappings, num_src, num_dst in lists:
        seen: set[int] = set()
        for j, m in enumerate(mappings):
            _check_block(f"{name}[{j}].src", m.src, num_src)
            _check_block(f"{name}[{j}].dst", m.dst, num_dst)
            if m.dst in seen:
                raise InvalidStep(f"{name}[{j}].dst: block {m.dst} is written twice")
            seen.add(m.dst)
        dsts[name] = seen
    # Swap-out reads device blocks before swap-in or copy write them, so reusing a freed block
    # in the same step is well defined. Two writers of one device block are not.
    for j, m in enumerate(request.blocks_to_copy):
        if m.dst in dsts["blocks_to_swap_in"]:
            raise InvalidStep(
                f"blocks_to_copy[{j}].dst: block {m.dst} is also a blocks_to_swap_in destination"
            )
        if m.src == m.dst:
            raise InvalidStep(f"blocks_to_copy[{j}]: src and dst are both {m.src}")
        # Copies have no order among themselves: a block both read and written would make the
        # result depend on it.
        if m.src in dsts["blocks_to_copy"]:
            raise InvalidStep(
                f"blocks_to_copy[{j}].src: block {m.src} is also a blocks_to_copy destination"
            )


def _check_params(
    field: str, p: pb.SamplingParams, limits: _Limits, features: Features
) -> SamplingParams:
    max_logprobs, vocab_size = limits.max_logprobs, limits.vocab_size
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        if not math.isfinite(getattr(p, name)):
            raise InvalidStep(f"{field}.{name}: must be a finite number")
    if p.temperature < 0:
        raise InvalidStep(f"{field}.temperature: {p.temperature} must be >= 0")
    if p.top_k < -1:
        raise InvalidStep(f"{field}.top_k: {p.top_k} must be -1, 0 (disabled) or positive")
    if not 0 <= p.top_p <= 1:
        raise InvalidStep(f"{field}.top_p: {p.top_p} not in [0, 1]")
    if not 0 <= p.min_p <= 1:
        raise InvalidStep(f"{field}.min_p: {p.min_p} not in [0, 1]")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(p, name) <= 2:
            raise InvalidStep(f"{field}.{name}: {getattr(p, name)} not in [-2, 2]")
    if not 0 <= p.repetition_penalty <= 2:
        raise InvalidStep(f"{field}.repetition_penalty: {p.repetition_penalty} not in [0, 2]")
    if p.num_logprobs > max_logprobs:
        raise InvalidStep(f"{field}.num_logprobs: {p.num_logprobs} exceeds max {max_logprobs}")
    if p.num_prompt_logprobs > max_logprobs:
        raise InvalidStep(
            f"{field}.num_prompt_logprobs: {p.num_prompt_logprobs} exceeds max {max_logprobs}"
        )
    # Checked even when min_tokens is 0 (then unused): a bad id is a sender bug either way.
    check_tokens(f"{field}.min_tokens_suppressed_ids", p.min_tokens_suppressed_ids, vocab_size)
    if p.logit_bias:
        check_tokens(f"{field}.logit_bias", list(p.logit_bias), vocab_size)
        if not all(math.isfinite(b) for b in p.logit_bias.values()):
            raise InvalidStep(f"{field}.logit_bias: values must be finite numbers")
    for f in features.check_params:
        f.check_params(field, p, limits)
    # The executor's own EOS ids join the mask here, once per sequence, not per step.
    return SamplingParams.from_proto(p, limits.eos_token_ids)
