"""min_tokens end to end (client -> scheduler -> executor on the tiny demo model): while a
sequence is shorter than min_tokens, its stop token ids and the model's EOS ids are masked in
the executor's sampler, so they are never generated, not merely ignored as stops."""

from __future__ import annotations

import json

import pytest

from client import LLMClient, SamplingParams
from tests.support.stack import llmserve_stack  # noqa: F401 -- registers the fixture

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[(11 * i + j) % 97 + 3 for j in range(4 + i % 5)] for i in range(24)]


@pytest.fixture
def client(llmserve_stack):  # noqa: F811
    with LLMClient(llmserve_stack.address, timeout=60) as c:
        c.wait_ready(60)
        yield c


def _greedy(client: LLMClient, prompts, params: SamplingParams) -> list[list[int]]:
    outs = client.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_stop_token_id_is_never_sampled_before_min_tokens(client: LLMClient) -> None:
    prompt = PROMPTS[0]
    (free,) = _greedy(client, [prompt], GREEDY)
    stop_id = free[2]
    params = GREEDY.replace(min_tokens=5, stop_token_ids=[stop_id])
    (out,) = client.generate(prompt, params, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    assert len(tokens) >= 5
    assert stop_id not in tokens[:5]
    # Greedy with a mask: the first tokens agree up to where the unconstrained run drew stop_id.
    first = free.index(stop_id)
    assert tokens[:first] == free[:first]
    assert tokens[first] != free[first]
    # Past min_tokens the stop id stops the sequence again (or it ran to max_tokens).
    if stop_id in tokens[5:]:
        assert tokens[-1] == stop_id and out.outputs[0].finish_reason == "stop"
    else:
        assert len(tokens) == params.max_tokens


def test_eos_is_never_sampled_before_min_tokens(client: LLMClient, llmserve_stack) -> None:  # noqa: F811
    config = json.loads((llmserve_stack.model_dir / "config.json").read_text())
    eos = config["eos_token_id"]
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    # The random demo model never makes EOS its argmax; a very hot, seeded sampler draws nearly
    # uniformly, so among these draws some are EOS, and which ones is fixed by the seeds.
    hot = [
        SamplingParams(temperature=50.0, seed=i, max_tokens=24, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    free = _greedy(client, PROMPTS, hot)
    hits = [i for i, toks in enumerate(free) if eos_ids & set(toks)]
    assert hits, "no EOS drawn: pick more prompts or tokens"
    # ignore_eos=False: before, EOS was drawn and only ignored as a stop, so it showed up in the
    # output; now it is masked, so every output runs to max_tokens without one.
    masked = [p.replace(ignore_eos=False, min_tokens=24) for p in hot]
    outs = client.generate(PROMPTS, masked, use_tqdm=False)
    for i, out in enumerate(outs):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == 24 and out.outputs[0].finish_reason == "length"
        assert not eos_ids & set(tokens), (i, tokens)
        # Seeded noise depends on (seed, position) only: the runs agree until the first EOS.
        first = next((k for k, t in enumerate(free[i]) if t in eos_ids), len(free[i]))
        assert tokens[:first] == free[i][:first]
