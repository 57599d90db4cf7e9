"""lm-eval, unmodified, through llmserve's OpenAI frontend gives what lm-eval's own Hugging Face
backend (`--model hf`) gives on the same checkpoint (SmolLM2-135M-Instruct, fp32): every
multiple-choice loglikelihood within 1e-4, every generated answer identical, the same accuracy.

Three local tasks (tests/data/lm_eval: YAMLs and JSONL, nothing downloaded): `llmserve_mc`
(loglikelihood of 4 choices) and `llmserve_gen` (generate_until) through `local-completions` with
token-id prompts, `llmserve_chat` (generate_until, chat template applied by the server) through
`local-chat-completions`. Real lm-eval, real transformers, real stack."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lm_eval
import pytest
import torch
from lm_eval.tasks import TaskManager

DATA = Path(__file__).resolve().parents[1] / "data" / "lm_eval"
COMPLETION_TASKS = ["llmserve_mc", "llmserve_gen"]
CHAT_TASKS = ["llmserve_chat"]


@pytest.fixture(scope="module")
def llmserve_stack(smollm2_stack):  # the frontend fixture's stack: SmolLM2 (conftest)
    return smollm2_stack


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """lm-eval's `hf` model computes in this process. On a small machine shared with the stack
    (and, on a developer's, other jobs), OpenMP threads waiting on busy cores made its
    generation 6x slower than one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _evaluate(model: str, model_args: dict[str, Any], tasks: list[str], **kwargs: Any) -> dict:
    # The YAMLs name their JSONL files relative to their own folder; `datasets` resolves them
    # against the working directory.
    with contextlib.chdir(DATA), _one_torch_thread():
        results = lm_eval.simple_evaluate(
            model=model,
            model_args=model_args,
            tasks=tasks,
            task_manager=TaskManager(include_path=str(DATA), include_defaults=False),
            log_samples=True,
            bootstrap_iters=0,
            **kwargs,
        )
    assert results is not None
    return results


@pytest.fixture(scope="module")
def hf_results(smollm2_dir) -> dict:
    args = {"pretrained": str(smollm2_dir), "dtype": "float32", "device": "cpu"}
    return _evaluate("hf", args, COMPLETION_TASKS, batch_size=1)


@pytest.fixture(scope="module")
def hf_chat_results(smollm2_dir) -> dict:
    args = {"pretrained": str(smollm2_dir), "dtype": "float32", "device": "cpu"}
    return _evaluate("hf", args, CHAT_TASKS, batch_size=1, apply_chat_template=True)


@pytest.fixture(scope="module")
def served_results(frontend, model, smollm2_dir) -> dict:
    args = {
        "base_url": f"{frontend.base_url}/v1/completions",
        "model": model,
        "tokenizer": str(smollm2_dir),
        "tokenizer_backend": "huggingface",
        "tokenized_requests": True,
        # Several prompts per request and several requests at once: the server batches them.
        "batch_size": 4,
        "num_concurrent": 2,
        "max_retries": 1,
    }
    return _evaluate("local-completions", args, COMPLETION_TASKS)


@pytest.fixture(scope="module")
def served_chat_results(frontend, model) -> dict:
    args = {
        "base_url": f"{frontend.base_url}/v1/chat/completions",
        "model": model,
        "num_concurrent": 2,
        "max_retries": 1,
    }
    return _evaluate("local-chat-completions", args, CHAT_TASKS, apply_chat_template=True)


def _samples(results: dict, task: str) -> list[dict]:
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def _answers(results: dict, task: str) -> list[str]:
    return [s["filtered_resps"][0] for s in _samples(results, task)]


def test_multiple_choice_loglikelihoods_match_hf(served_results, hf_results):
    served, hf = _samples(served_results, "llmserve_mc"), _samples(hf_results, "llmserve_mc")
    assert [s["doc_id"] for s in served] == [s["doc_id"] for s in hf] == list(range(15))
    max_diff = 0.0
    for got, want in zip(served, hf, strict=True):
        assert len(got["resps"]) == len(want["resps"]) == 4
        for (got_ll, got_greedy), (want_ll, want_greedy) in zip(
            (r[0] for r in got["resps"]), (r[0] for r in want["resps"]), strict=True
        ):
            assert math.isfinite(got_ll) and got_ll < 0
            assert got_ll == pytest.approx(want_ll, abs=1e-4), got["doc_id"]
            assert got_greedy == want_greedy, got["doc_id"]
            max_diff = max(max_diff, abs(got_ll - want_ll))
        assert got["acc"] == want["acc"] and got["acc_norm"] == want["acc_norm"], got["doc_id"]
    print(f"llmserve_mc: max |loglikelihood - hf| = {max_diff:.2e}")


def test_multiple_choice_accuracy_matches_hf(served_results, hf_results):
    got, want = served_results["results"]["llmserve_mc"], hf_results["results"]["llmserve_mc"]
    print(f"llmserve_mc acc: llmserve {got['acc,none']}, hf {want['acc,none']}")
    assert got["acc,none"] == want["acc,none"]
    assert got["acc_norm,none"] == want["acc_norm,none"]
    # Easy questions: a model that gets them right is scored (chance would be 0.25).
    assert got["acc,none"] >= 0.6


def test_generate_until_answers_match_hf(served_results, hf_results):
    got, want = _answers(served_results, "llmserve_gen"), _answers(hf_results, "llmserve_gen")
    assert len(got) == 12 and got == want
    assert all("\n" not in a for a in got)  # cut at the `until` string, by both
    acc = served_results["results"]["llmserve_gen"]["exact_match,none"]
    print(f"llmserve_gen exact_match: llmserve {acc}")
    assert acc == hf_results["results"]["llmserve_gen"]["exact_match,none"] > 0.5


def test_chat_answers_match_hf(served_chat_results, hf_chat_results):
    got = _answers(served_chat_results, "llmserve_chat")
    want = _answers(hf_chat_results, "llmserve_chat")
    assert len(got) == 12 and got == want
    assert "Rome" in got[0]
    acc = served_chat_results["results"]["llmserve_chat"]["acc,none"]
    print(f"llmserve_chat acc: llmserve {acc}")
    assert acc == hf_chat_results["results"]["llmserve_chat"]["acc,none"] >= 0.5
