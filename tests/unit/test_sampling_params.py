"""SamplingParams.validate(): defaults and boundaries pass, each bad field is named."""

from __future__ import annotations

import dataclasses
import math

import pytest

from scheduler_svc.core.sampling_params import (
    MAX_N,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    ValidationError,
)

MAX_LOGPROBS = 20
VOCAB_SIZE = 512


def validate(**fields) -> None:
    SamplingParams(**fields).validate(max_logprobs=MAX_LOGPROBS, vocab_size=VOCAB_SIZE)


def test_defaults_are_valid():
    params = SamplingParams()
    params.validate(max_logprobs=0)
    params.validate(max_logprobs=MAX_LOGPROBS, vocab_size=VOCAB_SIZE)
    assert (params.n, params.max_tokens, params.temperature, params.top_k) == (1, 16, 1.0, -1)
    assert params.skip_special_tokens and params.logprobs is None and not params.greedy


@pytest.mark.parametrize(
    "fields",
    [
        {"n": MAX_N},
        {"max_tokens": 1},
        {"min_tokens": 16, "max_tokens": 16},
        {"max_tokens": 0},  # prompt-only (scoring): ends after the prefill
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"top_k": 0},
        {"top_k": 1},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"repetition_penalty": 2.0},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"stop": ["x" * MAX_STOP_STRING_LEN] * MAX_STOP_STRINGS},
        {"stop_token_ids": [0, VOCAB_SIZE - 1] * (MAX_STOP_TOKEN_IDS // 2)},
        {"logprobs": 0},
        {"logprobs": MAX_LOGPROBS},
    ],
)
def test_boundary_values_are_valid(fields: dict):
    validate(**fields)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", MAX_N + 1),
        ("max_tokens", -5),
        ("min_tokens", -1),
        ("min_tokens", 17),  # above the default max_tokens
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", math.nan),
        ("top_k", -2),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("min_p", math.nan),
        ("presence_penalty", 2.01),
        ("presence_penalty", math.nan),
        ("frequency_penalty", -2.01),
        ("frequency_penalty", math.inf),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 2.01),
        ("repetition_penalty", math.nan),
        ("seed", -1),
        ("seed", 2**63),
        ("stop", ["x"] * (MAX_STOP_STRINGS + 1)),
        ("stop", [""]),
        ("stop", ["x" * (MAX_STOP_STRING_LEN + 1)]),
        ("stop_token_ids", [1] * (MAX_STOP_TOKEN_IDS + 1)),
        ("stop_token_ids", [VOCAB_SIZE]),
        ("stop_token_ids", [-1]),
        ("logprobs", -1),
        ("logprobs", MAX_LOGPROBS + 1),
        ("logit_bias", {VOCAB_SIZE: 1.0}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {3: 100.01}),
        ("logit_bias", {3: float("inf")}),
        ("logit_bias", dict.fromkeys(range(1025), 1.0)),
        ("prompt_logprobs", -1),
        ("prompt_logprobs", MAX_LOGPROBS + 1),
        ("structured_output", {}),
    ],
)
def test_invalid_field_is_named(field: str, value):
    with pytest.raises(ValidationError, match=rf"params\.{field}\b"):
        validate(**{field: value})


def test_every_numeric_field_has_an_invalid_case():
    # Guards the table above against a field added later without a test.
    covered = {
        "n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
        "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop",
        "stop_token_ids", "logprobs", "logit_bias", "prompt_logprobs", "structured_output",
    }  # fmt: skip
    flags = {
        "include_stop_str_in_output",
        "ignore_eos",
        "skip_special_tokens",
        "disable_speculation",
    }
    assert {f.name for f in dataclasses.fields(SamplingParams)} == covered | flags


def test_validation_error_is_a_value_error():
    with pytest.raises(ValueError):
        validate(n=0)


def test_stop_token_ids_unchecked_without_vocab_size():
    SamplingParams(stop_token_ids=[10**6]).validate(max_logprobs=0)


def test_logit_bias_survives_the_store_json_round_trip():
    import json

    params = SamplingParams(logit_bias={5: -100.0, 17: 2.5})
    back = SamplingParams.from_dict(json.loads(json.dumps(params.to_dict())))
    assert back == params and all(isinstance(k, int) for k in back.logit_bias)
