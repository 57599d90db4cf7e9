"""/v1/embeddings and the gRPC Embed end to end (official `openai` client -> frontend ->
scheduler -> executor, float32 on the CPU), against Hugging Face transformers' last hidden
state (after the final norm) of the same checkpoint; bitwise invariance of a vector to what it
is batched with and to chunked prefill; bad input as 400 / INVALID_ARGUMENT."""

from __future__ import annotations

import base64
import signal
import threading
import time

import grpc
import numpy as np
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from client import LLM, LLMClient, LLMServeError, SamplingParams
from protos import scheduler_pb2 as pb
from protos import scheduler_pb2_grpc as pb_grpc
from scheduler_svc.local.redis_server import RedisServer
from tests.support.frontend import running_frontend
from tests.support.stack import make_stack

EXECUTOR_ARGS = ["--num-device-blocks", "512", "--swap-space", "0.05", "--dtype", "float32"]
TEXTS = ["The quick brown fox jumps over the lazy dog", "Hello there", "embeddings!"]
IDS = [[5, 17, 42, 9, 88, 13, 61], [12, 7, 7, 30], [(7 * j) % 113 + 4 for j in range(41)]]
MAX_ABS = 1e-5
MIN_COS = 0.99999


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    r = RedisServer(data_dir=tmp_path_factory.mktemp("embed-redis"))
    r.start()
    try:
        yield r
    finally:
        r.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis):
    s = make_stack(tmp_path_factory.mktemp("embed"), redis, executor_args=EXECUTOR_ARGS)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def chunked(tmp_path_factory, redis):
    """A second stack whose steps hold 16 tokens: every input past 16 tokens is chunked."""
    s = make_stack(
        tmp_path_factory.mktemp("embed-chunked"),
        redis,
        executor_args=EXECUTOR_ARGS,
        scheduler_args=["--max-num-batched-tokens", "16", "--max-num-seqs", "16"],
    )
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def frontend(stack, tmp_path_factory):
    with running_frontend(tmp_path_factory.mktemp("embed-frontend"), stack.address) as fe:
        yield fe


@pytest.fixture(scope="module")
def grpc_client(stack):
    with LLMClient(stack.address, timeout=60) as c:
        c.wait_ready(60)
        yield c


@pytest.fixture(scope="module")
def hf_model(stack):
    return AutoModelForCausalLM.from_pretrained(stack.model_dir, dtype=torch.float32).eval()


def hf_embedding(
    model, ids: list[int], pooling: str = "last", normalize: bool = True, dims: int | None = None
) -> np.ndarray:
    """The reference: HF's last hidden state (after the final norm), pooled, in float32."""
    with torch.inference_mode():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0].float()
    vec = hidden[-1] if pooling == "last" else hidden.double().mean(0).float()
    if dims is not None:
        vec = vec[:dims]
    if normalize:
        vec = torch.nn.functional.normalize(vec, dim=0)
    return vec.numpy()


def assert_close(got, want: np.ndarray) -> tuple[float, float]:
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == want.shape
    diff = float(np.max(np.abs(got - want)))
    cos = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))
    assert diff <= MAX_ABS and cos >= MIN_COS, (diff, cos)
    print(f"max_abs_diff={diff:.3g} cosine={cos:.9f}")
    return diff, cos


def model_id(oai) -> str:
    return oai.models.list().data[0].id


def token_ids(grpc_client, text: str) -> list[int]:
    return grpc_client._run(grpc_client._async.tokenize(text))[0]


# ------------------------------------------------------------------------ against HF


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_token_id_inputs_match_hf(oai, hf_model, pooling, normalize):
    resp = oai.embeddings.create(
        model=model_id(oai),
        input=IDS,
        encoding_format="float",
        extra_body={"pooling": pooling, "normalize": normalize},
    )
    assert [d.index for d in resp.data] == [0, 1, 2]
    assert resp.usage.prompt_tokens == sum(map(len, IDS)) == resp.usage.total_tokens
    for d, ids in zip(resp.data, IDS, strict=True):
        assert_close(d.embedding, hf_embedding(hf_model, ids, pooling, normalize))


def test_batched_strings_default_last_pooling_normalized(oai, grpc_client, hf_model):
    resp = oai.embeddings.create(model=model_id(oai), input=TEXTS, encoding_format="float")
    assert len(resp.data) == len(TEXTS)
    ids = [token_ids(grpc_client, t) for t in TEXTS]
    assert resp.usage.prompt_tokens == sum(map(len, ids))
    for d, x in zip(resp.data, ids, strict=True):
        assert_close(d.embedding, hf_embedding(hf_model, x))
        assert abs(np.linalg.norm(d.embedding) - 1.0) < 1e-5


def test_single_string_and_single_token_list(oai, grpc_client, hf_model):
    one = oai.embeddings.create(model=model_id(oai), input=TEXTS[0], encoding_format="float")
    assert len(one.data) == 1
    assert_close(one.data[0].embedding, hf_embedding(hf_model, token_ids(grpc_client, TEXTS[0])))
    ids = oai.embeddings.create(model=model_id(oai), input=IDS[1], encoding_format="float")
    assert len(ids.data) == 1 and ids.usage.prompt_tokens == len(IDS[1])
    assert_close(ids.data[0].embedding, hf_embedding(hf_model, IDS[1]))


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_dimensions_truncate_before_normalizing(oai, hf_model, pooling):
    resp = oai.embeddings.create(
        model=model_id(oai),
        input=IDS[:2],
        dimensions=16,
        encoding_format="float",
        extra_body={"pooling": pooling},
    )
    for d, ids in zip(resp.data, IDS[:2], strict=True):
        assert len(d.embedding) == 16
        assert_close(d.embedding, hf_embedding(hf_model, ids, pooling, dims=16))


def test_base64_is_little_endian_float32_of_the_same_vector(oai, frontend, hf_model):
    # The openai client asks for base64 by default and decodes it itself.
    decoded = oai.embeddings.create(model=model_id(oai), input=IDS[0])
    assert_close(decoded.data[0].embedding, hf_embedding(hf_model, IDS[0]))
    status, body = frontend.request(
        "POST",
        "/v1/embeddings",
        {"input": IDS[0], "encoding_format": "base64", "dimensions": 8},
    )
    assert status == 200, body
    raw = base64.b64decode(body["data"][0]["embedding"])
    vec = np.frombuffer(raw, dtype="<f4")
    assert vec.shape == (8,)
    plain = oai.embeddings.create(
        model=model_id(oai), input=IDS[0], dimensions=8, encoding_format="float"
    )
    assert vec.tolist() == plain.data[0].embedding  # bitwise the same numbers


def test_models_list_the_tasks(oai, grpc_client):
    entry = oai.models.list().data[0]
    assert set(entry.model_extra["supported_tasks"]) == {"generate", "embed"}
    info = grpc_client.server_info()
    assert "embed" in info.tasks and info.hidden_size == 64


def test_offline_llm_embed_as_vllm(stack, grpc_client):
    with LLM(address=stack.address) as llm:
        outs = llm.embed(["Hello there", [5, 6, 7]], pooling="mean", dimensions=32)
    ref = grpc_client.embed(["Hello there", [5, 6, 7]], pooling="mean", dimensions=32)
    assert [len(o.outputs.embedding) for o in outs] == [32, 32]
    assert [o.outputs.embedding for o in outs] == [r.embedding for r in ref]
    assert outs[1].num_prompt_tokens == 3


# ------------------------------------------------------------------------ invariance


def _embed(client: LLMClient, inputs, pooling: str) -> list[np.ndarray]:
    return [
        np.asarray(o.embedding, dtype=np.float32) for o in client.embed(inputs, pooling=pooling)
    ]


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_vectors_do_not_depend_on_batching_or_chunking(stack, chunked, grpc_client, pooling):
    long_ids = IDS[2]  # 41 tokens: three chunks on the chunked stack
    alone = _embed(grpc_client, [long_ids], pooling)[0]
    hits = grpc_client.server_info().executors[0].prefix_cache_hits
    again = _embed(grpc_client, [long_ids], pooling)[0]
    assert again.tobytes() == alone.tobytes()
    # LAST took the prefix-cache hit (32 of 41 tokens cached); MEAN computed every token.
    new_hits = grpc_client.server_info().executors[0].prefix_cache_hits - hits
    assert new_hits == (32 if pooling == "last" else 0)
    # Beside running generations and in a batch of other inputs.
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            with LLMClient(stack.address, timeout=120) as c:
                c.generate(
                    [IDS[0], IDS[1], "a running generation"],
                    SamplingParams(max_tokens=48, temperature=0, ignore_eos=True),
                    use_tqdm=False,
                )
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=generate) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        batched = _embed(grpc_client, [IDS[0], long_ids, TEXTS[0], long_ids[:30]], pooling)
    finally:
        for t in threads:
            t.join()
    assert not errors, errors
    assert batched[1].tobytes() == alone.tobytes()
    # Under chunked prefill (16 tokens a step), alone and batched.
    with LLMClient(chunked.address, timeout=60) as c:
        c.wait_ready(60)
        chunked_alone = _embed(c, [long_ids], pooling)[0]
        chunked_batch = _embed(c, [TEXTS[1], long_ids, IDS[0]], pooling)
    assert chunked_alone.tobytes() == alone.tobytes()
    assert chunked_batch[1].tobytes() == alone.tobytes()
    # And the short input, alone and batched.
    assert _embed(grpc_client, [IDS[0]], pooling)[0].tobytes() == batched[0].tobytes()


def test_a_call_that_gives_up_leaves_nothing_behind(chunked):
    """A deadline passes mid-prefill (64 x 500 tokens at 16 a step: 2000 steps, seconds of
    work): its inputs are aborted at once, their blocks freed, and the next call is served."""
    inputs = [[(11 * j + k) % 200 + 3 for j in range(500)] for k in range(64)]
    with LLMClient(chunked.address, timeout=0.3) as c:
        with pytest.raises(LLMServeError) as info:
            c.embed(inputs, pooling="mean")
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    with LLMClient(chunked.address, timeout=60) as c:
        deadline = time.monotonic() + 2.0  # far less than computing the rest would take
        while time.monotonic() < deadline:
            info = c.server_info()
            if info.num_running == info.num_waiting == 0:
                break
            time.sleep(0.1)
        assert info.num_running == info.num_waiting == 0
        assert info.executors[0].num_free_blocks == info.executors[0].num_device_blocks
        assert len(c.embed([[1, 2, 3]])[0].embedding) == 64


# ------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": []}, "input", "empty"),
        ({"input": ""}, "input", "empty"),
        ({"input": [[1, 2], []]}, "input", "inputs[1] is empty"),
        ({"input": [1, 2], "dimensions": 0}, "dimensions", "dimensions"),
        ({"input": [1, 2], "dimensions": 65}, "dimensions", "[1, 64]"),
        ({"input": [1, 10**9]}, "input", "vocabulary"),
        ({"input": [[1, -2]]}, "input", "token ids"),
        ({"input": [1] * 5000}, "input", "maximum model length"),
        ({"input": [1, 2], "pooling": "cls"}, "pooling", "pooling"),
        ({"input": [1, 2], "encoding_format": "int8"}, "encoding_format", "encoding_format"),
    ],
)
def test_bad_input_is_a_400_in_the_openai_shape(frontend, body, param, words):
    status, reply = frontend.request("POST", "/v1/embeddings", body)
    assert status == 400, reply
    err = reply["error"]
    assert err["type"] == "invalid_request_error"
    assert words in err["message"] and param in (err["param"] or ""), err


def test_openai_client_raises_bad_request(oai):
    with pytest.raises(openai.BadRequestError):
        oai.embeddings.create(model=model_id(oai), input=[], encoding_format="float")


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        (pb.EmbedRequest(), "inputs must not be empty"),
        (pb.EmbedRequest(inputs=[pb.EmbedInput()]), "neither text nor token_ids"),
        (pb.EmbedRequest(inputs=[pb.EmbedInput(text="hi")], pooling=7), "pooling"),
        (pb.EmbedRequest(inputs=[pb.EmbedInput(text="hi")], dimensions=0), "dimensions"),
        (pb.EmbedRequest(inputs=[pb.EmbedInput(text="")]), "inputs[0] is empty"),
    ],
)
def test_grpc_bad_input_is_invalid_argument(stack, request_, words):
    with grpc.insecure_channel(stack.address) as channel, pytest.raises(grpc.RpcError) as info:
        pb_grpc.SchedulerStub(channel).Embed(request_, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in info.value.details() and "Traceback" not in info.value.details()


def test_client_errors_carry_the_status(grpc_client):
    with pytest.raises(LLMServeError) as info:
        grpc_client.embed([[1, 2]], dimensions=1000)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


# ------------------------------------------------------------------------ durability (last: restarts)


def test_an_executor_killed_mid_call_is_recomputed_to_the_same_vectors(chunked):
    """kill -9 of the executor while a call's inputs are mid-prefill: once it is back they are
    recomputed from scratch (MEAN's kept rows died with it) and the call gets the same vectors."""
    inputs = [[(13 * j + k) % 200 + 3 for j in range(300)] for k in range(24)]
    with LLMClient(chunked.address, timeout=120) as c:
        want = c.embed(inputs, pooling="mean")
        got: list = []
        call = threading.Thread(target=lambda: got.append(c.embed(inputs, pooling="mean")))
        call.start()
        time.sleep(0.3)
        assert call.is_alive()  # 450 steps of 16 tokens: still computing
        chunked.executor_proc.send_signal(signal.SIGKILL)
        chunked.executor_proc.wait()
        chunked.start_executor()
        call.join(120)
    assert got and [o.embedding for o in got[0]] == [o.embedding for o in want]


def test_a_call_during_a_scheduler_restart_is_retried_not_failed(stack, oai):
    """Embeddings are not stored: the frontend retries UNAVAILABLE and the scheduler that
    comes back recomputes the same vector, bit for bit."""
    model = model_id(oai)
    before = oai.embeddings.create(model=model, input=IDS[2], encoding_format="float")
    stack.kill_scheduler()
    got: list = []
    thread = threading.Thread(
        target=lambda: got.append(
            oai.embeddings.create(model=model, input=IDS[2], encoding_format="float")
        )
    )
    thread.start()
    time.sleep(1.0)  # the call meets no scheduler for a while
    stack.start_scheduler()
    thread.join(90)
    assert got and got[0].data[0].embedding == before.data[0].embedding
