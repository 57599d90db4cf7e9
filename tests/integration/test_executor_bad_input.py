"""Bad ExecuteModel input: INVALID_ARGUMENT naming the field, and the step rejected whole.

Each case starts the same scenario (three sequences, one still prefilling in chunks), builds the
valid next step, sends a broken copy of it, then the valid step, and finishes generation. The
tokens must equal an undisturbed run's: the rejected step changed nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from protos import executor_pb2 as pb
from tests.support.executor_driver import ExecutorDriver, executor_channel, running_executor
from tests.support.model_factory import make_tiny_checkpoint

NUM_DEVICE_BLOCKS = 64
VOCAB = 512
MAX_NEW = 5
PROMPTS = {"a": [11, 12, 13, 14, 15], "b": [40, 41], "c": [100 + i for i in range(11)]}


@pytest.fixture(scope="module")
def executor(tmp_path_factory: pytest.TempPathFactory):
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")
    kwargs = dict(device="cpu", block_size=4, num_device_blocks=NUM_DEVICE_BLOCKS)
    with (
        running_executor(model_dir, swap_space_gib=0.0002, attention_backend="torch", **kwargs) as (
            srv,
            port,
        ),
        executor_channel(port) as stub,
    ):
        yield srv, stub


def start_scenario(stub) -> ExecutorDriver:
    """a and b decoding, c prefilling 3 tokens a step (its 3rd chunk needs a new block)."""
    stub.Reset(pb.ResetRequest())
    d = ExecutorDriver(stub)
    d.add("a", PROMPTS["a"], pb.SamplingParams(num_logprobs=2))
    d.add("b", PROMPTS["b"])
    d.add("c", PROMPTS["c"], chunk_size=3)
    d.step()
    d.step()
    return d


def finish_run(d: ExecutorDriver) -> dict[str, list[int]]:
    while any(len(s.outputs) < MAX_NEW for s in d.seqs.values()):
        d.step()
    return {k: s.token_ids for k, s in d.seqs.items()}


@pytest.fixture(scope="module")
def reference(executor) -> dict[str, list[int]]:
    _, stub = executor
    return finish_run(start_scenario(stub))


def new_seq(d: ExecutorDriver, **overrides) -> pb.NewSequence:
    """A valid new sequence on blocks the driver has not handed out."""
    fields = dict(
        seq_id="d",
        token_ids=[5, 6, 7, 8, 9, 10],
        num_prompt_tokens=6,
        block_table=sorted(d.free_device)[-2:],
        num_computed_tokens=0,
        num_scheduled_tokens=6,
    )
    fields.update(overrides)
    return pb.NewSequence(**fields)


def cached(req: pb.ExecuteModelRequest, seq_id: str) -> tuple[int, pb.CachedSequence]:
    for i, c in enumerate(req.cached_sequences):
        if c.seq_id == seq_id:
            return i, c
    raise KeyError(seq_id)


def drop_cached(req: pb.ExecuteModelRequest, seq_id: str) -> None:
    """Take a running sequence out of the step, from cached_sequences or the decode lane."""
    if seq_id in req.decode_seq_ids:
        i = list(req.decode_seq_ids).index(seq_id)
        del req.decode_seq_ids[i]
        del req.decode_num_computed_tokens[i]
        return
    i, _ = cached(req, seq_id)
    del req.cached_sequences[i]


def to_lane(req: pb.ExecuteModelRequest, seq_id: str) -> int:
    """Move a cached sequence into the decode lane as is; returns its lane index."""
    _, c = cached(req, seq_id)
    nc = c.num_computed_tokens
    drop_cached(req, seq_id)
    req.decode_seq_ids.append(seq_id)
    req.decode_num_computed_tokens.append(nc)
    return len(req.decode_seq_ids) - 1


def _lane_is_b(req: pb.ExecuteModelRequest) -> None:
    # The scenario's plain decode goes in the lane; a (logprobs) and c (prefill) do not.
    assert list(req.decode_seq_ids) == ["b"], req.decode_seq_ids


def bad_params(**params) -> Callable[[pb.ExecuteModelRequest, ExecutorDriver], str]:
    name = next(iter(params))

    def mutate(req: pb.ExecuteModelRequest, d: ExecutorDriver) -> str:
        req.new_sequences.append(new_seq(d, sampling_params=pb.SamplingParams(**params)))
        return f"new_sequences[0].sampling_params.{name}"

    return mutate


def _swap_out_bad_dst(req, d):
    n = d.info.num_cpu_blocks
    req.blocks_to_swap_out.add(src=0, dst=n)
    return f"blocks_to_swap_out[0].dst: block id {n} out of range [0, {n})"


def _swap_in_bad_src(req, d):
    n = d.info.num_cpu_blocks
    req.blocks_to_swap_in.add(src=n + 5, dst=0)
    return f"blocks_to_swap_in[0].src: block id {n + 5} out of range [0, {n})"


def _all_or_nothing(req, d):
    # Valid parts first (drop b, add d), the bad field last: none of it may stick.
    drop_cached(req, "b")
    req.finished_seq_ids.append("b")
    req.new_sequences.append(new_seq(d))
    i, c = cached(req, "c")
    c.num_computed_tokens += 1
    return f"cached_sequences[{i}].num_computed_tokens: {c.num_computed_tokens} does not match"


def _cached_new_block_oob(req, d):
    i, c = cached(req, "a")
    c.new_block_ids.append(9999)
    k = len(c.new_block_ids) - 1
    return f"cached_sequences[{i}].new_block_ids[{k}]: block id 9999 out of range [0, 64)"


def _cached_table_too_short(req, d):
    i, c = cached(req, "c")
    assert len(c.new_block_ids) == 1  # the scenario's third chunk crosses into a new block
    del c.new_block_ids[:]
    return f"cached_sequences[{i}]: block table has 2 blocks, 3 needed for 9 tokens"


def _dup_finished(req, d):
    drop_cached(req, "b")
    req.finished_seq_ids.extend(["b", "b"])
    return "finished_seq_ids[1]: duplicate seq_id 'b'"


def _dup_in_step(req, d):
    req.cached_sequences.append(req.cached_sequences[0])
    k = len(req.cached_sequences) - 1
    return f"cached_sequences[{k}].seq_id: {req.cached_sequences[0].seq_id!r} appears twice"


def _lane_prefill(req, d):
    i = to_lane(req, "c")
    return f"decode_seq_ids[{i}]: 'c' has 5 tokens to compute; the decode lane computes exactly one"


def _lane_top_logprobs(req, d):
    i = to_lane(req, "a")
    return f"decode_seq_ids[{i}]: 'a' asks for 2 top logprobs"


def _lane_also_cached(req, d):
    _, c = cached(req, "a")
    req.decode_seq_ids.append("a")
    req.decode_num_computed_tokens.append(c.num_computed_tokens)
    return "decode_seq_ids[1]: 'a' appears twice in this step"


def _lane_computed_mismatch(req, d):
    _lane_is_b(req)
    req.decode_num_computed_tokens[0] += 1
    return f"decode_num_computed_tokens[0]: {req.decode_num_computed_tokens[0]} does not match"


def _last(*effects: object) -> str:
    """Evaluate the mutations (arguments, in order) and return the last: the expected message."""
    return effects[-1]  # type: ignore[return-value]


def _free(d: ExecutorDriver, k: int) -> int:
    return sorted(d.free_device)[k]


CASES: dict[str, Callable[[pb.ExecuteModelRequest, ExecutorDriver], str]] = {
    "unknown_cached_id": lambda r, d: _last(
        setattr(r.cached_sequences[0], "seq_id", "ghost"),
        "cached_sequences[0].seq_id: unknown seq_id 'ghost'",
    ),
    "unknown_finished_id": lambda r, d: _last(
        r.finished_seq_ids.append("ghost"), "finished_seq_ids[0]: unknown seq_id 'ghost'"
    ),
    "duplicate_finished_id": _dup_finished,
    "cached_and_finished": lambda r, d: _last(
        r.finished_seq_ids.append("a"),
        f"cached_sequences[{cached(r, 'a')[0]}].seq_id: 'a' is also in finished_seq_ids",
    ),
    "duplicate_seq_in_step": _dup_in_step,
    "new_already_live": lambda r, d: _last(
        r.new_sequences.append(new_seq(d, seq_id="b")),
        "new_sequences[0].seq_id: 'b' is already live",
    ),
    "new_empty_seq_id": lambda r, d: _last(
        r.new_sequences.append(new_seq(d, seq_id="")), "new_sequences[0].seq_id: must not be"
    ),
    "cached_new_block_out_of_range": _cached_new_block_oob,
    "new_block_out_of_range": lambda r, d: _last(
        r.new_sequences.append(new_seq(d, block_table=[_free(d, 0), 64])),
        "new_sequences[0].block_table[1]: block id 64 out of range [0, 64)",
    ),
    "new_block_twice": lambda r, d: _last(
        r.new_sequences.append(new_seq(d, block_table=[_free(d, 0)] * 2)),
        "new_sequences[0].block_table: a block id appears twice",
    ),
    "replaced_index_out_of_range": lambda r, d: _last(
        r.cached_sequences[0].replaced_blocks.add(logical_index=50, block_id=_free(d, 0)),
        "cached_sequences[0].replaced_blocks[0].logical_index: 50 out of range",
    ),
    "replaced_block_out_of_range": lambda r, d: _last(
        r.cached_sequences[0].replaced_blocks.add(logical_index=0, block_id=64),
        "cached_sequences[0].replaced_blocks[0].block_id: block id 64 out of range [0, 64)",
    ),
    "swap_out_src_out_of_range": lambda r, d: _last(
        r.blocks_to_swap_out.add(src=64, dst=0),
        "blocks_to_swap_out[0].src: block id 64 out of range [0, 64)",
    ),
    "swap_out_dst_out_of_range": _swap_out_bad_dst,
    "swap_in_src_out_of_range": _swap_in_bad_src,
    "swap_in_dst_out_of_range": lambda r, d: _last(
        r.blocks_to_swap_in.add(src=0, dst=70),
        "blocks_to_swap_in[0].dst: block id 70 out of range [0, 64)",
    ),
    "copy_dst_out_of_range": lambda r, d: _last(
        r.blocks_to_copy.add(src=0, dst=64),
        "blocks_to_copy[0].dst: block id 64 out of range [0, 64)",
    ),
    "swap_out_dst_twice": lambda r, d: _last(
        r.blocks_to_swap_out.extend([pb.BlockMapping(src=0, dst=3), pb.BlockMapping(src=1, dst=3)]),
        "blocks_to_swap_out[1].dst: block 3 is written twice",
    ),
    "copy_dst_twice": lambda r, d: _last(
        r.blocks_to_copy.extend(
            [pb.BlockMapping(src=0, dst=_free(d, 0)), pb.BlockMapping(src=1, dst=_free(d, 0))]
        ),
        f"blocks_to_copy[1].dst: block {_free(d, 0)} is written twice",
    ),
    "copy_dst_also_swapped_in": lambda r, d: _last(
        r.blocks_to_swap_in.add(src=0, dst=_free(d, 0)),
        r.blocks_to_copy.add(src=0, dst=_free(d, 0)),
        f"blocks_to_copy[0].dst: block {_free(d, 0)} is also a blocks_to_swap_in destination",
    ),
    "copy_chain": lambda r, d: _last(
        r.blocks_to_copy.extend(
            [
                pb.BlockMapping(src=0, dst=_free(d, 0)),
                pb.BlockMapping(src=_free(d, 0), dst=_free(d, 1)),
            ]
        ),
        f"blocks_to_copy[1].src: block {_free(d, 0)} is also a blocks_to_copy destination",
    ),
    "copy_onto_itself": lambda r, d: _last(
        r.blocks_to_copy.add(src=0, dst=0), "blocks_to_copy[0]: src and dst are both 0"
    ),
    "new_token_out_of_vocab": lambda r, d: _last(
        r.new_sequences.append(new_seq(d, token_ids=[5, 6, VOCAB, 8, 9, 10])),
        "new_sequences[0].token_ids[2]: token id 512 out of range [0, 512)",
    ),
    "cached_token_out_of_vocab": lambda r, d: _last(
        r.cached_sequences[0].new_token_ids.append(600),
        "cached_sequences[0].new_token_ids[0]: token id 600 out of range [0, 512)",
    ),
    "new_longer_than_max_model_len": lambda r, d: _last(
        r.new_sequences.append(new_seq(d, token_ids=[7] * 513, num_prompt_tokens=513)),
        "new_sequences[0].token_ids: sequence of 513 tokens exceeds max_model_len 512",
    ),
    "cached_longer_than_max_model_len": lambda r, d: _last(
        r.cached_sequences[0].new_token_ids.extend([7] * 510),
        "cached_sequences[0].new_token_ids: sequence of",
    ),
    "num_computed_mismatch": _all_or_nothing,
    "num_scheduled_zero": lambda r, d: _last(
        setattr(r.cached_sequences[0], "num_scheduled_tokens", 0),
        "cached_sequences[0].num_scheduled_tokens: must be >= 1",
    ),
    "num_scheduled_beyond_known": lambda r, d: _last(
        setattr(r.cached_sequences[0], "num_scheduled_tokens", 2),
        "cached_sequences[0].num_scheduled_tokens:",
    ),
    "new_nothing_left_to_compute": lambda r, d: _last(
        r.new_sequences.append(new_seq(d, num_computed_tokens=6, num_scheduled_tokens=1)),
        "new_sequences[0].num_computed_tokens: 6 must be below the 6 known tokens",
    ),
    "new_block_table_too_short": lambda r, d: _last(
        r.new_sequences.append(new_seq(d, block_table=[_free(d, 0)])),
        "new_sequences[0]: block table has 1 blocks, 2 needed for 6 tokens",
    ),
    "cached_block_table_too_short": _cached_table_too_short,
    "num_prompt_tokens_zero": lambda r, d: _last(
        r.new_sequences.append(new_seq(d, num_prompt_tokens=0)),
        "new_sequences[0].num_prompt_tokens: 0 not in [1, 6]",
    ),
    "lane_length_mismatch": lambda r, d: _last(
        _lane_is_b(r),
        r.decode_num_computed_tokens.append(3),
        "decode_num_computed_tokens: 2 entries for 1 decode_seq_ids",
    ),
    "lane_unknown_id": lambda r, d: _last(
        _lane_is_b(r),
        r.decode_seq_ids.__setitem__(0, "ghost"),
        "decode_seq_ids[0]: unknown seq_id 'ghost'",
    ),
    "lane_and_finished": lambda r, d: _last(
        _lane_is_b(r),
        r.finished_seq_ids.append("b"),
        "decode_seq_ids[0]: 'b' is also in finished_seq_ids",
    ),
    "lane_also_cached": _lane_also_cached,
    "lane_computed_mismatch": _lane_computed_mismatch,
    "lane_prefill": _lane_prefill,
    "lane_top_logprobs": _lane_top_logprobs,
    "too_many_logprobs": bad_params(num_logprobs=21),
    "negative_temperature": bad_params(temperature=-1.0),
    "nan_temperature": bad_params(temperature=float("nan")),
    "top_p_above_one": bad_params(top_p=1.5),
    "top_k_below_minus_one": bad_params(top_k=-2),
    "min_p_above_one": bad_params(min_p=1.5),
    "presence_penalty_too_big": bad_params(presence_penalty=2.5),
    "frequency_penalty_too_small": bad_params(frequency_penalty=-3.0),
    "negative_repetition_penalty": bad_params(repetition_penalty=-0.5),
    "logit_bias_out_of_vocab": bad_params(logit_bias={VOCAB: 1.0}),
    "logit_bias_not_finite": bad_params(logit_bias={3: float("nan")}),
    "min_tokens_suppressed_out_of_vocab": bad_params(
        min_tokens_suppressed_ids=[VOCAB + 1], min_tokens=2
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_step_rejected_whole(executor, reference, case: str) -> None:
    _, stub = executor
    d = start_scenario(stub)
    req, num_scheduled = d.build_request()
    bad = pb.ExecuteModelRequest()
    bad.CopyFrom(req)
    expected = CASES[case](bad, d)
    with pytest.raises(grpc.RpcError) as err:
        stub.ExecuteModel(bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in err.value.details()
    assert "Traceback" not in err.value.details()
    d.commit(stub.ExecuteModel(req), num_scheduled)
    assert finish_run(d) == reference


def test_finished_and_new_in_one_step_is_allowed(executor, reference) -> None:
    # Preemption by recompute: drop b and send it again in full within the same step.
    _, stub = executor
    d = start_scenario(stub)
    b = d.finish("b")
    d.add("b", b.token_ids).outputs = list(b.outputs)
    req, num_scheduled = d.build_request()
    assert list(req.finished_seq_ids) == ["b"] and req.new_sequences[0].seq_id == "b"
    d.commit(stub.ExecuteModel(req), num_scheduled)
    assert finish_run(d) == reference


def test_failed_forward_rolls_back(executor, reference, monkeypatch) -> None:
    srv, stub = executor
    runner = srv.servicer.runner
    d = start_scenario(stub)
    req, num_scheduled = d.build_request()
    req.finished_seq_ids.append("b")
    drop_cached(req, "b")  # a drop that must be undone too

    def broken(*args, **kwargs):
        raise RuntimeError("simulated device failure")

    for step in ("execute", "launch"):  # a step run through, or an overlapped one
        monkeypatch.setattr(runner, step, broken)
    with pytest.raises(grpc.RpcError) as err:
        stub.ExecuteModel(req)
    monkeypatch.undo()
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "rolled back" in err.value.details()
    assert "simulated" not in err.value.details() and "Traceback" not in err.value.details()
    req, num_scheduled = d.build_request()
    d.commit(stub.ExecuteModel(req), num_scheduled)
    assert finish_run(d) == reference
