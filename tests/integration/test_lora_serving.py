"""Multi-LoRA through the real services (Redis, scheduler and executor processes, gRPC).

PEFT adapters of ranks 8 to 64 on different target modules: each request's greedy output equals
HF + PEFT generate for its adapter, whether it runs alone or among the base model and the other
adapters (more adapters than --max-loras: split over steps); adapters load and unload live while
other requests run; unknown and malformed adapters get NOT_FOUND / INVALID_ARGUMENT; a request on
a live-loaded adapter survives a scheduler kill -9 and resumes on the same adapter, identically,
and the restarted scheduler still serves the adapter's name (kept in Redis) until it is unloaded.
"""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import openai
import pytest
import torch

from client import LLMClient, SamplingParams
from protos import scheduler_pb2 as pb
from tests.support.api_helpers import collect, gen_request, run_in_threads, stub_for
from tests.support.frontend import Frontend
from tests.support.lora_factory import SPECS, AdapterSpec, load_peft_reference, make_adapter
from tests.support.model_factory import load_hf_model, make_tiny_checkpoint
from tests.support.stack import serving_stack, tiny_model_dir

pytest.importorskip("peft")

MAX_TOKENS = 16
EXTRA = AdapterSpec("late16", 16, ("q_proj", "o_proj", "up_proj"), alpha=16, seed=9)


@pytest.fixture(scope="module")
def lora_stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-stack")
    model_dir = tiny_model_dir(tmp / "models")
    adapters = {s.name: make_adapter(model_dir, tmp / "adapters" / s.name, s) for s in SPECS}
    adapters[EXTRA.name] = make_adapter(model_dir, tmp / "adapters" / EXTRA.name, EXTRA)
    modules = [f"{n}={p}" for n, p in adapters.items() if n != EXTRA.name]
    executor_args = ["--num-device-blocks", "256", "--swap-space", "0.05", "--enable-lora",
                     "--max-loras", "3", "--max-cpu-loras", "4"]  # fmt: skip
    with serving_stack(tmp, model_dir, executor_args, ["--lora-modules", *modules]) as stack:
        yield stack, adapters


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 300, (6 + 5 * i,), generator=g).tolist() for i in range(n)]


def _reference(model_dir, adapter_dir, prompt: list[int]) -> list[int]:
    model = (
        load_hf_model(model_dir)
        if adapter_dir is None
        else load_peft_reference(model_dir, adapter_dir)
    )
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def _request(
    prompt: list[int], adapter: str | None, max_tokens=MAX_TOKENS, **kw
) -> pb.GenerateRequest:
    # min_tokens: EOS is suppressed as HF's min_new_tokens does in the reference.
    req = gen_request(
        prompt, max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw
    )
    req.lora_adapter = adapter or ""
    return req


def test_each_adapter_alone_and_mixed_equals_hf_peft(lora_stack):
    stack, adapters = lora_stack
    channel, stub = stub_for(stack.address)
    stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name=EXTRA.name, path=str(adapters[EXTRA.name])))
    names = [None, *adapters]  # the base model and 5 adapters; --max-loras is 3
    prompts = _prompts(len(names), seed=3)
    mixed = run_in_threads(
        [
            lambda p=p, n=n: collect(stub.Generate(_request(p, n)))
            for p, n in zip(prompts, names, strict=True)
        ]
    )
    for p, n, got in zip(prompts, names, mixed, strict=True):
        assert got.error is None, got.error
        want = _reference(stack.model_dir, adapters.get(n), p)
        assert got.tokens[0] == want, f"adapter {n}"
        alone = collect(stub.Generate(_request(p, n)))
        assert alone.tokens[0] == got.tokens[0], f"adapter {n} alone"
    # The adapters change the outputs (else this test would test nothing).
    assert len({tuple(c.tokens[0]) for c in mixed}) == len(names)
    info = stub.GetServerInfo(pb.GetServerInfoRequest())
    assert sorted(a.name for a in info.lora_adapters) == sorted(adapters)
    assert info.max_loras == 3
    channel.close()


def test_unknown_and_malformed_adapters_are_refused(lora_stack, tmp_path):
    stack, adapters = lora_stack
    channel, stub = stub_for(stack.address)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(_request([5, 6, 7], "nope")))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name="x", path=str(tmp_path / "missing")))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 128}')
    with pytest.raises(grpc.RpcError) as e:
        stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name="x", path=str(tmp_path)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "rank 128" in e.value.details()
    # Its config is fine; its tensors are for another base: the executor refuses it.
    other = make_tiny_checkpoint(tmp_path / "other", "llama", seed=1, hidden_size=32)
    wrong = make_adapter(other, tmp_path / "wrong", SPECS[0])
    with pytest.raises(grpc.RpcError) as e:
        stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name="wrong", path=str(wrong)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the base model needs" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(_request([5, 6, 7], "wrong")))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(name="nope"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    channel.close()


def test_live_load_and_unload_under_traffic(lora_stack):
    stack, adapters = lora_stack
    channel, stub = stub_for(stack.address)
    prompts = _prompts(6, seed=11)
    base_want = [_reference(stack.model_dir, None, p) for p in prompts]
    results: list = [None] * len(prompts)
    stop = threading.Event()

    def traffic():  # base-model requests, one after the other, while adapters come and go
        while not stop.is_set():
            for i, p in enumerate(prompts):
                results[i] = collect(stub.Generate(_request(p, None)))

    t = threading.Thread(target=traffic)
    t.start()
    try:
        name, path = "live", str(adapters["mlp8"])
        for _ in range(2):
            stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name=name, path=path))
            got = collect(stub.Generate(_request(prompts[0], name)))
            assert got.tokens[0] == _reference(stack.model_dir, path, prompts[0])
            stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(name=name))
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(_request(prompts[0], name)))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        stop.set()
        t.join(timeout=120)
    assert [r.tokens[0] for r in results] == base_want
    channel.close()


def test_adapter_request_survives_scheduler_kill_9(lora_stack):
    stack, adapters = lora_stack
    channel, stub = stub_for(stack.address)
    stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name="durable", path=str(adapters["all64"])))
    prompt = _prompts(1, seed=21)[0]
    n = 200
    want = collect(stub.Generate(_request(prompt, "durable", max_tokens=n)))
    assert want.error is None and len(want.tokens[0]) == n
    req = _request(prompt, "durable", max_tokens=n, request_id="lora-kill9", detached=True)
    stream = stub.Generate(req)
    first = next(iter(stream))
    assert first.token_ids
    channel.close()
    stack.kill_scheduler()
    time.sleep(0.2)
    # The request resumes on the adapter stored with it; and the restarted scheduler still
    # serves "durable" (loaded live: kept in Redis) to new requests.
    stack.start_scheduler()
    channel, stub = stub_for(stack.address)
    resumed = collect(stub.Resume(pb.ResumeRequest(request_id="lora-kill9")))
    assert resumed.error is None, resumed.error
    assert resumed.tokens[0] == want.tokens[0]
    names = [a.name for a in stub.GetServerInfo(pb.GetServerInfoRequest()).lora_adapters]
    assert "durable" in names
    again = collect(stub.Generate(_request(prompt, "durable", max_tokens=n)))
    assert again.error is None and again.tokens[0] == want.tokens[0]
    # Unloaded, it stays unloaded across the next restart.
    stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(name="durable"))
    channel.close()
    stack.kill_scheduler()
    time.sleep(0.2)
    stack.start_scheduler()
    channel, stub = stub_for(stack.address)
    names = [a.name for a in stub.GetServerInfo(pb.GetServerInfoRequest()).lora_adapters]
    assert "durable" not in names and "qv8" in names  # --lora-modules still loaded
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(_request(prompt, "durable")))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    channel.close()


def test_openai_frontend_serves_adapters_by_model_name(lora_stack, tmp_path):
    stack, adapters = lora_stack
    fe = Frontend.start(tmp_path / "frontend", stack.address)
    try:
        fe.wait_healthy()
        oai = openai.OpenAI(base_url=f"{fe.base_url}/v1", api_key="unused", max_retries=0)
        models = {m.id: m for m in oai.models.list().data}
        base = next(m for m in models.values() if getattr(m, "parent", None) is None)
        assert models["qv8"].parent == base.id and models["qv8"].root == str(adapters["qv8"])
        prompt = _prompts(1, seed=31)[0]
        want = _reference(stack.model_dir, adapters["qv8"], prompt)
        out = oai.completions.create(
            model="qv8",
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            extra_body={"min_tokens": MAX_TOKENS, "ignore_eos": True},
        )
        assert out.model == "qv8"
        http = httpx.Client(base_url=fe.base_url, timeout=30)
        text = http.post("/detokenize", json={"tokens": want}).json()["prompt"]
        assert out.choices[0].text == text
        base_out = oai.completions.create(
            model=base.id, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
            extra_body={"min_tokens": MAX_TOKENS, "ignore_eos": True},
        )  # fmt: skip
        assert base_out.choices[0].text != text
        with pytest.raises(openai.NotFoundError):
            oai.completions.create(model="nope", prompt=prompt, max_tokens=2)
        r = http.post(
            "/v1/load_lora_adapter",
            json={"lora_name": "fe", "lora_path": str(adapters["ku16"])},
        )
        assert r.status_code == 200, r.text
        assert "fe" in {m.id for m in oai.models.list().data}
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nope"})
        assert r.status_code == 404 and r.json()["error"]["message"]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "fe"}).status_code == 200
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "fe"})
        assert r.status_code == 404
    finally:
        fe.stop()


def test_python_client_takes_an_adapter_name(lora_stack):
    stack, adapters = lora_stack
    prompt = _prompts(1, seed=41)[0]
    want = _reference(stack.model_dir, adapters["mlp8"], prompt)
    params = SamplingParams(
        max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
    )
    with LLMClient(stack.address) as client:
        info = client.load_lora_adapter("client-mlp8", str(adapters["mlp8"]))
        assert (info.name, info.rank) == ("client-mlp8", 8)
        assert "client-mlp8" in {a.name for a in client.server_info().lora_adapters}
        out = client.generate([prompt], params, use_tqdm=False, lora_adapter="client-mlp8")
        assert out[0].outputs[0].token_ids == want
        client.unload_lora_adapter("client-mlp8")
        assert "client-mlp8" not in {a.name for a in client.server_info().lora_adapters}


def test_tensor_parallel_2_equals_hf_peft_and_tp1(lora_stack, tmp_path):
    """A second stack, its executor split over 2 ranks (A sharded like each layer's input, B
    like its output): the same greedy outputs as HF + PEFT (and so as TP=1 above)."""
    stack1, adapters = lora_stack
    modules = [f"{n}={p}" for n, p in adapters.items() if n != EXTRA.name]
    executor_args = ["--num-device-blocks", "128", "--swap-space", "0.05", "--enable-lora",
                     "--max-loras", "4", "--tensor-parallel-size", "2"]  # fmt: skip
    scheduler_args = ["--lora-modules", *modules]
    with serving_stack(tmp_path, stack1.model_dir, executor_args, scheduler_args) as stack:
        channel, stub = stub_for(stack.address)
        names = [None, "qv8", "all64", "mlp8", "ku16"]
        prompts = _prompts(len(names), seed=51)
        got = run_in_threads(
            [
                lambda p=p, n=n: collect(stub.Generate(_request(p, n)))
                for p, n in zip(prompts, names, strict=True)
            ]
        )
        for p, n, out in zip(prompts, names, got, strict=True):
            assert out.error is None, out.error
            assert out.tokens[0] == _reference(stack.model_dir, adapters.get(n), p), n
        channel.close()
