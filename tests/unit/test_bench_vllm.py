"""The `vllm` benchmark backend: records from the runner's result, CLI wiring, and (opt-in, with
$LLMSERVE_VLLM_PYTHON pointing at a vLLM virtualenv) a real run of vLLM's offline engine."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from client.bench.backends import make_backend
from client.bench.cli import main as bench_main
from client.bench.vllm_backend import VLLMBackend, _records
from client.bench.workloads import BenchRequest, random_workload

model_factory = pytest.importorskip("tests.support.model_factory")


def test_records_spread_tokens_between_first_and_last() -> None:
    reqs = [BenchRequest([1, 2, 3], 3), BenchRequest([4], 2)]
    out = {
        "duration_s": 2.0,
        "output_lens": [3, 1],
        "first_token_s": [0.5, 0.25],
        "finish_s": [1.5, 0.25],
    }
    first, second = _records(reqs, out)
    assert first.success and first.output_len == 3
    assert [t - first.start_time for t in first.token_times] == pytest.approx([0.5, 1.0, 1.5])
    assert first.end_time - first.start_time == pytest.approx(1.5)
    assert not second.success and second.error == "generated 1 of 2 tokens"


def test_records_without_request_times_end_with_the_run() -> None:
    out = {"duration_s": 3.0, "output_lens": [2], "first_token_s": None, "finish_s": None}
    (rec,) = _records([BenchRequest([1], 2)], out)
    assert rec.success
    assert [t - rec.start_time for t in rec.token_times] == pytest.approx([3.0, 3.0])


def test_backend_needs_its_python_and_a_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--vllm-python"):
        make_backend("vllm", model_dir=tmp_path, vllm={"python": None})
    with pytest.raises(ValueError, match="does not exist"):
        make_backend("vllm", model_dir=tmp_path, vllm={"python": str(tmp_path / "nope")})
    model = model_factory.make_tiny_checkpoint(tmp_path / "llama")
    backend = make_backend(
        "vllm", model_dir=model, max_batch_size=7, vllm={"python": sys.executable}
    )
    assert isinstance(backend, VLLMBackend)
    assert backend.limits() == (512, 512)
    assert backend.llm_args["max_num_seqs"] == 7 and backend.llm_args["dtype"] == "float32"
    assert backend.llm_args["skip_tokenizer_init"]  # the tiny checkpoint has no tokenizer
    with pytest.raises(ValueError, match="throughput mode only"):
        backend.run([BenchRequest([1], 1)], [0.5])


@pytest.mark.skipif(
    not os.environ.get("LLMSERVE_VLLM_PYTHON"), reason="set LLMSERVE_VLLM_PYTHON to run vLLM"
)
def test_real_vllm_generates_exact_lengths(tmp_path: Path) -> None:
    # vLLM's CPU attention needs a head_dim of 32 or more.
    model = model_factory.make_tiny_checkpoint(tmp_path / "llama", head_dim=64)
    backend = VLLMBackend(model, python=os.environ["LLMSERVE_VLLM_PYTHON"], kv_cache_gib=1)
    reqs = random_workload(
        4, input_len=10, output_len=5, range_ratio=0.5, vocab_size=512, max_model_len=512
    )
    records, duration = backend.run(reqs, [0.0] * 4, progress=False)
    assert duration > 0
    assert [r.output_len for r in records] == [r.output_len for r in reqs]
    out = tmp_path / "r.json"
    code = bench_main(
        ["throughput", "--backend", "vllm", "--model-dir", str(model), "--workload", "random",
         "--num-prompts", "2", "--input-len", "8", "--output-len", "3", "--no-progress",
         "--vllm-python", os.environ["LLMSERVE_VLLM_PYTHON"], "--vllm-kv-cache-gib", "1",
         "--output", str(out)]
    )  # fmt: skip
    assert code == 0 and out.exists()
