"""Overlapped steps (api/step.py ``Flight``): a step launched before the host has the previous
step's draws takes them on the device, and every reply is what a step-by-step run gives.

The servicer is driven directly so that the interleavings are forced, not left to thread
timing: step N+1 is launched while step N's tokens are still ``PENDING`` on the host (its
inputs then gather them from N's draws), a step whose sampling reads token values (penalties)
settles the step in flight first, and a late-settled step fills its places whatever ran since.
On a CPU the draws are computed when launched; the placeholders, the gather and the settling
are the same code as on CUDA (where ``benchmarks/gpu_session.sh overlap`` runs this file).
"""

from __future__ import annotations

import pytest
import torch

from executor_svc.api.service import ExecutorServicer
from executor_svc.runner.launched import PENDING
from executor_svc.runner.model_runner import ModelRunner
from protos import executor_pb2 as pb
from tests.support.model_factory import make_tiny_checkpoint

BLOCK = 4
PROMPTS = {"a": [11, 12, 13, 14, 15], "b": [40, 41], "c": [100 + i for i in range(11)]}
PARAMS = {
    "a": pb.SamplingParams(),  # greedy
    "b": pb.SamplingParams(temperature=0.9, seed=7),
    "c": pb.SamplingParams(temperature=0.7, top_k=5, seed=3),
}
STEPS = 6


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")
    return ModelRunner(
        model_dir, device=_device(), block_size=BLOCK, num_device_blocks=64, swap_space_gib=0.0002
    )


def _servicer(runner: ModelRunner, overlap: bool) -> ExecutorServicer:
    servicer = ExecutorServicer(runner)
    servicer.overlap = overlap
    return servicer


def _first(params: dict[str, pb.SamplingParams]) -> pb.ExecuteModelRequest:
    """Every prompt prefilled, blocks for the whole run allocated up front."""
    req = pb.ExecuteModelRequest(step_id=1)
    next_block = 0
    for seq_id, prompt in PROMPTS.items():
        n = -(-(len(prompt) + STEPS + 1) // BLOCK)
        req.new_sequences.add(
            seq_id=seq_id,
            token_ids=prompt,
            num_prompt_tokens=len(prompt),
            sampling_params=params[seq_id],
            block_table=list(range(next_block, next_block + n)),
            num_scheduled_tokens=len(prompt),
        )
        next_block += n
    return req


def _decode(step_id: int, k: int, seq_ids: list[str]) -> pb.ExecuteModelRequest:
    """Step ``step_id``: the ``k``-th decode of ``seq_ids`` (all in the decode lane)."""
    return pb.ExecuteModelRequest(
        step_id=step_id,
        after_step_id=step_id - 1,
        decode_seq_ids=seq_ids,
        decode_num_computed_tokens=[len(PROMPTS[s]) + k - 1 for s in seq_ids],
    )


def _tokens(reply: pb.ExecuteModelResponse) -> list[tuple[str, int]]:
    out = [(s.seq_id, s.token_id) for s in reply.sampled]
    return out + [(f"lane{i}", t) for i, t in enumerate(reply.decode_token_ids)]


def _replies_step_by_step(runner: ModelRunner, params) -> list[list[tuple[str, int]]]:
    servicer = _servicer(runner, overlap=False)
    replies = [_tokens(servicer._execute(_first(params)))]
    for k in range(1, STEPS + 1):
        replies.append(_tokens(servicer._execute(_decode(k + 1, k, list(PROMPTS)))))
    return replies


def _reply(servicer: ExecutorServicer, flight) -> list[tuple[str, int]]:
    samples = flight.settle()
    out = [(s.seq_id, s.token_id) for s in samples.sampled]
    return out + [(f"lane{i}", t) for i, t in enumerate(samples.lane_tokens)]


def test_a_step_launched_on_unsettled_draws_gives_the_same_tokens(runner) -> None:
    reference = _replies_step_by_step(runner, PARAMS)
    servicer = _servicer(runner, overlap=True)
    flights = [servicer._launch(_first(PARAMS))]
    for k in range(1, STEPS + 1):
        flights.append(servicer._launch(_decode(k + 1, k, list(PROMPTS))))
        previous = flights[-2]
        if k == 1:
            # The decode was launched on top of draws the host had not read: they were
            # PENDING in the token lists until now.
            assert not previous.settled
            assert all(servicer._seqs[s].token_ids[len(PROMPTS[s])] == PENDING for s in PROMPTS)
    assert [_reply(servicer, f) for f in flights] == reference
    # Every placeholder filled, and the lists are the prompts plus what the replies said.
    for i, seq_id in enumerate(PROMPTS):
        tokens = servicer._seqs[seq_id].token_ids
        assert PENDING not in tokens
        assert tokens[len(PROMPTS[seq_id]) :] == [r[i][1] for r in reference]


def test_settling_in_order_of_launch_or_late_is_the_same(runner) -> None:
    reference = _replies_step_by_step(runner, PARAMS)
    servicer = _servicer(runner, overlap=True)
    replies = [_reply(servicer, servicer._launch(_first(PARAMS)))]
    for k in range(1, STEPS + 1):
        flight = servicer._launch(_decode(k + 1, k, list(PROMPTS)))
        assert flight.out.launched.deferred  # no feature, no penalty: kept on the device
        replies.append(_reply(servicer, flight))
    assert replies == reference


def test_a_step_that_reads_token_values_settles_the_one_in_flight(runner) -> None:
    params = dict(PARAMS, b=pb.SamplingParams(temperature=0.9, seed=7, repetition_penalty=1.3))
    reference = _replies_step_by_step(runner, params)
    servicer = _servicer(runner, overlap=True)
    flights = [servicer._launch(_first(params))]
    for k in range(1, STEPS + 1):
        flights.append(servicer._launch(_decode(k + 1, k, list(PROMPTS))))
        assert flights[-2].settled  # the penalty needs b's tokens on the host
        assert flights[-1].out.launched is None  # run through: its draws on the host
    assert [_reply(servicer, f) for f in flights] == reference


def test_overlap_is_on_by_default_only_on_cuda(runner, monkeypatch) -> None:
    monkeypatch.delenv("LLMSERVE_OVERLAP_STEPS", raising=False)
    assert ExecutorServicer(runner).overlap == (runner.device.type == "cuda")
    monkeypatch.setenv("LLMSERVE_OVERLAP_STEPS", "1")
    assert ExecutorServicer(runner).overlap
    monkeypatch.setenv("LLMSERVE_OVERLAP_STEPS", "0")
    assert not ExecutorServicer(runner).overlap
