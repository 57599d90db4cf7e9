"""bf16 as a CPU dtype: the model against Hugging Face transformers, the step-invariance property
in bf16, and what ``--dtype auto`` picks.

Tolerances (measured; docs/internals.md "bf16 on the CPU"): a bf16 forward over the tiny random
models differs from HF's own fp32 by up to ~3.2 on logits of magnitude ~16 (HF bf16 against HF
fp32, the same order of error). Ours must stay within 1.3x of HF bf16's own distance to fp32, and
take HF bf16's argmax at >= 90 % of positions (ties in bf16 logits are common on these models).
"""

from __future__ import annotations

import random

import pytest
import structlog
import torch
from transformers import AutoModelForCausalLM

from executor_svc.config import numerics
from executor_svc.kernels import cpu_dtype, gemm_bf16, library
from executor_svc.runner.loader import resolve_dtype
from executor_svc.runner.model_runner import ModelRunner
from tests.support.invariance import mismatches, one_token_steps, run_plan, whole_prefills
from tests.support.model_factory import make_tiny_checkpoint
from tests.unit import test_step_invariance as inv
from tests.unit.test_model_equivalence import BLOCK_SIZE, all_token_logits, make_prompts

needs_kernel = pytest.mark.skipif(not gemm_bf16.available(), reason="no C++ compiler here")


def _hf(model_dir, dtype: torch.dtype):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_bf16_logits_follow_hf(tmp_path, arch):
    model_dir = make_tiny_checkpoint(tmp_path / arch, arch, seed=1)
    prompts = make_prompts([3, 9, 16, 17, 25, 1, 40, 12], seed=2)
    runner = ModelRunner(
        model_dir, device="cpu", dtype="bfloat16", block_size=BLOCK_SIZE, num_device_blocks=64
    )
    assert runner.backend.name == "cpu" and runner.kv_cache.key.dtype == torch.bfloat16
    assert isinstance(runner.model.layers[0].mlp.down_proj.packed, gemm_bf16.Bf16PanelWeight)
    ours = torch.cat(all_token_logits(runner, prompts)).float()
    hf16, hf32 = _hf(model_dir, torch.bfloat16), _hf(model_dir, torch.float32)
    with torch.no_grad():
        want16 = torch.cat([hf16(torch.tensor([p])).logits[0].float() for p in prompts])
        want32 = torch.cat([hf32(torch.tensor([p])).logits[0] for p in prompts])
    hf_error = (want16 - want32).abs().max()
    assert (ours - want32).abs().max() <= 1.3 * hf_error
    assert (ours.argmax(-1) == want16.argmax(-1)).float().mean() >= 0.9


@needs_kernel
@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("case", [inv.CASES[0], inv.CASES[2], inv.CASES[3]], ids=str)
def test_bf16_positions_invariant_to_grouping(tmp_path, case, backend):
    """tests/unit/test_step_invariance.py's property, bitwise, in bf16."""
    before = numerics.deterministic()
    numerics.set_deterministic(True)
    try:
        rng = random.Random(5)
        runner = ModelRunner(
            inv._model(tmp_path, *case, seed=5), device="cpu", dtype="bfloat16",
            block_size=inv.BLOCK_SIZE, num_device_blocks=1024, swap_space_gib=0.05,
            attention_backend=backend,
        )  # fmt: skip
        assert runner.info.dtype == torch.bfloat16
        seqs, shared = inv._workload(rng, runner.info.vocab_size, num_short=6, long=True)
        bad = inv._check(runner, seqs, shared, rng)
        assert not bad, f"{len(bad)} differences, first: {bad[:5]}"
    finally:
        numerics.set_deterministic(before)


@needs_kernel
def test_the_mutation_check_catches_a_bf16_row_count_dependence(tmp_path, monkeypatch):
    """The property above can fail: a bf16 GEMM whose order depends on the number of rows."""
    rng = random.Random(3)
    runner = ModelRunner(
        inv._model(tmp_path, *inv.CASES[0], seed=3), device="cpu", dtype="bfloat16",
        block_size=inv.BLOCK_SIZE, num_device_blocks=256, swap_space_gib=0.01,
    )  # fmt: skip
    honest = gemm_bf16.Bf16PanelWeight.linear

    def by_halves(self, x, bias):
        if x.shape[0] == 1:
            return honest(self, x, bias)
        return torch.cat(
            [honest(self, x[:1], bias), honest(self, x[1:], bias) * 1.01]
        )  # > a bf16 ulp

    monkeypatch.setattr(gemm_bf16.Bf16PanelWeight, "linear", by_halves)
    seqs, _ = inv._workload(rng, runner.info.vocab_size, num_short=4, long=False)
    bad = mismatches(
        run_plan(runner, seqs, one_token_steps), run_plan(runner, seqs, whole_prefills)
    )
    assert bad


def test_auto_is_bf16_only_where_the_cpu_has_bf16_dot_products(monkeypatch):
    monkeypatch.delenv("LLMSERVE_AUTO_CPU_DTYPE", raising=False)
    flags = set(library._cpu_features().split())
    native = bool(flags & set(cpu_dtype.BF16_CPU_FLAGS))
    with structlog.testing.capture_logs() as logs:
        got = resolve_dtype("auto", torch.device("cpu"))
    assert got == (torch.bfloat16 if native and gemm_bf16.available() else torch.float32)
    event = next(e for e in logs if e["event"] == "executor.dtype")
    assert event["dtype"] == str(got).removeprefix("torch.") and event["reason"]
    monkeypatch.setenv("LLMSERVE_AUTO_CPU_DTYPE", "float32")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16  # explicit wins


@needs_kernel
def test_describe_reports_the_auto_dtype_and_the_kernel_variant(tmp_path, monkeypatch):
    """An executor started with dtype "auto" serves bf16 on a CPU with AVX512-BF16 / AMX (fp32
    elsewhere) and says so in Describe, with its kernel variant."""
    from protos import executor_pb2 as pb
    from tests.support.executor_driver import executor_channel, running_executor

    monkeypatch.delenv("LLMSERVE_AUTO_CPU_DTYPE", raising=False)
    expected = cpu_dtype.auto_cpu_dtype()
    model_dir = make_tiny_checkpoint(tmp_path / "m", "llama", seed=1)
    kwargs = dict(device="cpu", dtype="auto", block_size=8, num_device_blocks=16)
    with running_executor(model_dir, **kwargs) as (_, port), executor_channel(port) as stub:
        info = stub.Describe(pb.DescribeRequest())
    assert info.dtype == str(expected).removeprefix("torch.")
    assert info.cpu_kernel_isa == library.variant() != ""
