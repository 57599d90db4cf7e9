"""Prefill/decode disaggregation (issue 47): executor P `--role prefill`, executor D `--role
decode`. Every request is prefilled (in chunks) on P, handed over with its KV to D after its
first token, and decodes there: the output is byte-identical to colocated serving (one `both`
executor) for greedy, seeded, logprobs, structured outputs and LoRA; no token is computed
again (`llmserve:prompt_tokens_recomputed` stays 0, `llmserve:requests_handed_off` counts each
request) and D never computes a prompt token. With P down, D serves everything alone
(availability first); a failed handoff leaves the request on P, output unchanged.

Real processes: Redis, the executors and the scheduler, the tiny demo model.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from protos import scheduler_pb2 as pb
from scheduler_svc.local.redis_server import RedisServer
from tests.support.api_helpers import collect, gen_request, mixed_workload, run_in_threads, stub_for
from tests.support.lora_factory import SPECS, make_adapter
from tests.support.prom import free_port, scrape, total
from tests.support.stack import Stack, serving_stack, start_two_executor_stack, tiny_model_dir

pytest.importorskip("peft")

MAX_TOKENS = 24
EXECUTOR_ARGS = ["--num-device-blocks", "512", "--swap-space", "0.01", "--enable-lora",
                 "--max-loras", "2", "--max-cpu-loras", "2"]  # fmt: skip
# Small steps: the longer prompts are prefilled in several chunks.
SCHEDULER_ARGS = ["--max-num-batched-tokens", "64", "--max-num-seqs", "32"]


def workload(prefix: str) -> list[pb.GenerateRequest]:
    """Greedy and seeded prompts of 4 to 150 tokens (chunked), with logprobs, structured
    outputs (text prompts) and two LoRA adapters."""
    reqs = mixed_workload(prefix, 12, MAX_TOKENS, rng_seed=7, max_prompt_len=150)
    for i, r in enumerate(reqs[:4]):
        r.params.logprobs = 2 + i % 2
    reqs[4].lora_adapter = SPECS[0].name
    reqs[5].lora_adapter = SPECS[1].name
    shapes = [
        pb.StructuredOutput(regex=r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"),
        pb.StructuredOutput(json_schema='{"type": "array", "items": {"type": "boolean"}}'),
    ]
    for i, spec in enumerate(shapes):
        params = dict(max_tokens=40, structured_output=spec, temperature=0.7 * i, seed=3 + i)
        reqs.append(gen_request(text="json please " * 8, request_id=f"{prefix}-so{i}", **params))
    return reqs


def run(stub, reqs: list[pb.GenerateRequest]) -> list:
    out = run_in_threads([lambda r=r: collect(stub.Generate(r, timeout=120)) for r in reqs])
    for r, got in zip(reqs, out, strict=True):
        assert got.error is None, (r.request_id, got.error)
        assert got.offsets_ok, r.request_id
    return out


def same(got: list, want: list) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.tokens == w.tokens, i
        assert g.logprobs == w.logprobs, i
        assert g.text == w.text and g.finish == w.finish, i


@pytest.fixture(scope="module")
def model_and_adapters(tmp_path_factory) -> tuple[Path, list[str]]:
    tmp = tmp_path_factory.mktemp("pd-model")
    model_dir = tiny_model_dir(tmp / "models")
    modules = [
        f"{s.name}={make_adapter(model_dir, tmp / 'adapters' / s.name, s)}" for s in SPECS[:2]
    ]
    return model_dir, modules


@pytest.fixture(scope="module")
def colocated(tmp_path_factory, model_and_adapters) -> list:
    """The workload's outputs on one `both` executor."""
    model_dir, modules = model_and_adapters
    tmp = tmp_path_factory.mktemp("colocated")
    with serving_stack(
        tmp, model_dir, EXECUTOR_ARGS, [*SCHEDULER_ARGS, "--lora-modules", *modules]
    ) as stack:
        channel, stub = stub_for(stack.address)
        with channel:
            return run(stub, workload("w"))


class PD:
    def __init__(self, p: Stack, d: Stack, metrics_port: int) -> None:
        self.p, self.d, self.metrics_port = p, d, metrics_port
        self.channel, self.stub = stub_for(p.address)

    def metric(self, name: str) -> float:
        return total(scrape(self.metrics_port), name)

    def executors(self) -> dict[str, pb.ExecutorInfo]:
        info = self.stub.GetServerInfo(pb.GetServerInfoRequest())
        return {"p" if e.address == self.p.executor_address else "d": e for e in info.executors}

    def wait_healthy(self, which: str, healthy: bool) -> None:
        deadline = time.monotonic() + 30
        while self.executors()[which].healthy != healthy:
            assert time.monotonic() < deadline, f"{which} never became healthy={healthy}"
            time.sleep(0.02)

    def scheduler_log(self) -> str:
        return (self.p.workdir / "scheduler.log").read_text(errors="replace")


@contextmanager
def pd_stack(tmp: Path, model_and_adapters) -> Iterator[PD]:
    model_dir, modules = model_and_adapters
    redis = RedisServer(data_dir=tmp / "redis")
    redis.start()
    port = free_port()
    p, d = start_two_executor_stack(
        tmp,
        redis,
        [*EXECUTOR_ARGS, "--role", "prefill"],
        second_args=[*EXECUTOR_ARGS, "--role", "decode"],
        scheduler_args=[*SCHEDULER_ARGS, "--lora-modules", *modules, "--metrics-port", str(port)]
        + ["--log-level", "info"],
        model_dir=model_dir,
    )
    pd = PD(p, d, port)
    try:
        yield pd
    except BaseException:
        print(p.logs(), d.logs())
        raise
    finally:
        pd.channel.close()
        for proc in (p.executor_proc, d.executor_proc):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
        p.stop()
        d.stop()
        redis.close()


def test_pd_output_equals_colocated_and_decode_never_prefills(
    tmp_path, model_and_adapters, colocated
):
    with pd_stack(tmp_path, model_and_adapters) as pd:
        ex = pd.executors()
        assert (ex["p"].role, ex["d"].role) == ("prefill", "decode")
        reqs = workload("w")
        same(run(pd.stub, reqs), colocated)
        ex = pd.executors()
        assert ex["d"].num_prefill_tokens == 0
        assert ex["p"].num_prefill_tokens >= sum(len(r.token_ids.ids) for r in reqs)
        assert pd.metric("llmserve:requests_handed_off_total") == len(reqs)
        assert pd.metric("llmserve:prompt_tokens_recomputed_total") == 0
        assert "request.handoff_failed" not in pd.scheduler_log()
        # Both caches hold the prompts' blocks: a repeat is a prefix hit on P (routing) and
        # the hand-over moves nothing D already has; the output is still the same.
        hits_before = ex["p"].prefix_cache_hits
        same(run(pd.stub, workload("again")), colocated)
        ex = pd.executors()
        assert ex["p"].prefix_cache_hits > hits_before and ex["d"].num_prefill_tokens == 0
        assert pd.metric("llmserve:requests_handed_off_total") == 2 * len(reqs)


def test_with_the_prefill_executor_down_the_decode_executor_serves_alone(
    tmp_path, model_and_adapters, colocated
):
    with pd_stack(tmp_path, model_and_adapters) as pd:
        pd.p.executor_proc.send_signal(signal.SIGSTOP)
        pd.wait_healthy("p", False)
        same(run(pd.stub, workload("w")), colocated)
        assert pd.executors()["d"].num_prefill_tokens > 0
        assert pd.metric("llmserve:requests_handed_off_total") == 0


def test_a_failed_handoff_leaves_the_request_on_the_prefill_executor(
    tmp_path, monkeypatch, model_and_adapters, colocated
):
    monkeypatch.setenv("LLMSERVE_FAILPOINTS", "engine.migrate=1")  # the first move fails
    with pd_stack(tmp_path, model_and_adapters) as pd:
        reqs = workload("w")
        same(run(pd.stub, reqs), colocated)
        assert "request.handoff_failed" in pd.scheduler_log()
        handed_off = pd.metric("llmserve:requests_handed_off_total")
        assert 0 < handed_off < len(reqs)
        assert pd.metric("llmserve:prompt_tokens_recomputed_total") == 0
        assert pd.executors()["d"].num_prefill_tokens == 0
