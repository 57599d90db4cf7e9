"""No field accepted and ignored: every field of every request model the frontend serves is
walked, and each must be honoured (a value of it changes the answer) or validated (a value of
it is a 4xx that names it), or be on the documented allow-list of labels that mean nothing
here (docs/openai.md); a field this test has no probe for fails it, so a new field needs one.
Against a real stack whose model writes known texts (tests/support/tool_model.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from frontend_svc.anthropic_protocol import CountTokensRequest, MessagesRequest
from frontend_svc.embeddings import EmbeddingRequest
from frontend_svc.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    StreamOptions,
    TokenizeRequest,
)
from frontend_svc.responses_protocol import ResponsesRequest
from tests.support.tool_model import HERMES_FRONTEND_ARGS, SCRIPTS, script_bias, tool_stack

DOCS = Path(__file__).parents[2] / "docs" / "openai.md"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string"}}},
}}, {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]  # fmt: skip
LABEL = "label"  # on the allow-list: a label the client may send, meaning nothing here


@pytest.fixture(scope="module")
def llmserve_stack(tmp_path_factory):
    with tool_stack(tmp_path_factory.mktemp("fields")) as stack:
        yield stack


@pytest.fixture(scope="module")
def frontend_args() -> list[str]:
    return [*HERMES_FRONTEND_ARGS]


@pytest.fixture(scope="module")
def vocab(llmserve_stack) -> Tokenizer:
    return Tokenizer.from_file(str(llmserve_stack.model_dir / "tokenizer.json"))


def _sampling(bias) -> dict:
    """Probes of the sampling fields chat and completions share: {field: (base, probe)}."""
    return {
        "model": ({}, {"model": "nope"}),
        "n": ({}, {"n": 2}),
        "temperature": ({}, {"temperature": -1}),
        "top_p": ({}, {"top_p": 0}),
        "stop": ({}, {"stop": ["Paris"]}),
        "seed": ({}, {"seed": -1}),
        "presence_penalty": ({}, {"presence_penalty": 5}),
        "frequency_penalty": ({}, {"frequency_penalty": 5}),
        "logit_bias": ({}, {"logit_bias": bias("plain_text")}),
        "user": LABEL,
        "safety_identifier": LABEL,
        "prompt_cache_key": LABEL,
        "store": ({}, {"store": True}),
        "service_tier": ({}, {"service_tier": "flex"}),
        "stream": ({}, {"stream": True}),
        "stream_options": ({}, {"stream_options": {"include_usage": True}}),
        "top_k": ({}, {"top_k": -5}),
        "min_p": ({}, {"min_p": 2}),
        "repetition_penalty": ({}, {"repetition_penalty": 0}),
        "min_tokens": ({}, {"min_tokens": 30}),
        "ignore_eos": ({}, {"ignore_eos": True}),
        "skip_special_tokens": ({"ignore_eos": True}, {"skip_special_tokens": False}),
        "stop_token_ids": ({}, {"stop_token_ids": "STOP_ID"}),
        "include_stop_str_in_output": ({"stop": ["Paris"]}, {"include_stop_str_in_output": True}),
        # No effect a single request can show; its type is checked.
        "priority": ({}, {"priority": "high"}),
        "prompt_logprobs": ({}, {"prompt_logprobs": 1}),
        "response_format": ({}, {"response_format": {"type": "json_object"}}),
        "structured_outputs": ({}, {"structured_outputs": {"choice": ["yes", "no"]}}),
        "guided_json": ({}, {"guided_json": {"type": "object"}}),
        "guided_regex": ({}, {"guided_regex": "(yes|no)"}),
        "guided_choice": ({}, {"guided_choice": ["yes"]}),
        "guided_grammar": ({}, {"guided_grammar": 'start: "yes"'}),
        "guided_decoding_backend": ({}, {"guided_decoding_backend": "xgrammar"}),
        "guided_whitespace_pattern": ({}, {"guided_whitespace_pattern": " "}),
        "max_tokens": ({}, {"max_tokens": 2}),
        # Honoured in tests/integration/test_deadlines.py (it needs a queue to wait in).
        "timeout": ({}, {"timeout": -1}),
    }


def _chat(bias) -> dict:
    return {
        **_sampling(bias),
        "messages": ({}, {"messages": [{"role": "user", "content": "Other"}]}),
        "max_completion_tokens": ({}, {"max_completion_tokens": 2}),
        "logprobs": ({}, {"logprobs": True}),
        "top_logprobs": ({"logprobs": True}, {"top_logprobs": 2}),
        "add_generation_prompt": ({}, {"add_generation_prompt": False}),
        "tools": ({}, {"tools": TOOLS}),
        "tool_choice": ({"tools": TOOLS}, {"tool_choice": "none"}),
        "parallel_tool_calls": (
            {"tools": TOOLS, "logit_bias": bias("text_then_two_calls")},
            {"parallel_tool_calls": False},
        ),
        "functions": ({}, {"functions": [{"name": "f"}]}),
        "function_call": ({}, {"function_call": "auto"}),
        "modalities": ({}, {"modalities": ["audio"]}),
    }


def _completion(bias) -> dict:
    return {
        **_sampling(bias),
        "logprobs": ({}, {"logprobs": 1}),
        "prompt": ({}, {"prompt": "Other\n"}),
        "echo": ({}, {"echo": True}),
        "suffix": ({}, {"suffix": " done"}),
        "best_of": ({"n": 2}, {"best_of": 1}),
    }


EMBEDDING = {
    "input": ({}, {"input": "Other"}),
    "model": ({}, {"model": "nope"}),
    "encoding_format": ({}, {"encoding_format": "base64"}),
    "dimensions": ({}, {"dimensions": 4}),
    "user": LABEL,
    "normalize": ({}, {"normalize": False}),
    "pooling": ({}, {"pooling": "mean"}),
    "priority": ({}, {"priority": "high"}),
}
TOKENIZE = {
    "model": ({}, {"model": "nope"}),
    "prompt": ({}, {"prompt": "Other"}),
    "messages": ({}, {"prompt": None, "messages": ASK}),
    "add_generation_prompt": ({"prompt": None, "messages": ASK}, {"add_generation_prompt": False}),
    "tools": ({"prompt": None, "messages": ASK}, {"tools": TOOLS}),
}
DETOKENIZE = {"model": ({}, {"model": "nope"}), "tokens": ({}, {"tokens": [74]})}
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
RESPONSES = {
    "model": ({}, {"model": "nope"}),
    "input": ({}, {"input": "Other"}),
    "instructions": ({}, {"instructions": "Be brief."}),
    "max_output_tokens": ({}, {"max_output_tokens": 2}),
    "temperature": ({}, {"temperature": -1}),
    "top_p": ({}, {"top_p": 0}),
    "stream": ({}, {"stream": True}),
    "store": ({}, {"store": True}),
    # Echoed in the response object, which is what they are for.
    "metadata": ({}, {"metadata": {"k": "v"}}),
    "user": ({}, {"user": "u-1"}),
    "text": ({}, {"text": {"format": {"type": "json_object"}}}),
    "tools": ({}, {"tools": RESPONSES_TOOLS}),
    "tool_choice": ({"tools": RESPONSES_TOOLS}, {"tool_choice": "none"}),
    "parallel_tool_calls": ({"tools": RESPONSES_TOOLS}, {"parallel_tool_calls": False}),
    "timeout": ({}, {"timeout": -1}),
}
_CONVERSATION = {
    "model": ({}, {"model": "nope"}),
    "messages": ({}, {"messages": [{"role": "user", "content": "Other"}]}),
    "system": ({}, {"system": "Be brief."}),
    "tools": ({}, {"tools": [{"name": "f", "input_schema": {"type": "object"}}]}),
}
MESSAGES = {
    **_CONVERSATION,
    "tool_choice": (
        {"tools": [{"name": "f", "input_schema": {"type": "object"}}]},
        {"tool_choice": {"type": "none"}},
    ),
    "max_tokens": ({}, {"max_tokens": 2}),
    "stop_sequences": ({}, {"stop_sequences": ["Paris"]}),
    "temperature": ({}, {"temperature": 5}),
    "top_p": ({}, {"top_p": 0}),
    "top_k": ({}, {"top_k": -5}),
    "stream": ({}, {"stream": True}),
    "metadata": LABEL,
    "service_tier": ({}, {"service_tier": "priority"}),
    "timeout": ({}, {"timeout": -1}),
}
# count_tokens: tool_choice does not change the prompt (as in Anthropic's API); it is checked.
COUNT_TOKENS = {**_CONVERSATION, "tool_choice": ({}, {"tool_choice": {"type": "any"}})}
STREAM_OPTIONS = {
    "include_usage": ({}, {"stream_options": {"include_usage": True}}),
    "continuous_usage_stats": ({}, {"stream_options": {"continuous_usage_stats": True}}),
}

# (route, request model, probes or a function of the script bias making them, base body)
ROUTES = [
    ("/v1/chat/completions", ChatCompletionRequest, _chat,
     {"messages": ASK, "max_tokens": 40, "temperature": 0}),
    ("/v1/completions", CompletionRequest, _completion,
     {"prompt": "Hi\n", "max_tokens": 40, "temperature": 0}),
    ("/v1/embeddings", EmbeddingRequest, EMBEDDING, {"input": "Hi"}),
    ("/tokenize", TokenizeRequest, TOKENIZE, {"prompt": "Hi"}),
    ("/detokenize", DetokenizeRequest, DETOKENIZE, {"tokens": [72, 73]}),
    ("/v1/responses", ResponsesRequest, RESPONSES,
     {"input": "Hi", "max_output_tokens": 40, "temperature": 0}),
    ("/v1/messages", MessagesRequest, MESSAGES,
     {"model": "MODEL", "max_tokens": 40, "messages": ASK}),
    ("/v1/messages/count_tokens", CountTokensRequest, COUNT_TOKENS,
     {"model": "MODEL", "messages": ASK}),
    ("/v1/chat/completions", StreamOptions, STREAM_OPTIONS,
     {"messages": ASK, "max_tokens": 40, "temperature": 0, "stream": True}),
]  # fmt: skip
CASES = [
    (path, model, field)
    for path, model, _, _ in ROUTES
    for field in model.model_fields  # every declared field, whatever its alias
]


def _probes(path: str, model: type, vocab: Tokenizer) -> tuple[dict, dict]:
    _, _, probes, base = next(r for r in ROUTES if r[0] == path and r[1] is model)
    return (probes(lambda name: script_bias(vocab, name)) if callable(probes) else probes), base


def _resolve(body: dict, model_name: str, vocab: Tokenizer) -> dict:
    out = {k: v for k, v in body.items() if v is not None}
    if out.get("model") == "MODEL":
        out["model"] = model_name
    if out.get("stop_token_ids") == "STOP_ID":
        out["stop_token_ids"] = [vocab.token_to_id(SCRIPTS["single_call"][2])]
    return out


def _normal(body: object) -> str:
    """The answer less what changes between two calls (ids, clocks)."""
    text = body if isinstance(body, str) else json.dumps(body, sort_keys=True)
    text = re.sub(r'"(id|item_id|call_id|created|created_at|completed_at)": ?("[^"]*"|\d+)',
                  "", text)  # fmt: skip
    return re.sub(r"(chatcmpl|cmpl|resp|msg|call|toolu|fc|rs)_?-?[0-9a-f]{24,}\w*", "ID", text)


@pytest.mark.parametrize(("path", "model", "field"), CASES,
                         ids=[f"{p}:{m.__name__}.{f}" for p, m, f in CASES])  # fmt: skip
def test_every_field_is_honoured_validated_or_an_allowed_label(frontend, vocab, path, model, field):
    probes, base = _probes(path, model, vocab)
    assert field in probes, f"{model.__name__}.{field} has no probe: say how it is honoured"
    probe = probes[field]
    if probe is LABEL:
        assert f"`{field}`" in DOCS.read_text(), f"{field} is not on the documented allow-list"
        return
    model_name = frontend.request("GET", "/v1/models")[1]["data"][0]["id"]
    base_body = _resolve({**base, **probe[0]}, model_name, vocab)
    probe_body = _resolve({**base_body, **probe[1]}, model_name, vocab)
    status0, body0 = frontend.request("POST", path, base_body)
    assert status0 == 200, (base_body, body0)
    status, body = frontend.request("POST", path, probe_body)
    if status == 200:
        assert _normal(body) != _normal(body0), f"{field}={probe[1]} changed nothing"
    else:
        # Validated: refused with a message or param that names the field.
        assert status in (400, 404), body
        assert field in json.dumps(body), body


@pytest.mark.parametrize("path", sorted({r[0] for r in ROUTES}))
def test_an_unknown_field_is_a_400_naming_it(frontend, path, vocab):
    _, _, _, base = next(r for r in ROUTES if r[0] == path)
    model_name = frontend.request("GET", "/v1/models")[1]["data"][0]["id"]
    status, body = frontend.request(
        "POST", path, {**_resolve(base, model_name, vocab), "no_such_field": 1}
    )
    assert status == 400 and "no_such_field" in json.dumps(body), body


def _chunks(raw: str) -> list[dict]:
    return [
        json.loads(line[len("data: ") :])
        for line in raw.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(frontend, path):
    base = {"max_tokens": 40, "temperature": 0, "stream": True}
    base |= {"messages": ASK} if path == "/v1/chat/completions" else {"prompt": "Hi\n"}
    options = {"include_usage": True, "continuous_usage_stats": True}
    status, raw = frontend.request("POST", path, {**base, "stream_options": options})
    assert status == 200, raw
    chunks = _chunks(raw)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all("usage" in c for c in chunks) and counts == sorted(counts)
    prompt = {c["usage"]["prompt_tokens"] for c in chunks}
    whole = frontend.request("POST", path, {**base, "stream": False})[1]
    assert prompt == {whole["usage"]["prompt_tokens"]}
    assert counts[-1] == whole["usage"]["completion_tokens"] > counts[0]
    # Without it, only include_usage's closing chunk has usage.
    status, raw = frontend.request(
        "POST", path, {**base, "stream_options": {"include_usage": True}}
    )
    assert ["usage" in c for c in _chunks(raw)][-2:] == [False, True]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_max_tokens_of_zero_is_a_400(frontend, field):
    status, body = frontend.request("POST", "/v1/chat/completions", {"messages": ASK, field: 0})
    assert status == 400 and body["error"]["param"] == field
