"""logit_bias end to end (client -> scheduler -> executor sampler on the tiny demo model),
compared with Hugging Face transformers' generate(sequence_bias=...) on the same checkpoint."""

from __future__ import annotations

import pytest

from client import LLMClient, LLMServeError, SamplingParams
from tests.support.api_helpers import hf_greedy
from tests.support.stack import llmserve_stack  # noqa: F401 -- registers the fixture

MAX_TOKENS = 8
PROMPTS = [[(13 * i + j) % 89 + 5 for j in range(3 + i % 4)] for i in range(4)]


@pytest.fixture
def client(llmserve_stack):  # noqa: F811
    with LLMClient(llmserve_stack.address, timeout=60) as c:
        c.wait_ready(60)
        yield c


def test_greedy_with_logit_bias_matches_hf(client: LLMClient, llmserve_stack) -> None:  # noqa: F811
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    free = [o.outputs[0].token_ids for o in client.generate(PROMPTS, greedy, use_tqdm=False)]
    # Ban each prompt's first free token and push one other token up: both change the output.
    favoured = 7
    biases = [{f[0]: -100.0, favoured: 4.0} for f in free]
    outs = client.generate(PROMPTS, [greedy.replace(logit_bias=b) for b in biases], use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    for i, prompt in enumerate(PROMPTS):
        (want,) = hf_greedy(
            llmserve_stack.model_dir,
            [prompt],
            MAX_TOKENS,
            sequence_bias={(t,): b for t, b in biases[i].items()},
        )
        assert got[i] == want, (i, got[i], want)
        assert free[i][0] not in got[i]
    assert got != free
    # A bias never changes the reported logprobs' meaning: they are the raw model's.
    lp = SamplingParams(temperature=0.0, max_tokens=2, logprobs=0, logit_bias={favoured: 100.0})
    (out,) = client.generate(PROMPTS[0], lp, use_tqdm=False)
    seq = out.outputs[0]
    assert seq.token_ids == [favoured, favoured]
    assert all(by_id[favoured].logprob < -0.01 for by_id in seq.logprobs)


@pytest.mark.parametrize(
    ("bias", "needle"),
    [({10**6: 1.0}, "vocabulary"), ({5: 100.5}, "[-100, 100]"), ({5: float("nan")}, "logit_bias")],
)
def test_bad_logit_bias_is_invalid_argument(client: LLMClient, bias, needle) -> None:
    params = SamplingParams(max_tokens=2, logit_bias=bias)
    with pytest.raises(LLMServeError) as e:
        client.generate([1, 2, 3], params, use_tqdm=False)
    assert e.value.code.name == "INVALID_ARGUMENT" and needle in e.value.message
