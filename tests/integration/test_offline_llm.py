"""vLLM's offline API: `LLM` starts a private stack (executor, scheduler, embedded Redis) as
child processes, generates and chats, and stops everything it started."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import psutil
import pytest

from client import LLM, SamplingParams
from tests.support.stack import ROOT, _env, llmserve_stack, tiny_model_dir  # noqa: F401


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("models"))


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_generate_and_chat_then_close_stops_the_stack(model_dir, capsys):
    before = _children()
    with LLM(str(model_dir)) as llm:
        started = _children() - before
        assert len(started) >= 2  # executor and scheduler (Redis under the scheduler)
        prompts = ["Hello", "The sky is", [5, 6, 7, 8]]
        params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
        outs = llm.generate(prompts, params)
        assert [len(o.outputs[0].token_ids) for o in outs] == [7, 7, 7]
        assert outs[0].prompt == "Hello" and outs[2].prompt_token_ids == [5, 6, 7, 8]
        # Same prompts again, one at a time: prompt order is kept and greedy is deterministic.
        again = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in again]
        chats = llm.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False)
        assert len(chats) == 1 and len(chats[0].outputs[0].token_ids) == 7
    assert not (started & _children()), "processes the LLM started are still running"

    # The bar's figures: input and output token rates over the same elapsed time, so their
    # ratio is the ratio of the tokens actually processed.
    err = capsys.readouterr().err
    found = re.findall(r"est\. speed input: ([\d.]+) toks/s, output: ([\d.]+) toks/s", err)
    assert found, err
    rate_in, rate_out = map(float, found[-1])
    num_in = sum(o.num_prompt_tokens for o in outs)
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert num_in > 0 and rate_out > 0
    assert rate_in / rate_out == pytest.approx(num_in / num_out, rel=0.02)


def test_interpreter_exit_stops_the_stack(model_dir):
    script = textwrap.dedent(
        f"""
        import psutil
        from client import LLM
        llm = LLM({str(model_dir)!r})
        print(" ".join(str(p.pid) for p in psutil.Process().children(recursive=True)), flush=True)
        # no close(): the interpreter's exit must stop the stack
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=_env(), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    pids = [int(p) for p in proc.stdout.split()]
    assert pids
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert not alive, f"still running after the interpreter exited: {alive}"


def test_connects_to_a_running_scheduler(llmserve_stack):  # noqa: F811
    with LLM(address=llmserve_stack.address) as llm:
        out = llm.generate("Hi", SamplingParams(max_tokens=3), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
    assert llmserve_stack.scheduler_proc.poll() is None  # not ours to stop


def test_draft_model_speculation_changes_no_output(model_dir, llmserve_stack):  # noqa: F811
    """``speculative_config`` with a draft model: the scheduler gets --speculative-config and
    the executor --speculative-model (here the model itself); the output is unchanged (the
    reference: the same tiny model on the module's plain stack, without speculation)."""
    prompts = ["Hello", [5, 6, 7, 8, 5, 6, 7, 8]]
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=4, max_tokens=12, ignore_eos=True),
    ]
    with LLM(address=llmserve_stack.address) as llm:
        plain = [llm.generate(prompts, p, use_tqdm=False) for p in params]
        assert llm._client.server_info().num_speculative_tokens == 0
    spec = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3,
            "disable_by_batch_size": 0}  # fmt: skip
    with LLM(str(model_dir), speculative_config=spec) as llm:
        drafted = [llm.generate(prompts, p, use_tqdm=False) for p in params]
        info = llm._client.server_info()
    for a, b in zip(plain, drafted, strict=True):
        assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert info.num_speculative_tokens == 3 and info.spec_decode_acceptance_rate > 0
