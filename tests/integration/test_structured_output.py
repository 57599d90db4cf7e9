"""Structured outputs end to end (issue 26): client -> scheduler (llguidance matchers, masks in
ExecuteModel) -> executor (mask applied before sampling), on the tiny random-weight demo model.

Random weights make the model's choices arbitrary, which is what the mechanics need: every
output must still parse and validate, whatever the model prefers.
"""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest

from client import LLMClient, LLMServeError, SamplingParams
from client import structured as so
from tests.support.stack import llmserve_stack  # noqa: F401 -- registers the fixture

MAX_TOKENS = 160

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
ITEMS = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
        "kind": {"enum": ["x", "y"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["kind", "tags"],
    "additionalProperties": False,
}
SCHEMAS = [PERSON, ITEMS, {"type": "array", "items": {"type": "boolean"}, "maxItems": 5}]
REGEXES = [r"[a-z]{1,6}@[a-z]{2,5}\.(com|org)", r"[0-9]{3}-[0-9]{4}", r"(yes|no)!{0,3}"]
CHOICES = [["yes", "no", "maybe"], ["red", "green", "blue", "light blue"]]
GRAMMAR = 'start: "(" NUM ("+" NUM)~0..3 ")"\nNUM: /[0-9]{1,3}/'
GRAMMAR_RE = r"\(\d{1,3}(\+\d{1,3}){0,3}\)"
PROMPTS = ["hello", "the cat sat", "x y z", "one two three four", "a", "json please"]


def _cases() -> list[tuple[so.StructuredOutput, object]]:
    """(constraint, what the output must satisfy)."""
    cases: list[tuple[so.StructuredOutput, object]] = []
    cases += [(so.json_schema(s), s) for s in SCHEMAS]
    cases += [(so.regex(r), r) for r in REGEXES]
    cases += [(so.choice(c), c) for c in CHOICES]
    cases += [(so.grammar(GRAMMAR), GRAMMAR_RE)]
    return cases


def _check(spec: so.StructuredOutput, want: object, text: str) -> None:
    if spec.kind == "json_schema":
        jsonschema.validate(json.loads(text), want)
    elif spec.kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif spec.kind == "choice":
        assert text in want, text
    else:
        assert re.fullmatch(want, text), (want, text)


@pytest.fixture
def client(llmserve_stack):  # noqa: F811
    with LLMClient(llmserve_stack.address, timeout=120) as c:
        c.wait_ready(60)
        yield c


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_output_parses(client: LLMClient, temperature: float) -> None:
    """9 constraints x 6 prompts (54 requests), all in one concurrent batch: 100 % valid."""
    prompts, params, checks = [], [], []
    for i, (spec, want) in enumerate(_cases()):
        for j, prompt in enumerate(PROMPTS):
            prompts.append(prompt)
            params.append(
                SamplingParams(
                    temperature=temperature,
                    seed=100 * i + j,
                    max_tokens=MAX_TOKENS,
                    structured_output=spec,
                )
            )
            checks.append((spec, want))
    outs = client.generate(prompts, params, use_tqdm=False)
    assert len(outs) >= 50
    for out, (spec, want) in zip(outs, checks, strict=True):
        seq = out.outputs[0]
        assert seq.finish_reason == "stop", (spec, seq.text, seq.finish_reason)
        _check(spec, want, seq.text)


def test_json_object(client: LLMClient) -> None:
    """Any JSON object: unbounded, so a random model may run out of tokens; those that stop
    (by the grammar's EOS) parse, and the cut ones are a prefix of JSON text (as vLLM)."""
    params = [
        SamplingParams(
            temperature=t, seed=s, max_tokens=MAX_TOKENS, structured_output=so.json_object()
        )
        for t in (0.0, 0.8)
        for s in range(5)
    ]
    outs = client.generate(["{", "data:"] * 5, params, use_tqdm=False)
    stopped = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert stopped, [o.outputs[0].text for o in outs]
    for seq in stopped:
        assert isinstance(json.loads(seq.text), dict), seq.text
    for o in outs:
        assert o.outputs[0].text.startswith("{")


def test_mixed_batch_is_invariant(client: LLMClient) -> None:
    """Half constrained: the unconstrained half gets exactly its tokens alone, and each
    constrained request its tokens alone."""
    free = [SamplingParams(temperature=t, seed=7, max_tokens=24, ignore_eos=True) for t in (0, 0.8)]
    bound = [
        SamplingParams(
            temperature=t, seed=9, max_tokens=MAX_TOKENS, structured_output=so.json_schema(PERSON)
        )
        for t in (0, 0.8)
    ]
    prompts = ["the cat sat", "hello"]
    alone = [
        client.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids
        for sp in free + bound
        for p in prompts
    ]
    mixed_params = [sp for sp in free + bound for _ in prompts]
    mixed = client.generate(prompts * 4, mixed_params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed] == alone


def test_n_greater_than_one(client: LLMClient) -> None:
    spec = so.regex(r"[a-z]{2,8}-[0-9]{2}")
    params = SamplingParams(n=4, temperature=0.9, seed=11, max_tokens=40, structured_output=spec)
    (out,) = client.generate("pick a code", params, use_tqdm=False)
    assert len(out.outputs) == 4
    for seq in out.outputs:
        assert re.fullmatch(r"[a-z]{2,8}-[0-9]{2}", seq.text) and seq.finish_reason == "stop"
    assert len({seq.text for seq in out.outputs}) > 1  # siblings sample independently


def test_logprobs_are_after_masking(client: LLMClient) -> None:
    """The first token of a two-way choice: its top logprobs are over the allowed tokens only,
    so their probabilities sum to 1 (vLLM reports processed logprobs for structured output)."""
    params = SamplingParams(
        temperature=0.0, max_tokens=4, logprobs=5, structured_output=so.choice(["yes", "no"])
    )
    (out,) = client.generate("answer", params, use_tqdm=False)
    seq = out.outputs[0]
    assert seq.text in ("yes", "no")
    first = seq.logprobs[0]
    finite = [lp.logprob for lp in first.values() if math.isfinite(lp.logprob)]
    assert 1 <= len(finite) <= 2 and math.isclose(sum(math.exp(x) for x in finite), 1, rel_tol=1e-3)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (so.regex("a(("), "unclosed group"),
        (so.json_schema('{"type": "foo"}'), "foo"),
        (so.json_schema("{not json"), "json_schema"),
        (so.grammar("start: undefined_rule"), "undefined_rule"),
        (so.choice([]), "choice"),
        (so.regex("a" * (64 * 1024 + 1)), "65537 bytes"),
    ],
)
def test_bad_spec_is_invalid_argument(client: LLMClient, spec, needle: str) -> None:
    with pytest.raises(LLMServeError) as e:
        client.generate("x", SamplingParams(max_tokens=4, structured_output=spec), use_tqdm=False)
    assert e.value.code.name == "INVALID_ARGUMENT" and needle in e.value.message, e.value.message


def test_ignore_eos_with_grammar_is_invalid_argument(client: LLMClient) -> None:
    params = SamplingParams(max_tokens=4, ignore_eos=True, structured_output=so.regex("a+"))
    with pytest.raises(LLMServeError) as e:
        client.generate("x", params, use_tqdm=False)
    assert e.value.code.name == "INVALID_ARGUMENT"


def test_offline_llm_takes_a_constraint(llmserve_stack) -> None:  # noqa: F811
    from client import LLM

    with LLM(address=llmserve_stack.address) as llm:
        params = SamplingParams(
            temperature=0, max_tokens=20, structured_output=so.choice(["on", "off"])
        )
        (out,) = llm.generate("switch", params, use_tqdm=False)
    assert out.outputs[0].text in ("on", "off") and out.outputs[0].finish_reason == "stop"


def test_structural_tag_runs_and_tagged_segments_validate(client: LLMClient) -> None:
    """Free text with tagged segments (vLLM's structural_tag): a random model rarely writes the
    trigger, so this checks the request runs, and any complete segment holds to its schema."""
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<f>", "schema": PERSON, "end": "</f>"}],
        "triggers": ["<f>"],
    }
    params = [
        SamplingParams(
            temperature=0.8, seed=s, max_tokens=40, structured_output=so.structural_tag(tag)
        )
        for s in range(6)
    ]
    outs = client.generate(["call <f>"] * 6, params, use_tqdm=False)
    for o in outs:
        seq = o.outputs[0]
        assert seq.finish_reason in ("stop", "length"), seq
        for segment in re.findall(r"<f>(.*?)</f>", seq.text, flags=re.S):
            jsonschema.validate(json.loads(segment), PERSON)
