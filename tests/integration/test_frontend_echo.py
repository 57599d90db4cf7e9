"""Loglikelihood scoring as evaluators do it (lm-eval's `local-completions`): /v1/completions with
`echo=true, logprobs=k, max_tokens=0` returns the prompt's tokens with their logprobs, checked
against Hugging Face transformers' log-softmax of the same checkpoint. Official `openai` package,
real stack and frontend on loopback."""

from __future__ import annotations

import math

import openai
import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI
from transformers import AutoModelForCausalLM, AutoTokenizer

from client import LLMClient, SamplingParams
from tests.support.stack import llmserve_stack  # noqa: F401 - the fixture

TEXT_PROMPTS = ["The quick brown fox jumps", "Hello there, general"]
ID_PROMPTS = [[5, 17, 42, 9, 88, 13, 61], [12, 7, 7, 30]]


@pytest.fixture(scope="module")
def hf_model(llmserve_stack):  # noqa: F811
    return AutoModelForCausalLM.from_pretrained(
        llmserve_stack.model_dir, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(llmserve_stack):  # noqa: F811
    return AutoTokenizer.from_pretrained(llmserve_stack.model_dir)


@pytest.fixture(scope="module")
def grpc_client(llmserve_stack):  # noqa: F811
    with LLMClient(llmserve_stack.address, timeout=30) as c:
        yield c


def _prompt_ids(grpc_client, prompt: str) -> list[int]:
    out = grpc_client.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    return grpc_client.get_request(out.request_id).prompt_token_ids


def _reference(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] log-softmax; row p predicts token p + 1."""
    with torch.inference_mode():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _assert_prompt_part(lp, ids: list[int], ref: torch.Tensor, k: int) -> None:
    """The first len(ids) entries are the prompt's: aligned, HF's logprobs, k alternatives."""
    n = len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[:n] == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for pos in range(1, n):
        want = float(ref[pos - 1, ids[pos]])
        assert math.isclose(lp.token_logprobs[pos], want, abs_tol=1e-4), pos
        top = lp.top_logprobs[pos]
        best = torch.topk(ref[pos - 1], k).indices.tolist()
        # k alternatives, plus the prompt's own token when it is not among them. Keys are
        # texts: byte-fallback tokens that decode alike ("\ufffd") share one key.
        want_values = [float(ref[pos - 1, t]) for t in {*best, ids[pos]}]
        if not any("\ufffd" in t for t in top):
            assert len(top) == len(want_values), (pos, top)
        assert 1 <= len(top) <= k + 1
        for value in top.values():
            assert any(math.isclose(value, w, abs_tol=1e-4) for w in want_values), (pos, top)
        assert max(top.values()) == pytest.approx(float(ref[pos - 1, best[0]]), abs=1e-4)


def _assert_scored(choice, ids: list[int], ref: torch.Tensor, echoed: str) -> None:
    lp = choice.logprobs
    assert choice.text == echoed and choice.finish_reason == "length"
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
    assert len(lp.text_offset) == len(ids)
    _assert_prompt_part(lp, ids, ref, 1)


def test_token_id_prompts_score_like_hf(oai, model, hf_model, hf_tokenizer):
    got = oai.completions.create(
        model=model, prompt=ID_PROMPTS, echo=True, logprobs=1, max_tokens=0, temperature=0
    )
    assert [c.index for c in got.choices] == [0, 1]  # batched prompts keep their order
    assert got.usage.completion_tokens == 0
    for choice, ids in zip(got.choices, ID_PROMPTS, strict=True):
        text = hf_tokenizer.decode(ids, skip_special_tokens=False)
        _assert_scored(choice, ids, _reference(hf_model, ids), text)
        assert choice.logprobs.tokens == [hf_tokenizer.decode([t]) for t in ids]


def test_single_token_id_prompt(oai, model, hf_model):
    ids = ID_PROMPTS[0]
    got = oai.completions.create(model=model, prompt=ids, echo=True, logprobs=1, max_tokens=0)
    assert len(got.choices) == 1
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(ids)
    _assert_prompt_part(lp, ids, _reference(hf_model, ids), 1)


def test_string_prompts_score_like_hf(oai, model, hf_model, grpc_client):
    got = oai.completions.create(
        model=model, prompt=TEXT_PROMPTS, echo=True, logprobs=1, max_tokens=0
    )
    assert [c.index for c in got.choices] == [0, 1]
    for choice, prompt in zip(got.choices, TEXT_PROMPTS, strict=True):
        ids = _prompt_ids(grpc_client, prompt)
        _assert_scored(choice, ids, _reference(hf_model, ids), prompt)


def test_one_generated_token_follows_the_prompt(oai, model, hf_model, grpc_client):
    prompt = TEXT_PROMPTS[0]
    ids = _prompt_ids(grpc_client, prompt)
    got = oai.completions.create(
        model=model, prompt=prompt, echo=True, logprobs=2, max_tokens=1, temperature=0
    )
    choice = got.choices[0]
    lp = choice.logprobs
    ref = _reference(hf_model, ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(ids) + 1
    _assert_prompt_part(lp, ids, ref, 2)
    # The generated token: greedy, so HF's best after the whole prompt, offset after the prompt.
    best = int(torch.argmax(ref[-1]))
    assert lp.token_logprobs[-1] == pytest.approx(float(ref[-1, best]), abs=1e-4)
    assert len(lp.top_logprobs[-1]) == 2
    assert lp.text_offset[-1] == sum(len(t) for t in lp.tokens[:-1])
    assert choice.text == prompt + lp.tokens[-1]
    assert got.usage.completion_tokens == 1


def test_every_one_of_n_choices_scores_the_prompt(oai, model):
    got = oai.completions.create(
        model=model, prompt=ID_PROMPTS, echo=True, logprobs=1, max_tokens=0, n=2
    )
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    for i, ids in enumerate(ID_PROMPTS):
        first, second = got.choices[2 * i], got.choices[2 * i + 1]
        assert first.finish_reason == second.finish_reason == "length"
        assert len(first.logprobs.tokens) == len(ids)
        assert first.logprobs == second.logprobs and first.text == second.text


def test_max_tokens_zero_needs_echo(oai, model):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt=TEXT_PROMPTS[0], max_tokens=0)
    assert "max_tokens" in str(e.value)


def test_max_tokens_zero_through_grpc_finishes_after_prefill(grpc_client):
    out = grpc_client.generate(
        [ID_PROMPTS[0]], SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False
    )[0]
    seq = out.outputs[0]
    assert seq.token_ids == [] and seq.text == "" and seq.finish_reason == "length"
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ID_PROMPTS[0])
    stored = grpc_client.get_request(out.request_id)
    assert stored.outputs[0].token_ids == [] and stored.status == "finished"


def test_streamed_echo_carries_the_same_logprobs(oai, model):
    kwargs = {"model": model, "prompt": ID_PROMPTS, "echo": True, "logprobs": 1, "temperature": 0}
    for max_tokens in (0, 2):
        whole = oai.completions.create(max_tokens=max_tokens, **kwargs)
        text: dict[int, str] = {}
        lps: dict[int, dict[str, list]] = {}
        for chunk in oai.completions.create(max_tokens=max_tokens, stream=True, **kwargs):
            for c in chunk.choices:
                text[c.index] = text.get(c.index, "") + c.text
                if c.logprobs is not None:
                    acc = lps.setdefault(c.index, {})
                    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                        acc.setdefault(key, []).extend(getattr(c.logprobs, key))
        for choice in whole.choices:
            assert text[choice.index] == choice.text
            assert lps[choice.index] == {
                "tokens": choice.logprobs.tokens,
                "token_logprobs": choice.logprobs.token_logprobs,
                "top_logprobs": choice.logprobs.top_logprobs,
                "text_offset": choice.logprobs.text_offset,
            }


def test_lm_eval_local_completions_scores_a_multiple_choice_doc(
    frontend,
    model,
    hf_model,
    llmserve_stack,  # noqa: F811
):
    # lm-eval's own `local-completions` model (a dev extra) asking the loglikelihood of each
    # choice of a multiple-choice doc, as a task's requests do; the answers must be HF's, so the
    # same choice wins. test_lm_eval.py runs whole tasks on a real model.
    lm = LocalCompletionsAPI(
        base_url=f"{frontend.base_url}/v1/completions",
        model=model,
        tokenizer=str(llmserve_stack.model_dir),
        tokenizer_backend="huggingface",
        max_retries=1,
    )
    context, choices = "The quick brown fox", [" jumps", " sleeps over", " is red"]
    doc = {"query": context, "choices": choices}
    requests = [
        Instance("loglikelihood", doc, (context, c), idx=i, metadata=("tiny_mc", 0, 1))
        for i, c in enumerate(choices)
    ]
    got = lm.loglikelihood(requests, disable_tqdm=True)
    want = []
    for c in choices:
        ctx_ids, cont_ids = lm._encode_pair(context, c)
        ids = ctx_ids + cont_ids
        ref = _reference(hf_model, ids)
        rows = ref[len(ctx_ids) - 1 : len(ids) - 1]
        score = float(rows.gather(1, torch.tensor(cont_ids)[:, None]).sum())
        greedy = rows.argmax(dim=-1).tolist() == cont_ids
        want.append((score, greedy))
    for (score, greedy), (want_score, want_greedy) in zip(got, want, strict=True):
        assert score == pytest.approx(want_score, abs=1e-3) and greedy == want_greedy
    assert max(range(3), key=lambda i: got[i][0]) == max(range(3), key=lambda i: want[i][0])
