"""The OpenAI-compatible frontend, driven by the official `openai` package and plain HTTP,
in front of a real stack (Redis, executor and scheduler processes on the tiny demo model)."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
import uuid

import openai
import pytest

from client import LLMClient, LLMServeError, SamplingParams
from tests.support.frontend import Frontend
from tests.support.stack import llmserve_stack  # noqa: F401 - the fixture

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def grpc_client(llmserve_stack):  # noqa: F811
    with LLMClient(llmserve_stack.address, timeout=30) as c:
        yield c


def _prompt_ids(grpc_client, prompt: str) -> list[int]:
    out = grpc_client.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    return grpc_client.get_request(out.request_id).prompt_token_ids


def test_models_lists_the_served_model(oai, grpc_client):
    models = oai.models.list().data
    assert [m.id for m in models] == [grpc_client.server_info().model]


def test_completion_matches_the_grpc_api(oai, grpc_client, model):
    want = grpc_client.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0]
    got = oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.object == "text_completion" and got.id.startswith("cmpl-")
    assert got.choices[0].text == want.outputs[0].text
    assert got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == want.num_prompt_tokens
    assert got.usage.completion_tokens == 12
    assert got.usage.total_tokens == got.usage.prompt_tokens + 12


def test_logit_bias_reaches_the_sampler(oai, grpc_client, model):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (free,) = grpc_client.generate([PROMPT], greedy, use_tqdm=False)
    bias = {free.outputs[0].token_ids[0]: -100.0, 9: 3.0}
    (want,) = grpc_client.generate([PROMPT], greedy.replace(logit_bias=bias), use_tqdm=False)
    assert want.outputs[0].token_ids != free.outputs[0].token_ids
    got = oai.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logit_bias={str(t): b for t, b in bias.items()},
        extra_body={"ignore_eos": True},
    )
    assert got.choices[0].text == want.outputs[0].text


def test_prompt_logprobs_as_vllm_returns_them(oai, frontend, grpc_client, model):
    ids = _prompt_ids(grpc_client, PROMPT)
    (want,) = grpc_client.generate(
        [ids], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False
    )
    got = oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    plp = got.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for pos in range(1, len(ids)):
        ref = want.prompt_logprobs[pos]
        assert set(plp[pos]) == {str(t) for t in ref}
        assert plp[pos][str(ids[pos])]["logprob"] == pytest.approx(ref[ids[pos]].logprob)
    chat = oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )
    plp = chat.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == chat.usage.prompt_tokens
    status, err = frontend.request(
        "POST", "/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}
    )
    assert status == 400 and err["error"]["param"] == "prompt_logprobs"


def test_streamed_completion_equals_the_whole_one_and_reports_usage(oai, model):
    args = dict(model=model, prompt=PROMPT, max_tokens=10, temperature=0)
    whole = oai.completions.create(**args).choices[0].text
    chunks = list(
        oai.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}


def test_several_prompts_and_token_prompts(oai, model, grpc_client):
    ids = _prompt_ids(grpc_client, PROMPT)
    got = oai.completions.create(
        model=model, prompt=[PROMPT, "Hello"], max_tokens=5, temperature=0, n=2
    )
    assert sorted(c.index for c in got.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in got.choices}
    assert by_index[0] == by_index[1]  # greedy: both sequences of a prompt agree
    from_ids = oai.completions.create(model=model, prompt=ids, max_tokens=5, temperature=0)
    assert from_ids.choices[0].text == by_index[0]


def test_echo_prepends_the_prompt(oai, model):
    got = oai.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    plain = oai.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0)
    assert got.choices[0].text == PROMPT + plain.choices[0].text


def test_completion_logprobs(oai, model):
    got = oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3
    ).choices[0]
    lp = got.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    if not any("\ufffd" in t for t in lp.tokens):  # no token holds part of a character
        assert "".join(lp.tokens) == got.text
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and value <= 0
        assert top[tok] == pytest.approx(value)  # greedy: the chosen token is the best one
        assert value == pytest.approx(max(top.values()))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]


def test_chat_whole_and_streamed_agree(oai, model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    args = dict(model=model, messages=messages, max_tokens=8, temperature=0)
    whole = oai.chat.completions.create(**args)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    msg = whole.choices[0].message
    assert msg.role == "assistant" and msg.content
    chunks = list(oai.chat.completions.create(**args, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_chat_content_parts_and_max_completion_tokens(oai, model):
    parts = [{"type": "text", "text": "Hi"}]
    a = oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": parts}], max_completion_tokens=5,
        temperature=0,
    )  # fmt: skip
    b = oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0
    )
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens <= 5


def test_chat_n_seed_and_logprobs(oai, model):
    args = dict(
        model=model, messages=[{"role": "user", "content": "Tell me"}], max_tokens=6,
        temperature=1.0, seed=1234, n=2, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    a = oai.chat.completions.create(**args)
    b = oai.chat.completions.create(**args)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len(a.choices) == 2
    for choice in a.choices:
        content = choice.logprobs.content
        assert len(content) == a.usage.completion_tokens // 2 or len(content) <= 6
        assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)
        # A token of part of a UTF-8 character reads as U+FFFD on its own; whole ones as text.
        assert all(e.token in choice.message.content for e in content if "\ufffd" not in e.token)


def test_stop_string(oai, model):
    base = oai.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    text = base.choices[0].text
    stop = text[3:6]
    assert stop.strip(), "the greedy output should have some text to stop on"
    got = oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop]
    ).choices[0]
    assert got.text == text[: text.index(stop)]
    assert got.finish_reason == "stop"


def test_tokenize_and_detokenize(frontend, grpc_client):
    status, body = frontend.request("POST", "/tokenize", {"prompt": PROMPT})
    assert status == 200 and body["count"] == len(body["tokens"]) > 0
    assert body["tokens"] == _prompt_ids(grpc_client, PROMPT)
    status, back = frontend.request("POST", "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and PROMPT in back["prompt"]
    status, chat = frontend.request(
        "POST", "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}
    )
    assert status == 200 and chat["count"] > 1


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"model": "no-such-model", "prompt": "x"}, 404, "does not exist"),
        ({"prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"prompt": "x", "logit_bias": {"five": 1.0}}, 400, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"99999999": 1}}, 400, "vocabulary"),
        ({"max_tokens": 3}, 400, "prompt"),
        ("{not json", 400, ""),
    ],
)
def test_bad_completion_requests_get_openai_errors(frontend, body, status, needle):
    got, err = frontend.request("POST", "/v1/completions", body)
    assert got == status, err
    assert set(err["error"]) >= {"message", "type", "param", "code"}
    assert needle in err["error"]["message"]
    assert "Traceback" not in err["error"]["message"]


def test_unknown_chat_role_is_400_through_the_official_client(oai, model):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model=model, messages=[{"role": "wizard", "content": "x"}], max_tokens=2
        )
    assert "role" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )


def test_unreachable_scheduler_is_503(tmp_path):
    fe = Frontend.start(tmp_path, "127.0.0.1:1")
    try:
        status, err = fe.request("POST", "/v1/completions", {"prompt": "x"})
        assert status == 503 and err["error"]["type"] == "service_unavailable"
        assert fe.request("GET", "/health")[0] == 503
    finally:
        fe.stop()


def test_same_request_id_attaches_instead_of_running_twice(frontend, oai, model):
    rid = f"retry-{uuid.uuid4().hex[:8]}"
    first = oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0,
        extra_headers={"X-Request-Id": rid},
    )  # fmt: skip
    # A retry of the same call (even with another body) gets the stored request's output.
    again = oai.completions.create(
        model=model, prompt="something else", max_tokens=6, temperature=0,
        extra_headers={"X-Request-Id": rid},
    )  # fmt: skip
    assert first.id == again.id == f"cmpl-{rid}"
    assert again.choices[0].text == first.choices[0].text


def _wait_aborted(grpc_client, rid: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = grpc_client.get_request(rid)
        if state.finished:
            return state
        time.sleep(0.05)
    raise AssertionError(f"{rid} still running {timeout}s after its client went away")


def _all_blocks_free(grpc_client, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = grpc_client.server_info()
        if info.num_running == 0 and all(
            e.num_free_blocks == e.num_device_blocks for e in info.executors
        ):
            return
        time.sleep(0.05)
    raise AssertionError(f"blocks not returned: {grpc_client.server_info()}")


def _num_tokens(grpc_client, rid: str) -> int:
    try:
        return sum(len(o.token_ids) for o in grpc_client.get_request(rid).outputs)
    except LLMServeError:
        return 0  # not submitted yet


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_request(frontend, grpc_client, stream):
    rid = f"gone-{uuid.uuid4().hex[:8]}"
    conn = http.client.HTTPConnection("127.0.0.1", frontend.port, timeout=30)
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": stream}
    conn.request(
        "POST", "/v1/completions", body=json.dumps(body),
        headers={"content-type": "application/json", "x-request-id": rid},
    )  # fmt: skip
    if stream:
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: ")  # it is running
    else:
        deadline = time.monotonic() + 20
        while _num_tokens(grpc_client, rid) == 0:  # wait until it is running
            assert time.monotonic() < deadline
            time.sleep(0.02)
    conn.sock.close()  # the client goes away
    conn.close()
    state = _wait_aborted(grpc_client, rid)
    assert state.outputs[0].finish_reason == "abort"
    assert len(state.outputs[0].token_ids) < 400
    _all_blocks_free(grpc_client)


def test_metrics_count_http_requests(frontend, oai, model):
    oai.models.list()
    status, text = frontend.request("GET", "/metrics")
    assert status == 200
    assert (
        'llmserve_frontend_http_requests_total{method="GET",route="/v1/models",status="200"}'
        in text
    )


@pytest.mark.parametrize("mode", ["throughput", "serve"])
def test_bench_openai_backend_beside_grpc(frontend, llmserve_stack, tmp_path, mode):  # noqa: F811
    out = tmp_path / f"{mode}.json"
    args = ["--workload", "random", "--input-len", "8", "--output-len", "6", "--num-prompts", "6"]
    if mode == "serve":
        args += ["--request-rate", "20"]
    res = subprocess.run(
        [sys.executable, "-m", "client.bench", mode, "--backend", "llmserve,openai", *args,
         "--address", llmserve_stack.address, "--base-url", f"{frontend.base_url}/v1",
         "--no-progress", "--output", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    report = json.loads(out.read_text())
    grpc_run, http_run = report["results"]
    assert (grpc_run["backend"], http_run["backend"]) == ("llmserve", "openai")
    for r in (grpc_run, http_run):
        assert r["completed"] == 6 and r["total_output_tokens"] == 36
        assert r["total_input_tokens"] == 48
    if mode == "serve":
        assert http_run["mean_ttft_ms"] > 0 and http_run["mean_tpot_ms"] > 0


def test_llmserve_health_command(frontend, llmserve_stack):  # noqa: F811
    """What the compose healthchecks run: exit 0 only when the target serves."""

    def health(target: str) -> int:
        return subprocess.run(
            [sys.executable, "-m", "client.cli", "health", target],
            capture_output=True,
            timeout=60,
        ).returncode

    assert health(llmserve_stack.address) == 0
    assert health(llmserve_stack.executor_address) == 0
    assert health(f"http://127.0.0.1:{frontend.port}/health") == 0
    assert health(f"http://127.0.0.1:{frontend.port}/no-such-page") == 1
    assert health("127.0.0.1:1") == 1
