"""Offline, seeded benchmark workloads.

Prompts are token ids drawn uniformly from `[0, vocab_size)`, so prompt lengths are exact and no
tokenizer is needed. Every request carries an exact output length; the backends enforce it
(llmserve: `ignore_eos=True, max_tokens=output_len`; hf: `min_new_tokens` = `max_new_tokens`),
so every system generates the same number of tokens.

Workloads
- `random`: input and output lengths uniform in `[L * (1 - r), L * (1 + r)]` for the given
  lengths L and range ratio r (r = 0: every request has exactly L).
- `sharegpt-like`: lengths from lognormal distributions matched to the published shape of the
  ShareGPT conversations vLLM benchmarks with (mean ~200 prompt tokens, ~180 output tokens, long
  right tails). Parameters (before capping): input mean 200, sigma 1.0 (median ~121, p99 ~1240);
  output mean 180, sigma 0.9 (median ~120, p99 ~970). Both are at least 4 tokens (as vLLM's
  ShareGPT filter); the prompt is clipped to `max_model_len - 4` and then the output to what is
  left of `max_model_len`, so on short-context models the means come out lower.
- `shared-prefix`: one common "system prompt" of `prefix_len` tokens followed by a distinct
  question of `question_len` tokens per request (what prefix caching is for).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

WORKLOADS = ("random", "sharegpt-like", "shared-prefix")

SHAREGPT_INPUT_MEAN = 200.0
SHAREGPT_INPUT_SIGMA = 1.0
SHAREGPT_OUTPUT_MEAN = 180.0
SHAREGPT_OUTPUT_SIGMA = 0.9
SHAREGPT_MIN_LEN = 4


@dataclass(slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int  # exact number of tokens to generate

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def _tokens(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return rng.integers(0, vocab_size, size=n).tolist()


def _uniform_lens(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> np.ndarray:
    low = max(1, math.floor(length * (1 - range_ratio)))
    high = max(low, math.ceil(length * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n)


def random_workload(
    num_prompts: int,
    *,
    input_len: int,
    output_len: int,
    vocab_size: int,
    max_model_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[BenchRequest]:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    longest = math.ceil(input_len * (1 + range_ratio)) + math.ceil(output_len * (1 + range_ratio))
    if longest > max_model_len:
        raise ValueError(
            f"input_len + output_len can reach {longest} tokens, over max_model_len={max_model_len}"
        )
    rng = np.random.default_rng(seed)
    in_lens = _uniform_lens(rng, num_prompts, input_len, range_ratio)
    out_lens = _uniform_lens(rng, num_prompts, output_len, range_ratio)
    return [
        BenchRequest(_tokens(rng, int(i), vocab_size), int(o))
        for i, o in zip(in_lens, out_lens, strict=True)
    ]


def lognormal_mu(mean: float, sigma: float) -> float:
    """The mu of a lognormal with the given mean: mean = exp(mu + sigma^2 / 2)."""
    return math.log(mean) - sigma * sigma / 2


def sharegpt_like_lengths(
    num_prompts: int, *, max_model_len: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(input lengths, output lengths) as documented in the module docstring."""
    if max_model_len < 2 * SHAREGPT_MIN_LEN:
        raise ValueError(f"max_model_len={max_model_len} is too short for sharegpt-like")
    rng = np.random.default_rng(seed)
    in_mu = lognormal_mu(SHAREGPT_INPUT_MEAN, SHAREGPT_INPUT_SIGMA)
    out_mu = lognormal_mu(SHAREGPT_OUTPUT_MEAN, SHAREGPT_OUTPUT_SIGMA)
    in_lens = np.rint(rng.lognormal(in_mu, SHAREGPT_INPUT_SIGMA, size=num_prompts)).astype(int)
    out_lens = np.rint(rng.lognormal(out_mu, SHAREGPT_OUTPUT_SIGMA, size=num_prompts)).astype(int)
    in_lens = np.clip(in_lens, SHAREGPT_MIN_LEN, max_model_len - SHAREGPT_MIN_LEN)
    out_lens = np.clip(out_lens, SHAREGPT_MIN_LEN, max_model_len - in_lens)
    return in_lens, out_lens


def sharegpt_like_workload(
    num_prompts: int, *, vocab_size: int, max_model_len: int, seed: int = 0
) -> list[BenchRequest]:
    in_lens, out_lens = sharegpt_like_lengths(num_prompts, max_model_len=max_model_len, seed=seed)
    # Token ids come from a second stream so that the lengths do not depend on vocab_size.
    rng = np.random.default_rng([seed, 1])
    return [
        BenchRequest(_tokens(rng, int(i), vocab_size), int(o))
        for i, o in zip(in_lens, out_lens, strict=True)
    ]


def shared_prefix_workload(
    num_prompts: int,
    *,
    prefix_len: int,
    question_len: int,
    output_len: int,
    vocab_size: int,
    max_model_len: int,
    seed: int = 0,
) -> list[BenchRequest]:
    total = prefix_len + question_len + output_len
    if total > max_model_len:
        raise ValueError(
            f"prefix_len + question_len + output_len = {total} is over max_model_len={max_model_len}"
        )
    rng = np.random.default_rng(seed)
    prefix = _tokens(rng, prefix_len, vocab_size)
    return [
        BenchRequest(prefix + _tokens(rng, question_len, vocab_size), output_len)
        for _ in range(num_prompts)
    ]


def make_workload(
    name: str,
    num_prompts: int,
    *,
    vocab_size: int,
    max_model_len: int,
    seed: int = 0,
    input_len: int = 256,
    output_len: int = 128,
    range_ratio: float = 0.0,
    prefix_len: int = 512,
    question_len: int = 32,
) -> list[BenchRequest]:
    """Dispatch by workload name; arguments that a workload does not use are ignored."""
    if name == "random":
        return random_workload(
            num_prompts,
            input_len=input_len,
            output_len=output_len,
            range_ratio=range_ratio,
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            seed=seed,
        )
    if name == "sharegpt-like":
        return sharegpt_like_workload(
            num_prompts, vocab_size=vocab_size, max_model_len=max_model_len, seed=seed
        )
    if name == "shared-prefix":
        return shared_prefix_workload(
            num_prompts,
            prefix_len=prefix_len,
            question_len=question_len,
            output_len=output_len,
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            seed=seed,
        )
    raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)}")
