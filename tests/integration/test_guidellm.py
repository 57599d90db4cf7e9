"""guidellm, unmodified (its CLI in a subprocess), benchmarks llmserve's OpenAI frontend: a short
synchronous run over /v1/completions and a short concurrent one over /v1/chat/completions, with
synthetic prompts tokenized by the served model's own tokenizer (a local directory: nothing is
downloaded). Every request must complete, none may error, and each must have exactly the output
length asked for (guidellm sends `ignore_eos`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROMPT_TOKENS, OUTPUT_TOKENS = 32, 8


@pytest.fixture(scope="module")
def llmserve_stack(smollm2_stack):  # the frontend fixture's stack: SmolLM2 (conftest)
    return smollm2_stack


def _guidellm(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """The `guidellm` next to this interpreter, run in `cwd` (it may write files there)."""
    exe = Path(sys.executable).parent / "guidellm"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(
        [str(exe), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.parametrize(
    ("profile", "request_format", "num_requests"),
    [
        ("kind=synchronous", "/v1/completions", 4),
        ("kind=concurrent,streams=4", "/v1/chat/completions", 8),
    ],
    ids=["synchronous-completions", "concurrent-chat"],
)
def test_guidellm_run_completes_every_request(
    frontend,
    model,
    smollm2_dir,
    tmp_path,
    profile,
    request_format,
    num_requests,
):
    report = tmp_path / "benchmarks.json"
    done = _guidellm(
        tmp_path,
        "run",
        "--backend",
        f"kind=openai_http,target={frontend.base_url},model={model},"
        f"request_format={request_format}",
        "--profile",
        profile,
        "--constraint",
        f"kind=max_requests,count={num_requests}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
        "--tokenizer",
        f"kind=huggingface_auto,model={smollm2_dir}",
        "--output",
        f"kind=json,path={report}",
        "--disable-console-interactive",
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (bench,) = json.loads(report.read_text())["benchmarks"]
    assert bench["config"]["backend"]["request_format"] == request_format
    state, requests = bench["scheduler_state"], bench["requests"]
    assert state["errored_requests"] == state["cancelled_requests"] == 0
    assert requests["errored"] == requests["incomplete"] == []
    # guidellm's own counts can come up one short: its worker group drops a "completed" update
    # that overtakes the request's "in_progress" one (guidellm/scheduler/worker_group.py, "racing
    # terminal update"; seen once in CI: 3 of 4 with nothing errored or cancelled).
    assert num_requests - 1 <= state["successful_requests"] <= num_requests
    assert num_requests - 1 <= len(requests["successful"]) <= num_requests
    for r in requests["successful"]:
        assert r["output_tokens"] == OUTPUT_TOKENS, r["request_args"]
        assert r["prompt_tokens"] >= PROMPT_TOKENS and r["output"]
        assert r["time_to_first_token_ms"] > 0
    concurrency = bench["metrics"]["request_concurrency"]["successful"]["max"]
    if profile.startswith("kind=synchronous"):
        assert concurrency == 1
    else:
        assert concurrency >= 2  # the streams overlapped: the server ran them together
