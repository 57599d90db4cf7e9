"""The `hf` benchmark backend on a tiny checkpoint: both modes, through the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from client.bench.backends import HFBackend
from client.bench.cli import main as bench_main
from client.bench.workloads import random_workload

model_factory = pytest.importorskip("tests.support.model_factory")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_factory.make_tiny_checkpoint(tmp_path_factory.mktemp("bench") / "llama")


def test_static_batches_produce_exact_output_lengths(tiny_model_dir: Path) -> None:
    backend = HFBackend(tiny_model_dir, max_batch_size=3, device="cpu")
    assert backend.limits() == (512, 512)
    assert HFBackend.read_limits(tiny_model_dir) == (512, 512)
    reqs = random_workload(
        5, input_len=10, output_len=6, range_ratio=0.5, vocab_size=512, max_model_len=512, seed=2
    )
    assert len({r.output_len for r in reqs}) > 1  # the batch max differs from some requests
    records, duration = backend.run(reqs, [0.0] * len(reqs), progress=False)
    assert duration > 0
    for req, rec in zip(reqs, records, strict=True):
        assert rec.success, rec.error
        assert rec.output_len == req.output_len
        assert rec.token_times == sorted(rec.token_times)
        assert rec.start_time <= rec.token_times[0] and rec.end_time == rec.token_times[-1]
    # Requests 0-2 share the first batch and so their first token; 3-4 wait for the second.
    assert records[0].token_times[0] == records[2].token_times[0]
    assert records[3].token_times[0] > records[2].end_time


def test_batch_respects_model_length(tiny_model_dir: Path) -> None:
    backend = HFBackend(tiny_model_dir, max_batch_size=8, device="cpu")
    backend.max_model_len = 24  # a long prompt and a long output may not share a batch
    reqs = random_workload(2, input_len=4, output_len=4, vocab_size=512, max_model_len=512)
    reqs[0].prompt_token_ids = reqs[0].prompt_token_ids * 4  # 16 prompt + 4 output
    reqs[1].output_len = 16  # 4 prompt + 16 output; together 16 + 16 > 24
    records, _ = backend.run(reqs, [0.0, 0.0], progress=False)
    assert all(r.success for r in records)
    assert records[1].token_times[0] > records[0].end_time


def _bench(tmp_path: Path, model_dir: Path, *args: str) -> dict:
    out = tmp_path / "results.json"
    argv = [
        *args,
        "--backend", "hf",
        "--model-dir", str(model_dir),
        "--num-prompts", "4",
        "--max-batch-size", "2",
        "--no-progress",
        "--output", str(out),
    ]  # fmt: skip
    assert bench_main(argv) == 0
    assert out.with_suffix(".md").exists()
    return json.loads(out.read_text())


def test_throughput_mode_json(tmp_path: Path, tiny_model_dir: Path) -> None:
    report = _bench(
        tmp_path,
        tiny_model_dir,
        "throughput", "--workload", "random", "--input-len", "12", "--output-len", "5",
    )  # fmt: skip
    (result,) = report["results"]
    assert report["config"]["workload"] == "random"
    assert (result["backend"], result["mode"]) == ("hf", "throughput")
    assert (result["completed"], result["failed"]) == (4, 0)
    assert result["total_input_tokens"] == 48 and result["total_output_tokens"] == 20
    assert result["output_throughput"] == pytest.approx(20 / result["duration_s"])
    assert result["total_token_throughput"] > result["output_throughput"] > 0
    assert report["ratios"] == []


def test_serve_mode_json(tmp_path: Path, tiny_model_dir: Path) -> None:
    report = _bench(
        tmp_path,
        tiny_model_dir,
        "serve", "--workload", "shared-prefix", "--prefix-len", "16", "--question-len", "4",
        "--output-len", "4", "--request-rate", "50", "--slo", "ttft=60000", "tpot=60000",
    )  # fmt: skip
    (result,) = report["results"]
    assert result["mode"] == "serve" and result["request_rate"] == 50.0
    assert result["completed"] == 4 and result["total_output_tokens"] == 16
    for key in ("mean_ttft_ms", "p99_tpot_ms", "median_itl_ms", "mean_e2el_ms"):
        assert result[key] is not None and result[key] >= 0
    assert result["mean_e2el_ms"] >= result["mean_ttft_ms"]
    # Generous SLOs: every request meets them.
    assert result["goodput"] == pytest.approx(result["request_throughput"])


def test_serve_sweep_draws_plot(tmp_path: Path, tiny_model_dir: Path) -> None:
    report = _bench(
        tmp_path,
        tiny_model_dir,
        "serve", "--workload", "random", "--input-len", "8", "--output-len", "3",
        "--sweep", "20,inf",
    )  # fmt: skip
    assert [r["request_rate"] for r in report["results"]] == [20.0, "inf"]
    png = tmp_path / "results.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
