"""Tensor parallelism inside one executor: 2 ranks on the CPU (gloo), over real gRPC.

Each case serves one tiny random checkpoint twice: `llmserve-executor --tensor-parallel-size 2`
(a subprocess: rank 0 serves, rank 1 is its worker) and an in-process TP = 1 executor. Both are
driven step by step like the scheduler drives them; greedy outputs must equal each other and
Hugging Face transformers, logprobs must agree within fp32 tolerance.

Cases: Llama with 4 heads / 2 KV heads (one KV head per rank), Qwen2 with biases, tied
embeddings and a single KV head (replicated on both ranks), Qwen3 with q/k norm, an explicit
head_dim, a single KV head and an odd vocabulary (the last rank's vocabulary shard is padded).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from protos import executor_pb2 as pb
from tests.integration.test_executor_grpc import RUNNER_KWARGS, Served
from tests.support.executor_driver import (
    ExecutorDriver,
    executor_channel,
    executor_subprocess,
    running_executor,
)
from tests.support.model_factory import make_tiny_checkpoint

MAX_NEW = 8
NUM_DEVICE_BLOCKS = 192
TP_ARGS = [
    "--device", "cpu", "--dtype", "float32", "--block-size", "4",
    "--num-device-blocks", str(NUM_DEVICE_BLOCKS), "--swap-space", "0.0005",
    "--attention-backend", "torch", "--tensor-parallel-size", "2", "--cpu-threads", "1",
]  # fmt: skip

CASES = {
    "llama-gqa": ("llama", {"num_key_value_heads": 2}),
    "qwen2-tied-1kv": ("qwen2", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "qwen3-1kv-odd-vocab": ("qwen3", {"num_key_value_heads": 1, "vocab_size": 509}),
}


def make_prompts(seed: int = 0) -> dict[str, list[int]]:
    """Prompts of 1 .. 29 tokens, ids clear of the special 0..2 and below every case's vocab."""
    rng = random.Random(seed)
    lengths = [1, 2, 5, 7, 10, 13, 17, 22, 29]
    return {f"p{i}": [rng.randrange(3, 509) for _ in range(n)] for i, n in enumerate(lengths)}


PROMPTS = make_prompts()


class TPCase(Served):
    """A TP = 2 executor (`port`) and a TP = 1 one (`tp1_port`) on the same checkpoint."""

    def __init__(self, model_dir: Path, port: int, tp1_port: int, vocab_size: int) -> None:
        super().__init__(model_dir, port, server=None)
        self.tp1_port = tp1_port
        self.vocab_size = vocab_size

    def hf_greedy(self, seq_id: str) -> list[int]:
        if seq_id not in self._greedy:
            self._greedy[seq_id] = self.hf_generate(PROMPTS[seq_id])
        return self._greedy[seq_id]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    arch, overrides = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    model_dir = make_tiny_checkpoint(tmp / "model", arch, **overrides)
    vocab_size = overrides.get("vocab_size", 512)
    with (
        executor_subprocess(model_dir, tmp, *TP_ARGS) as (_, port),
        running_executor(model_dir, **RUNNER_KWARGS) as (_, tp1_port),
    ):
        yield TPCase(model_dir, port, tp1_port, vocab_size)


def run_both(case: TPCase, scenario) -> tuple[object, object]:
    """`scenario(driver)` against the TP = 2 executor, then against the TP = 1 one."""
    results = []
    for port in (case.port, case.tp1_port):
        with executor_channel(port) as stub:
            stub.Reset(pb.ResetRequest())
            results.append(scenario(ExecutorDriver(stub)))
    return results[0], results[1]


def test_describe_reports_one_executor_of_two_ranks(case: TPCase) -> None:
    with executor_channel(case.port) as stub:
        info = stub.Describe(pb.DescribeRequest())
    assert info.tensor_parallel_size == 2
    assert info.num_device_blocks == NUM_DEVICE_BLOCKS
    assert info.vocab_size == case.vocab_size
    with executor_channel(case.tp1_port) as stub:
        assert stub.Describe(pb.DescribeRequest()).tensor_parallel_size == 1


def test_batched_greedy_matches_hf_and_tp1(case: TPCase) -> None:
    tp2, tp1 = run_both(case, lambda d: d.generate(PROMPTS, MAX_NEW))
    assert tp2 == tp1
    for seq_id, tokens in tp2.items():
        assert tokens == case.hf_greedy(seq_id), seq_id


def test_chunked_prefill_swap_and_copy_match_hf_and_tp1(case: TPCase) -> None:
    """Prompts prefilled in chunks while others decode, two sequences swapped out and back
    into other blocks, two copied to fresh blocks (the originals then reused): every rank
    applies each cache operation to its own heads, or the tokens go wrong."""

    def scenario(d: ExecutorDriver) -> dict[str, list[int]]:
        def before_step(i: int, d: ExecutorDriver) -> None:
            if i == 3:
                d.swap_out_seq("p4")
                d.swap_out_seq("p2")
            if i == 5:
                d.swap_in_seq("p4")
                d.swap_in_seq("p2")
            if i == 6:
                d.copy_seq_blocks("p7")
                d.copy_seq_blocks("p1")

        chunks = {"p8": 5, "p6": 3}
        return d.generate(PROMPTS, MAX_NEW, chunk_sizes=chunks, before_step=before_step)

    tp2, tp1 = run_both(case, scenario)
    assert tp2 == tp1
    for seq_id, tokens in tp2.items():
        assert tokens == case.hf_greedy(seq_id), seq_id


def test_logprobs_and_prompt_logprobs_close_to_hf(case: TPCase) -> None:
    params = pb.SamplingParams(num_logprobs=5, num_prompt_logprobs=3)
    prompts = {k: PROMPTS[k] for k in ("p1", "p5", "p8")}
    with executor_channel(case.port) as stub:
        stub.Reset(pb.ResetRequest())
        d = ExecutorDriver(stub)
        for seq_id, prompt in prompts.items():
            d.add(seq_id, prompt, params, chunk_size=6)  # p8's prompt logprobs in 5 chunks
        prompt_lps: dict[str, list[pb.PromptTokenLogprob]] = {k: [] for k in prompts}
        for _ in range(9):
            for r in d.step().prompt_logprobs:
                assert r.first_position == len(prompt_lps[r.seq_id]) + 1
                prompt_lps[r.seq_id].extend(r.entries)
    for seq_id, prompt in prompts.items():
        seq = d.seqs[seq_id]
        ref = case.hf_logprobs(seq.token_ids)  # [num_tokens, vocab]
        assert len(seq.outputs) >= 4
        for k, s in enumerate(seq.outputs):
            row = ref[len(prompt) - 1 + k]
            assert s.token_id == int(row.argmax())
            assert s.logprob == pytest.approx(float(row[s.token_id]), abs=1e-4)
            ref_top = torch.topk(row, 5)
            assert [t.token_id for t in s.top_logprobs] == ref_top.indices.tolist()
            got = [t.logprob for t in s.top_logprobs]
            assert got == pytest.approx(ref_top.values.tolist(), abs=1e-4)
        entries = prompt_lps[seq_id]
        assert len(entries) == len(prompt) - 1
        for p, e in enumerate(entries, start=1):
            assert e.logprob == pytest.approx(float(ref[p - 1, prompt[p]]), abs=1e-4)
            ref_top = torch.topk(ref[p - 1], 3)
            assert [t.token_id for t in e.top_logprobs] == ref_top.indices.tolist()


def test_seeded_sampling_equals_tp1(case: TPCase) -> None:
    params = pb.SamplingParams(temperature=1.0, top_p=0.95, seed=77)
    prompts = {k: PROMPTS[k] for k in ("p0", "p3", "p6")}
    tp2, tp1 = run_both(case, lambda d: d.generate(prompts, 12, params))
    assert tp2 == tp1
    assert len({tuple(t) for t in tp2.values()}) == 3


def test_the_command_lines_settings_reach_the_workers(tmp_path: Path) -> None:
    """--load-format dummy on a checkpoint without weights: rank 1 loads it only if rank 0
    handed it the flag (as a RuntimeFlags on its command line; nothing is written into the
    environment it inherits, and the variable is not set here)."""
    from executor_svc.demo.demo_model import build_demo_model

    model_dir = build_demo_model(tmp_path / "shape", size="tiny", weights=False)
    assert not list(model_dir.glob("*.safetensors"))
    env = {"LLMSERVE_LOAD_FORMAT": "auto", "LLMSERVE_DETERMINISTIC": "1"}
    args = [*TP_ARGS, "--load-format", "dummy", "--no-deterministic"]
    with (
        executor_subprocess(model_dir, tmp_path, *args, env=env) as (_, port),
        executor_channel(port) as stub,
    ):
        assert stub.Describe(pb.DescribeRequest()).tensor_parallel_size == 2
    log = (tmp_path / "executor.log").read_text()
    assert "tp.worker_ready" in log
