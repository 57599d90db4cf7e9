"""Prompt-only requests (max_tokens=0, how evaluators score a prompt): the scheduler sends them
marked, the executor's runner samples nothing for them, and the scheduler core accepts a
completed prefill without a token for them only."""

from __future__ import annotations

import pytest
import torch

from executor_svc.runner.model_runner import ModelRunner, ScheduledSequence
from executor_svc.runner.sampler import SamplingParams as ExecutorParams
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.engine.fleet.step_message import executor_params
from tests.support.model_factory import make_tiny_checkpoint


def make_scheduler() -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=64,
            max_num_seqs=8,
            block_size=4,
            num_device_blocks=16,
            num_cpu_blocks=0,
            max_model_len=128,
            watermark=0.0,
            enable_prefix_caching=False,
        )
    )


def test_prompt_only_sequence_completes_its_prefill_without_a_token():
    sched = make_scheduler()
    sched.add_request(Request("score", [1, 2, 3, 4, 5], SamplingParams(max_tokens=0)))
    sched.add_request(Request("gen", [6, 7, 8], SamplingParams(max_tokens=4)))
    out = sched.schedule()
    got = sched.update_from_output(out, {"gen/0": 99})  # nothing for the prompt-only one
    assert [s.seq_id for s in got] == ["score/0", "gen/0"]
    score, gen = got
    assert score.token_ids == [1, 2, 3, 4, 5] and score.num_computed_tokens == 5
    assert gen.token_ids == [6, 7, 8, 99]
    sched.finish_sequence("score/0", RequestStatus.FINISHED_LENGTH, None)
    sched.check_invariants()
    assert [s.seq_id for s, _ in sched.schedule().scheduled] == ["gen/0"]


def test_a_sampling_sequence_without_a_token_is_still_an_error():
    sched = make_scheduler()
    sched.add_request(Request("gen", [6, 7, 8], SamplingParams(max_tokens=4)))
    out = sched.schedule()
    with pytest.raises(ValueError, match="no token"):
        sched.update_from_output(out, {})


@pytest.mark.parametrize(("max_tokens", "prompt_only"), [(0, True), (1, False), (16, False)])
def test_executor_params_mark_prompt_only(max_tokens: int, prompt_only: bool):
    msg = executor_params(SamplingParams(max_tokens=max_tokens, prompt_logprobs=2), None)
    assert msg.prompt_only is prompt_only
    assert ExecutorParams.from_proto(msg).prompt_only is prompt_only


def test_runner_samples_only_sequences_that_generate(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path, "llama")
    runner = ModelRunner(model_dir, block_size=8, num_device_blocks=8)
    plain, score = ExecutorParams(), ExecutorParams(prompt_only=True, num_prompt_logprobs=0)
    seqs = [
        ScheduledSequence("a", [5, 6, 7], 3, [0], 0, 3, plain),
        ScheduledSequence("b", [8, 9, 10, 11], 4, [1], 0, 4, score),
        ScheduledSequence("c", [12, 13, 14], 3, [2], 0, 3, plain),
    ]
    prompt_lps: list = []
    with torch.inference_mode():
        assert runner.prepare_inputs(seqs).sample_seq_indices == [0, 2]
        results = runner.execute(seqs, [], [], [], prompt_logprobs=prompt_lps)
    assert [r.seq_id for r in results] == ["a", "c"]
    assert [p.seq_id for p in prompt_lps] == ["b"]
