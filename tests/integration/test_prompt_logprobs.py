"""prompt_logprobs end to end (client -> scheduler -> executor on the tiny demo model), against
Hugging Face transformers' log-softmax over the same prompt: across prefill chunks, with a
prefix-cache hit waiting to be taken, for n > 1, and after a scheduler restart (from Redis)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from client import LLMClient, LLMServeError, SamplingParams
from scheduler_svc.local.redis_server import RedisServer
from tests.support.stack import make_stack

TOP = 3
# 41 tokens: with 16 tokens per step the prompt is computed in three chunks.
PROMPT = [(7 * j) % 113 + 4 for j in range(41)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plp")
    redis = RedisServer(data_dir=tmp / "redis")
    redis.start()
    s = make_stack(
        tmp, redis, scheduler_args=["--max-num-batched-tokens", "16", "--max-num-seqs", "16"]
    )
    try:
        yield s
    finally:
        s.stop()
        redis.close()


@pytest.fixture(scope="module")
def reference(stack) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(stack.model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)


def _client(stack) -> LLMClient:
    c = LLMClient(stack.address, timeout=60)
    c.wait_ready(60)
    return c


def _assert_matches(prompt_logprobs, ref: torch.Tensor) -> None:
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(PROMPT)
    assert prompt_logprobs[0] is None
    for pos in range(1, len(PROMPT)):
        by_id = prompt_logprobs[pos]
        want = ref[pos - 1]
        assert math.isclose(by_id[PROMPT[pos]].logprob, float(want[PROMPT[pos]]), abs_tol=1e-4)
        ranked = sorted((lp.rank, tok) for tok, lp in by_id.items() if lp.rank is not None)
        assert [tok for _, tok in ranked] == torch.topk(want, TOP).indices.tolist(), pos


def test_prompt_logprobs_match_hf_across_chunks_and_cache_hits(stack, reference) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=TOP, ignore_eos=True)
    with _client(stack) as client:
        # Plain requests first fill the prefix cache with this prompt's blocks.
        (plain,) = client.generate(
            PROMPT, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False
        )
        assert plain.prompt_logprobs is None
        for _ in range(2):  # the second run would hit the cache if it were allowed to
            (out,) = client.generate(PROMPT, params, use_tqdm=False)
            _assert_matches(out.prompt_logprobs, reference)
            assert out.outputs[0].token_ids == plain.outputs[0].token_ids


def test_prompt_logprobs_with_n_and_zero_alternatives(stack, reference) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=4, prompt_logprobs=0)
    with _client(stack) as client:
        (out,) = client.generate(PROMPT, params, use_tqdm=False)
    assert len(out.outputs) == 3 and all(len(o.token_ids) == 4 for o in out.outputs)
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(PROMPT) and plp[0] is None
    for pos in range(1, len(PROMPT)):
        assert list(plp[pos]) == [PROMPT[pos]]  # the prompt token only
        want = float(reference[pos - 1][PROMPT[pos]])
        assert math.isclose(plp[pos][PROMPT[pos]].logprob, want, abs_tol=1e-4)


def test_prompt_logprobs_over_the_limit_is_invalid_argument(stack) -> None:
    with _client(stack) as client, pytest.raises(LLMServeError) as e:
        client.generate(
            PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=10_000), use_tqdm=False
        )
    assert e.value.code.name == "INVALID_ARGUMENT" and "prompt_logprobs" in e.value.message


def test_prompt_logprobs_survive_a_scheduler_restart(stack, reference) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP)
    with _client(stack) as client:
        (out,) = client.generate(PROMPT, params, use_tqdm=False)
    stack.kill_scheduler()
    stack.start_scheduler()
    with _client(stack) as client:
        deltas = list(client.resume(out.request_id))
    first = next(d for d in deltas if d.token_offset == 0)
    _assert_matches(first.prompt_logprobs, reference)
    assert [t for d in deltas for t in d.token_ids] == out.outputs[0].token_ids


def test_prompt_only_request_ends_after_prefill_and_survives_a_restart(stack, reference) -> None:
    # max_tokens=0 (scoring a prompt): no output token, finished by length, prompt logprobs in;
    # the stored record replays the same after a scheduler restart.
    params = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=TOP)
    with _client(stack) as client:
        (out,) = client.generate(PROMPT, params, use_tqdm=False)
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    _assert_matches(out.prompt_logprobs, reference)
    stack.kill_scheduler()
    stack.start_scheduler()
    with _client(stack) as client:
        deltas = list(client.resume(out.request_id))
        state = client.get_request(out.request_id)
    assert [t for d in deltas for t in d.token_ids] == []
    assert deltas[-1].finish_reason == "length"
    _assert_matches(deltas[0].prompt_logprobs, reference)
    assert state.status == "finished" and state.outputs[0].token_ids == []
