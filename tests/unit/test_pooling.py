"""Embedding pooling: the math (executor_svc/features/pooling/pooling.py), its invariance to how a prompt's rows
were split into steps, the executor's checks, and what the scheduler core does differently for
a pooled request (features/pooling/params.py, the step message)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from client.embeddings import as_inputs, build_embed_request
from executor_svc.api.validation import InvalidStep, validate_step
from executor_svc.features.pooling.pooling import (
    LAST,
    MEAN,
    PoolingState,
    check_pooling,
    pool_step,
    pool_vector,
    pooled_to_proto,
    vector_from_bytes,
)
from executor_svc.runner.model_runner import ModelRunner, ScheduledSequence
from executor_svc.runner.sampler import SamplingParams as ExecutorParams
from protos import executor_pb2 as epb
from protos import scheduler_pb2 as pb
from scheduler_svc.core.request import Request
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.scheduler_output import SchedulerOutput
from scheduler_svc.engine.fleet.step_message import executor_params
from scheduler_svc.features.pooling.feature import with_pooling
from scheduler_svc.features.pooling.params import (
    PoolingParams,
    PoolingType,
    embed_request,
    swappable,
)
from tests.support.model_factory import make_tiny_checkpoint

HIDDEN = 8


def rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


def pooled_seq(seq_id: str, n: int, start: int, count: int, kind: int, **kw) -> ScheduledSequence:
    # The pooling is the sequence's entry in its state's features (features/pooling check_new).
    state = kw.pop("state", None) or PoolingState(kind, **kw)
    return ScheduledSequence(
        seq_id, list(range(n)), n, [0], start, count, ExecutorParams(prompt_only=True),
        features={"pooling": state},
    )  # fmt: skip


# ------------------------------------------------------------------------ the math


def test_last_is_the_last_row_and_mean_the_average():
    x = rows(5)
    assert torch.equal(pool_vector(x, LAST, normalize=False), x[-1])
    mean = pool_vector(x, MEAN, normalize=False)
    assert torch.allclose(mean, x.mean(0), atol=1e-6)
    assert mean.dtype == torch.float32


def test_dimensions_truncate_then_normalize():
    x = rows(3)
    got = pool_vector(x, LAST, normalize=True, dimensions=4)
    want = x[-1, :4] / x[-1, :4].norm()
    assert got.shape == (4,) and torch.allclose(got, want, atol=1e-7)
    assert abs(float(got.norm()) - 1.0) < 1e-6


def test_bf16_rows_pool_in_float32():
    x = rows(4).to(torch.bfloat16)
    got = pool_vector(x, MEAN, normalize=False)
    assert got.dtype == torch.float32
    assert torch.allclose(got, x.float().mean(0), atol=1e-6)


def test_unknown_pooling_type_is_refused():
    with pytest.raises(ValueError, match="pooling type"):
        pool_vector(rows(2), 0, normalize=False)


# ------------------------------------------------------------------------ across steps


@pytest.mark.parametrize("kind", [LAST, MEAN])
@pytest.mark.parametrize("chunks", [[9], [4, 5], [1, 3, 5], [3, 3, 3]])
def test_a_prompt_split_into_chunks_pools_bitwise_as_in_one_step(kind, chunks):
    x = rows(9)
    whole = pool_step([pooled_seq("s", 9, 0, 9, kind, normalize=True, dimensions=0)], x)
    state = PoolingState(kind, normalize=True, dimensions=0)
    got = []
    start = 0
    for k, n in enumerate(chunks):
        # Each chunk shares its step with another sequence's rows, before and after.
        other = pooled_seq("o", 3, 0, 3, LAST, normalize=False, dimensions=0)
        batch = [other, pooled_seq("s", 9, start, n, kind, state=state)]
        hidden = torch.cat([rows(3, seed=100 + k), x[start : start + n]])
        got += pool_step(batch, hidden)
        start += n
    mine = [r for r in got if r.seq_id == "s"]
    assert len(mine) == 1 and not state.chunks  # kept rows are released once pooled
    assert mine[0].vector.numpy().tobytes() == whole[0].vector.numpy().tobytes()


def test_a_retried_chunk_is_not_counted_twice():
    x = rows(6)
    state = PoolingState(MEAN, normalize=False, dimensions=0)
    pool_step([pooled_seq("s", 6, 0, 3, MEAN, state=state)], x[:3])
    pool_step([pooled_seq("s", 6, 0, 3, MEAN, state=state)], x[:3])  # same chunk again
    (res,) = pool_step([pooled_seq("s", 6, 3, 3, MEAN, state=state)], x[3:])
    assert torch.allclose(res.vector, x.mean(0), atol=1e-6)


def test_mean_without_the_leading_rows_fails_loudly():
    x = rows(6)
    state = PoolingState(MEAN, normalize=False, dimensions=0)  # as after a prefix-cache hit
    with pytest.raises(RuntimeError, match=r"positions \[0, 0\) of 6"):
        pool_step([pooled_seq("s", 6, 3, 3, MEAN, state=state)], x[3:])


def test_packed_float32_round_trip():
    x = rows(2)
    (res,) = pool_step([pooled_seq("s", 2, 0, 2, MEAN, normalize=True, dimensions=5)], x)
    (msg,) = pooled_to_proto([res])
    assert msg.seq_id == "s" and len(msg.data) == 5 * 4
    assert np.array_equal(vector_from_bytes(msg.data), res.vector.numpy())


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("pool"), "llama")
    return ModelRunner(model_dir, block_size=8, num_device_blocks=8)


def test_runner_pools_only_the_sequences_that_ask(runner):
    pooling = {"pooling": PoolingState(MEAN, normalize=True, dimensions=0)}
    seqs = [
        ScheduledSequence("a", [5, 6, 7], 3, [0], 0, 3, ExecutorParams()),
        ScheduledSequence(
            "b", [8, 9, 10, 11], 4, [1], 0, 4, ExecutorParams(prompt_only=True), features=pooling
        ),
    ]
    pooled: list = []
    results = runner.execute(seqs, [], [], [], prompt_logprobs=[], pooled=pooled)
    assert [r.seq_id for r in results] == ["a"]  # b samples nothing
    assert [p.seq_id for p in pooled] == ["b"]
    assert pooled[0].vector.shape == (runner.info.hidden_size,)


# ------------------------------------------------------------------------ executor checks


def test_check_pooling_names_the_field():
    ok = epb.PoolingParams(type=epb.POOLING_TYPE_LAST, dimensions=HIDDEN)
    assert check_pooling(ok, HIDDEN, "p") is None
    assert "p.type" in check_pooling(epb.PoolingParams(), HIDDEN, "p")
    too_wide = epb.PoolingParams(type=epb.POOLING_TYPE_MEAN, dimensions=HIDDEN + 1)
    assert check_pooling(too_wide, HIDDEN, "p") == "p.dimensions: 9 exceeds hidden_size 8"


@pytest.mark.parametrize(
    ("prompt_only", "pooling", "words"),
    [
        (False, epb.PoolingParams(type=epb.POOLING_TYPE_LAST), "only a prompt_only sequence"),
        (True, epb.PoolingParams(type=epb.POOLING_TYPE_MEAN, dimensions=10**6), "exceeds hidden"),
        (True, epb.PoolingParams(type=9), "pooling.type"),
    ],
)
def test_the_executor_refuses_a_bad_pooling_step(runner, prompt_only, pooling, words):
    params = epb.SamplingParams(prompt_only=prompt_only, pooling=pooling)
    seq = epb.NewSequence(
        seq_id="s",
        token_ids=[5, 6, 7],
        num_prompt_tokens=3,
        sampling_params=params,
        block_table=[0],
        num_scheduled_tokens=3,
    )
    request = epb.ExecuteModelRequest(step_id=1, new_sequences=[seq])
    with pytest.raises(InvalidStep, match=words):
        validate_step(request, {}, runner, max_logprobs=20)


def test_the_executor_keeps_a_new_sequences_pooling_in_its_state(runner):
    pooling = epb.PoolingParams(type=epb.POOLING_TYPE_MEAN, normalize=True)
    seqs = [
        epb.NewSequence(
            seq_id=seq_id,
            token_ids=[5, 6, 7],
            num_prompt_tokens=3,
            sampling_params=params,
            block_table=[i],
            num_scheduled_tokens=3,
        )
        for i, (seq_id, params) in enumerate(
            [
                ("e", epb.SamplingParams(prompt_only=True, pooling=pooling)),
                ("g", epb.SamplingParams()),
            ]
        )
    ]
    request = epb.ExecuteModelRequest(step_id=1, new_sequences=seqs)
    embed_state, plain_state = validate_step(request, {}, runner, max_logprobs=20).new_states
    assert embed_state.features == {"pooling": PoolingState(MEAN, True, 0)}
    assert not plain_state.features


# ------------------------------------------------------------------------ scheduler side


def make_scheduler(**kw) -> Scheduler:
    args = dict(
        max_num_batched_tokens=4,
        max_num_seqs=4,
        block_size=4,
        num_device_blocks=16,
        num_cpu_blocks=8,
        max_model_len=128,
        watermark=0.0,
        enable_prefix_caching=True,
        preemption_mode="swap",
    )
    args.update(kw)
    return Scheduler(SchedulerConfig(**args))


def embed(req_id: str, kind: PoolingType, n: int = 12) -> Request:
    pooling = PoolingParams(kind, normalize=True, dimensions=0)
    return embed_request(req_id, list(range(1, n + 1)), pooling, priority=0, arrival_time=0.0)


@pytest.mark.parametrize(("kind", "cached"), [(PoolingType.LAST, True), (PoolingType.MEAN, False)])
def test_only_last_pooling_uses_the_prefix_cache(kind, cached):
    req = embed("e", kind)
    assert req.seqs[0].prompt_only and req.seqs[0].use_prefix_cache is cached
    assert swappable(req) is cached
    assert swappable(Request("g", [1, 2], SamplingParams()))


def test_the_step_message_carries_the_pooling():
    params = embed("e", PoolingType.MEAN).sampling_params
    # The pooling is added by the feature's step_message hook (features/pooling).
    msg = with_pooling(executor_params(params, None), params)
    assert msg.prompt_only and msg.pooling.type == epb.POOLING_TYPE_MEAN and msg.pooling.normalize
    assert PoolingState.from_proto(msg.pooling) == PoolingState(MEAN, True, 0)
    plain = SamplingParams(max_tokens=0)
    assert not with_pooling(executor_params(plain, None), plain).HasField("pooling")


@pytest.mark.parametrize(("kind", "swapped"), [(PoolingType.LAST, True), (PoolingType.MEAN, False)])
def test_a_mean_pooling_request_is_preempted_by_recompute(kind, swapped):
    sched = make_scheduler()
    req = embed("e", kind)
    sched.add_request(req)
    out = sched.schedule()  # its first chunk of 4
    sched.update_from_output(out, {})
    preempting = SchedulerOutput(step_id=99)
    sched._preempt(req, preempting)
    assert bool(preempting.blocks_to_swap_out) is swapped
    assert (sched.swapped_request_ids() == ["e"]) is swapped
    if not swapped:
        assert sched.waiting_request_ids() == ["e"] and req.seqs[0].num_computed_tokens == 0


# ------------------------------------------------------------------------ client


def test_client_inputs_and_request():
    assert as_inputs("hi") == ["hi"]
    assert as_inputs([1, 2]) == [[1, 2]]
    assert as_inputs(["a", [3]]) == ["a", [3]]
    req = build_embed_request(["a", [3, 4]], pooling="mean", normalize=False, dimensions=4)
    assert req.pooling == pb.POOLING_TYPE_MEAN and req.normalize is False and req.dimensions == 4
    assert req.inputs[0].text == "a" and list(req.inputs[1].token_ids.ids) == [3, 4]
    assert not build_embed_request("a").HasField("normalize")
    with pytest.raises(ValueError, match="pooling"):
        build_embed_request("a", pooling="cls")
