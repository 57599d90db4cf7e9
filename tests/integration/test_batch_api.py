"""The Batch API through the official `openai` client, on a real stack (Redis, executor,
scheduler) and a frontend given the stack's Redis: per-line validation, outputs equal to the
same requests sent interactively, cancel, and the completion window as a deadline."""

from __future__ import annotations

import io
import json
import time

import grpc
import openai
import pytest

from client import LLMClient, LLMServeError
from tests.support.batches import canonical, jsonl, line_body, read_lines, wait_batch
from tests.support.frontend import openai_client, running_frontend
from tests.support.stack import llmserve_stack  # noqa: F401 - the fixture


@pytest.fixture(scope="module")
def frontend_args(llmserve_stack) -> list[str]:  # noqa: F811
    return [
        "--redis-url", llmserve_stack.redis.url, "--batch-max-concurrency", "4",
        "--batch-max-file-mb", "0.05",
    ]  # fmt: skip


def _upload(oai, data: bytes):
    return oai.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")


def test_upload_reports_every_bad_line(oai):
    good = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}
    rows = [
        json.dumps(good),
        "{not json",
        json.dumps({**good, "custom_id": "b", "url": "/v1/images"}),
        json.dumps({**good}),  # custom_id "a" again
        json.dumps({**good, "custom_id": "c", "method": "GET"}),
        json.dumps({**good, "custom_id": "d", "body": {"prompt": "x", "stream": True}}),
        json.dumps({**good, "custom_id": ""}),
    ]
    with pytest.raises(openai.BadRequestError) as err:
        _upload(oai, "\n".join(rows).encode())
    message = err.value.body["message"]
    for n in ("line 2: not JSON", "line 3: url must be one of", "line 4: custom_id 'a' is used"):
        assert n in message
    assert "(and 1 more)" in message  # six errors: the first five shown, then the count
    assert err.value.body["param"] == "file"
    with pytest.raises(openai.BadRequestError, match="purpose"):
        oai.files.create(
            file=("in.jsonl", io.BytesIO(json.dumps(good).encode())), purpose="fine-tune"
        )
    with pytest.raises(openai.APIStatusError) as big:
        _upload(oai, b" " * 60_000)
    assert big.value.status_code == 413
    f = _upload(oai, json.dumps(good).encode())
    assert (f.purpose, f.bytes) == ("batch", len(json.dumps(good)))
    assert oai.files.retrieve(f.id).id == f.id
    assert oai.files.content(f.id).content == json.dumps(good).encode()
    assert oai.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        oai.files.retrieve(f.id)


def test_create_refuses_what_it_cannot_honour(oai, model):
    f = _upload(oai, jsonl(model, 1))
    for kwargs, param in (
        (dict(completion_window="forever"), "completion_window"),
        (dict(endpoint="/v1/images"), "endpoint"),
        (dict(extra_body={"priority": 3}), "priority"),
    ):
        args = dict(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        with pytest.raises(openai.BadRequestError) as err:
            oai.batches.create(**{**args, **kwargs})
        assert param in str(err.value.body)
    with pytest.raises(openai.NotFoundError):
        oai.batches.create(
            input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h"
        )


def _extra_lines(model: str) -> list[tuple[str, dict]]:
    """Lines with several choices, logprobs and base64 vectors: answers with more moving parts."""
    chat = {"model": model, "messages": [{"role": "user", "content": "Two tales"}]}
    return [
        ("/v1/chat/completions", {**chat, "n": 2, "temperature": 0.8, "seed": 7, "max_tokens": 6,
                                  "logprobs": True, "top_logprobs": 2}),
        ("/v1/completions", {"model": model, "prompt": "abc", "max_tokens": 5, "logprobs": 2,
                             "temperature": 0.7, "seed": 3, "ignore_eos": True}),
        ("/v1/embeddings", {"model": model, "input": ["one", "two"], "encoding_format": "base64"}),
    ]  # fmt: skip


def test_batch_lines_equal_interactive_answers(oai, model, frontend):
    lines = [line_body(i, model) for i in range(12)] + _extra_lines(model)
    rows = [
        {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}
        for i, (url, body) in enumerate(lines)
    ]
    f = _upload(oai, "".join(json.dumps(r) + "\n" for r in rows).encode())
    b = oai.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
        metadata={"job": "eq"},
    )  # fmt: skip
    assert b.status == "validating" and b.metadata == {"job": "eq"}
    b = wait_batch(oai, b.id, {"completed", "failed"})
    assert b.status == "completed", b
    counts = b.request_counts
    assert (counts.total, counts.completed, counts.failed) == (len(lines), len(lines), 0)
    assert b.error_file_id is None and b.completed_at >= b.in_progress_at >= b.created_at
    out = read_lines(oai, b.output_file_id)
    assert [x["custom_id"] for x in out] == [r["custom_id"] for r in rows]  # input order
    for (url, body), row in zip(lines, out, strict=True):
        status, want = frontend.request("POST", url, body)
        assert status == 200 and row["response"]["status_code"] == 200 and row["error"] is None
        assert canonical(row["response"]["body"]) == canonical(want), (row, want)
    assert len(out[12]["response"]["body"]["choices"]) == 2  # n=2 ran as two sequences
    # The list, newest first, paged with after/limit.
    later = oai.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="1h"
    )
    page = oai.batches.list(limit=1)
    assert [x.id for x in page.data] == [later.id] and page.has_more
    assert oai.batches.list(limit=1, after=later.id).data[0].id == b.id


def test_failed_lines_go_to_the_error_file(oai, model):
    rows = [
        {"custom_id": "ok", "method": "POST", "url": "/v1/completions",
         "body": {"model": model, "prompt": "hi", "max_tokens": 2}},
        {"custom_id": "bad", "method": "POST", "url": "/v1/completions",
         "body": {"model": model, "prompt": "hi", "max_tokens": -3}},
    ]  # fmt: skip
    f = _upload(oai, "".join(json.dumps(r) + "\n" for r in rows).encode())
    b = oai.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="1h")
    b = wait_batch(oai, b.id, {"completed", "failed"})
    assert (b.status, b.request_counts.completed, b.request_counts.failed) == ("completed", 1, 1)
    (ok,) = read_lines(oai, b.output_file_id)
    (bad,) = read_lines(oai, b.error_file_id)
    assert ok["custom_id"] == "ok" and bad["custom_id"] == "bad"
    assert bad["response"]["status_code"] == 400
    assert "max_tokens" in json.dumps(bad["response"]["body"])


def _long_batch(oai, model: str, n: int, window: str):
    # Every line a completion of 256 tokens: long enough that a cancel or a short window comes
    # while most still wait.
    data = jsonl(model, n, max_tokens=256).replace(b'"/v1/embeddings"', b'"/v1/completions"')
    data = data.replace(b'"input":', b'"max_tokens": 256, "ignore_eos": true, "prompt":')
    f = _upload(oai, data)
    return oai.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window=window
    )


def test_cancel_aborts_and_keeps_what_finished(oai, model, llmserve_stack):  # noqa: F811
    n = 100  # of 256 tokens each, 4 at a time: a cancel comes long before the last
    b = _long_batch(oai, model, n, "24h")
    deadline = time.monotonic() + 120
    while oai.batches.retrieve(b.id).request_counts.completed < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    c = oai.batches.cancel(b.id)
    assert c.status in ("cancelling", "cancelled")
    b = wait_batch(oai, b.id, {"cancelled"})
    done = b.request_counts.completed
    assert 2 <= done < n and b.request_counts.failed == 0, b
    assert b.cancelled_at >= b.cancelling_at, b
    out, err = read_lines(oai, b.output_file_id), read_lines(oai, b.error_file_id)
    assert len(out) == done and len(err) == n - done
    assert {e["error"]["code"] for e in err} == {"batch_cancelled"}
    assert sorted(x["custom_id"] for x in out + err) == sorted(f"req-{i}" for i in range(n))
    # On the scheduler: lines ran at the batch priority; those in flight at the cancel were
    # aborted there (one may have finished in the instant before its abort: reported cancelled
    # all the same, as its answer was never recorded), the rest never sent; none left running.
    with LLMClient(llmserve_stack.address, timeout=30) as grpc_client:
        ran = grpc_client.get_request(f"{b.id}-{out[0]['custom_id'].removeprefix('req-')}")
        assert ran.priority == -1 and ran.outputs[0].finish_reason == "length"
        reasons = []
        for e in err:
            try:
                state = grpc_client.get_request(f"{b.id}-{e['custom_id'].removeprefix('req-')}")
            except LLMServeError as x:
                assert x.code == grpc.StatusCode.NOT_FOUND
                continue
            assert state.finished, state
            reasons.append(state.outputs[0].finish_reason)
        assert "abort" in reasons and set(reasons) <= {"abort", "length"}, reasons
    with pytest.raises(openai.BadRequestError):
        oai.batches.cancel(wait_batch(oai, _long_batch(oai, model, 1, "1h").id, {"completed"}).id)


def test_completion_window_expires_the_batch(oai, model):
    b = _long_batch(oai, model, 60, "2s")
    b = wait_batch(oai, b.id, {"expired", "completed"}, timeout=60)
    assert b.status == "expired" and b.expired_at - b.created_at < 10
    out, err = read_lines(oai, b.output_file_id), read_lines(oai, b.error_file_id)
    assert len(out) == b.request_counts.completed and len(out) < 60
    assert {e["error"]["code"] for e in err} == {"batch_expired"} and len(out) + len(err) == 60


def test_a_batch_belongs_to_its_api_key(llmserve_stack, tmp_path_factory, model):  # noqa: F811
    tmp = tmp_path_factory.mktemp("batch-keys")
    (tmp / "keys").write_text("key-one alice\nkey-two bob\n")
    with running_frontend(
        tmp, llmserve_stack.address,
        "--redis-url", llmserve_stack.redis.url, "--api-key-file", str(tmp / "keys"),
    ) as fe:  # fmt: skip
        alice, bob = openai_client(fe, "key-one"), openai_client(fe, "key-two")
        f = _upload(alice, jsonl(model, 3))
        b = alice.batches.create(
            input_file_id=f.id, endpoint="/v1/completions", completion_window="1h"
        )
        # The runner acts with alice's key, found among the frontend's keys by its digest.
        b = wait_batch(alice, b.id, {"completed", "failed"})
        assert (b.status, b.request_counts.completed) == ("completed", 3)
        for call in (
            lambda: bob.batches.retrieve(b.id),
            lambda: bob.batches.cancel(b.id),
            lambda: bob.files.retrieve(f.id),
            lambda: bob.files.content(b.output_file_id),
            lambda: bob.batches.create(
                input_file_id=f.id, endpoint="/v1/completions", completion_window="1h"
            ),
        ):
            with pytest.raises(openai.NotFoundError):
                call()
        assert b.id not in [x.id for x in bob.batches.list().data]
        assert b.id in [x.id for x in alice.batches.list().data]
        with pytest.raises(openai.AuthenticationError):
            openai_client(fe, "nope").batches.list()


def test_an_upload_no_replica_acknowledged_is_a_503(llmserve_stack, tmp_path_factory):  # noqa: F811
    with running_frontend(
        tmp_path_factory.mktemp("batch-wait"), llmserve_stack.address,
        "--redis-url", llmserve_stack.redis.url, "--redis-min-replicas", "1",
        "--redis-replica-timeout-ms", "50",
    ) as fe:  # fmt: skip
        with pytest.raises(openai.APIStatusError) as err:
            _upload(openai_client(fe), jsonl("m", 1))
        assert err.value.status_code == 503 and "Redis" in err.value.body["message"]
