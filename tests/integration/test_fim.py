"""Fill in the middle: `suffix` on /v1/completions (and the gRPC `infill` prompt) lays the prompt
out with the tokenizer's FIM tokens and generates the middle, exactly as HF generates from the
same ids; a model without FIM tokens answers a clear 400 / INVALID_ARGUMENT."""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import openai
import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from client import InfillPrompt, LLMClient, LLMServeError, SamplingParams
from scheduler_svc.local.redis_server import RedisServer
from tests.support.frontend import Frontend
from tests.support.stack import Stack, tiny_model_dir

FIM = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]
PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"


def _fim_checkpoint(root: Path) -> Path:
    """The tiny demo checkpoint with three FIM special tokens added (embedding rows grown to
    hold them, as a fine-tune adding tokens would)."""
    out = root / "tiny-fim"
    shutil.copytree(tiny_model_dir(root / "models"), out)
    model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    base = tok.get_vocab_size()
    assert tok.add_special_tokens(FIM) == 3
    tok.save(str(out / "tokenizer.json"))
    model.resize_token_embeddings(base + 3, mean_resizing=False)
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def fim_stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fim")
    redis = RedisServer(data_dir=tmp / "redis")
    redis.start()
    stack = Stack(
        workdir=tmp,
        model_dir=_fim_checkpoint(tmp),
        redis=redis,
        executor_args=["--num-device-blocks", "256", "--swap-space", "0.05", "--dtype", "float32"],
    )
    try:
        stack.start_executor()
        stack.start_scheduler()
        yield stack
    finally:
        stack.stop()
        redis.close()


@pytest.fixture(scope="module")
def fim_oai(fim_stack, tmp_path_factory):
    fe = Frontend.start(tmp_path_factory.mktemp("fim-frontend"), fim_stack.address)
    try:
        fe.wait_healthy()
        yield openai.OpenAI(base_url=fe.base_url + "/v1", api_key="unused", max_retries=0)
    finally:
        fe.stop()
        assert "Traceback" not in fe.log(), fe.log()


def _expected_ids(model_dir: Path) -> list[int]:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    pre, suf, mid = (tok.token_to_id(t) for t in FIM)
    head = tok.encode("", add_special_tokens=True).ids  # the demo tokenizer's BOS

    def text(t: str) -> list[int]:
        return tok.encode(t, add_special_tokens=False).ids

    return [*head, pre, *text(PREFIX), suf, *text(SUFFIX), mid]


def test_suffix_generates_the_middle_as_hf_does(fim_stack, fim_oai):
    ids = _expected_ids(fim_stack.model_dir)
    model = AutoModelForCausalLM.from_pretrained(fim_stack.model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, min_new_tokens=12
        )
    want = out[0, len(ids) :].tolist()

    r = fim_oai.completions.create(
        model=fim_oai.models.list().data[0].id,
        prompt=PREFIX,
        suffix=SUFFIX,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.prompt_tokens == len(ids)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with LLMClient(fim_stack.address) as client:
        (got,) = client.generate(InfillPrompt(PREFIX, SUFFIX), params, request_id_prefix="fim")
        stored = client.get_request(got.request_id)
    assert stored.prompt_token_ids == ids
    assert got.outputs[0].token_ids == want
    assert r.choices[0].text == got.outputs[0].text


def test_fim_names_inside_the_texts_stay_text(fim_stack):
    with LLMClient(fim_stack.address) as client:
        (got,) = client.generate(InfillPrompt("<fim_middle>", ""), SamplingParams(max_tokens=1))
        ids = client.get_request(got.request_id).prompt_token_ids
    tok = Tokenizer.from_file(str(fim_stack.model_dir / "tokenizer.json"))
    mid = tok.token_to_id("<fim_middle>")
    assert ids.count(mid) == 1  # only the layout's own, at the end
    assert ids[-1] == mid


def test_a_model_without_fim_tokens_refuses_suffix(frontend, llmserve_stack):
    oai = openai.OpenAI(base_url=frontend.base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=oai.models.list().data[0].id, prompt="a", suffix="b")
    assert "fill-in-the-middle" in e.value.message and "suffix" in e.value.message
    with LLMClient(llmserve_stack.address) as client, pytest.raises(LLMServeError) as g:
        client.generate(InfillPrompt("a", "b"), SamplingParams(max_tokens=1))
    assert g.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "fill-in-the-middle" in str(g.value)
