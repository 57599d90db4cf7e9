"""The one-call CPU decoder for bf16 models (models/cpu_decoder.py over csrc/decoder_bf16.cpp)
gives bit for bit the per-layer bf16 Python forward's logits, tokens and logprobs: decodes,
whole and chunked prefills and mixed batches with swaps, recompute and prefix hits; biases, a
tied embedding, GQA, random norm weights and biases, sizes off the kernels' 16-wide loops; one and two threads; every kernel
variant this CPU runs. Shapes it does not take (an odd input size) keep the per-layer forward.

Residual sums that cancel to denormals (the glue csrc/decoder_bf16.cpp runs on the kernels'
threads in the calling thread's floating-point mode) are torch's, bit for bit.

Mutation checks: a decoder given a bias the per-layer forward does not have is caught; glue run
with flush-to-zero fails the denormal test (checked by hand: docs/benchmarks.md, "Seventh
session")."""

from __future__ import annotations

import random

import pytest
import torch

from executor_svc.kernels import gemm_bf16, library
from executor_svc.models import cpu_decoder, llama
from executor_svc.runner.model_runner import ModelRunner, ScheduledSequence
from executor_svc.runner.sampler import SamplingParams
from tests.support.invariance import (
    mismatches,
    one_token_steps,
    random_batches,
    run_plan,
    whole_prefills,
)
from tests.support.model_factory import make_tiny_checkpoint
from tests.unit.test_step_invariance import (  # the autouse fixture: numerics step-invariant
    CASES,
    _deterministic,  # noqa: F401
    _model,
    _workload,
)

pytestmark = pytest.mark.skipif(not gemm_bf16.available(), reason="no C++ compiler here")


def _runner(model_dir) -> ModelRunner:
    """A bf16 runner whose norm weights and biases are random (the tiny checkpoints' are ones
    and zeros, which would hide a norm or bias taken from the wrong place)."""
    runner = ModelRunner(
        model_dir,
        device="cpu",
        dtype="bfloat16",
        block_size=4,
        num_device_blocks=1024,
        swap_space_gib=0.05,
        attention_backend="cpu",
    )
    gen = torch.Generator().manual_seed(7)
    for module in runner.model.modules():
        if isinstance(module, llama.RMSNorm):
            module.weight.data += 0.3 * torch.randn(module.weight.shape, generator=gen)
        elif isinstance(module, llama.Linear) and module.bias is not None:
            module.bias.data += 0.2 * torch.randn(module.bias.shape, generator=gen)
    return runner


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _run(runner: ModelRunner, fused: bool, monkeypatch, seqs, shared, seed: int) -> tuple:
    """The plans over ``seqs`` (one token a step, whole prefills, random mixed batches of chunks
    and decodes) with the fused decoder on or off; with it on, no layer's own forward runs."""
    monkeypatch.setenv("LLMSERVE_CPU_FUSED_DECODER", "1" if fused else "0")
    cpu_decoder.reset(runner.model)
    calls = []
    real = llama.DecoderLayer.forward
    with monkeypatch.context() as m:
        m.setattr(llama.DecoderLayer, "forward", lambda *a: calls.append(1) or real(*a))
        out = (
            run_plan(runner, seqs, one_token_steps),
            run_plan(runner, seqs, whole_prefills),
            run_plan(
                runner,
                seqs,
                random_batches(random.Random(seed), p_swap=0.1, p_recompute=0.1, shared=shared),
            ),
        )
    plan = runner.model._cpu_decoder_plan
    if fused:
        assert plan is not None and plan.dtype == torch.bfloat16 and not calls
    else:
        assert plan is None and calls
    return out


def _compare(model_dir, monkeypatch, seed: int, long: bool = False) -> None:
    runner = _runner(model_dir)
    seqs, shared = _workload(random.Random(seed), runner.info.vocab_size, 6, long)
    ref = _run(runner, False, monkeypatch, seqs, shared, seed)
    got = _run(runner, True, monkeypatch, seqs, shared, seed)
    for a, b in zip(ref, got, strict=True):
        bad = mismatches(a, b)
        assert not bad, f"{len(bad)} differences, first: {bad[:5]}"


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[3]], ids=["llama", "qwen2", "tied"])
def test_bf16_fused_decoder_equals_the_layer_by_layer_forward(
    tmp_path, monkeypatch, threads, case, num_threads
):
    threads(num_threads)
    seed = 11 + CASES.index(case)
    # The long shared-prefix sequences (past the attention kernel's 128-key chunk, prefix hits)
    # on one case; the short ones' prefills, chunks and decodes on every case. (Two threads on
    # the long ones took 34 s on a 2-core machine shared with another test run.)
    long = case is CASES[0] and num_threads == 1
    _compare(_model(tmp_path, *case, seed=seed), monkeypatch, seed, long=long)


def test_sizes_off_the_vector_width(tmp_path, monkeypatch, threads):
    """hidden 72, intermediate 40, 3 heads of 18 over one KV head: every kernel's tail loops."""
    threads(2)
    model_dir = make_tiny_checkpoint(
        tmp_path / "odd", "qwen2", seed=4, hidden_size=72, intermediate_size=40, head_dim=18,
        num_attention_heads=3, num_key_value_heads=1, vocab_size=131, initializer_range=0.2,
    )  # fmt: skip
    _compare(model_dir, monkeypatch, 4)


def test_an_odd_input_size_keeps_the_layer_forward(tmp_path, monkeypatch):
    """The bf16 GEMM takes an even K only (gemm_bf16.py pads an odd one per call)."""
    monkeypatch.setenv("LLMSERVE_CPU_FUSED_DECODER", "1")
    model_dir = make_tiny_checkpoint(
        tmp_path / "odd-k", "llama", seed=5, hidden_size=64, intermediate_size=45, vocab_size=97
    )
    runner = _runner(model_dir)
    run_plan(runner, _workload(random.Random(5), 97, 2, False)[0], one_token_steps)
    assert runner.model._cpu_decoder_plan is None


@pytest.mark.parametrize("name", list(library.VARIANTS))
def test_each_variant_gives_the_layer_forward_bits(tmp_path, monkeypatch, use_variant, name):
    use_variant(name)  # before the runner: its panels are packed for this variant
    _compare(_model(tmp_path, *CASES[1], seed=21), monkeypatch, 21)


def test_a_decoder_with_a_wrong_bias_is_caught(tmp_path, monkeypatch):
    """The comparison above can fail: the fused path with a bias of 1.0 on layer 1's o_proj
    (which the per-layer forward does not have) differs from it."""
    runner = _runner(_model(tmp_path, *CASES[0], seed=9))
    seqs = _workload(random.Random(9), runner.info.vocab_size, 2, False)[0]
    monkeypatch.setenv("LLMSERVE_CPU_FUSED_DECODER", "0")
    ref = run_plan(runner, seqs, one_token_steps)
    monkeypatch.setenv("LLMSERVE_CPU_FUSED_DECODER", "1")
    cpu_decoder.reset(runner.model)
    assert not mismatches(ref, run_plan(runner, seqs, one_token_steps))  # builds the plan
    plan = runner.model._cpu_decoder_plan
    bias = torch.ones(runner.model.config.hidden_size)
    plan.layers[1].o.bias = bias.data_ptr()
    plan.keep.append(bias)
    assert mismatches(ref, run_plan(runner, seqs, one_token_steps))


def _denormals(t: torch.Tensor) -> torch.Tensor:
    """Where a bf16 tensor holds a denormal (exponent bits 0, mantissa not)."""
    magnitude = t.view(torch.int16).to(torch.int32) & 0x7FFF
    return (magnitude > 0) & (magnitude < 0x80)


def test_residual_sums_that_cancel_to_denormals_are_torchs(tmp_path, monkeypatch, threads):
    """The last residual sum x + mlp(normed), the final norm's input, near 2**-126: the
    embeddings scaled to ~1e-37, o_proj zero (so the post-attention sum is x), down_proj one
    normal ~1e-38 weight per column. Some sums cancel to a denormal, which
    torch's add (no flush-to-zero) keeps. Two threads and a 160-token prefill: the fused
    decoder's glue runs on both workers (from 8192 elements, csrc/simd.h kParallelMin)."""
    threads(2)
    model_dir = make_tiny_checkpoint(tmp_path / "tiny", "llama", seed=3, vocab_size=256)
    runner = _runner(model_dir)
    model, cfg = runner.model, runner.model.config
    gen = torch.Generator().manual_seed(3)
    model.embed_tokens.data.mul_(1e-37)
    h, i = cfg.hidden_size, cfg.intermediate_size
    down = torch.zeros(i, h)
    mag = (1.5 + 3 * torch.rand(h, generator=gen)) * 1e-38  # normal fp32 and bf16
    sign = torch.randint(0, 2, (h,), generator=gen) * 2 - 1
    down[torch.randint(0, i, (h,), generator=gen), torch.arange(h)] = mag * sign
    for layer in model.layers:
        # rms(x) of x ~ 1e-37 is x / sqrt(eps) ~ 1e-34 (the squares underflow): a weight of
        # 1e34 gives the MLP inputs ~1, and so down_proj outputs ~1e-37.
        layer.post_attention_layernorm.weight.data.fill_(1e34)
        layer.self_attn.o_proj.packed = gemm_bf16.pack(
            torch.zeros(cfg.num_heads * cfg.head_dim, h, dtype=torch.bfloat16)
        )
        layer.mlp.down_proj.packed = gemm_bf16.pack(down.bfloat16())

    params, seqs = SamplingParams(), []
    for k in range(2):
        tokens = torch.randint(3, 256, (80,), generator=gen).tolist()
        seqs.append(
            ScheduledSequence(f"s{k}", tokens, 80, list(range(k * 24, k * 24 + 24)), 0, 80, params)
        )
    decode = [
        ScheduledSequence(s.seq_id, [*s.token_ids, 7], 80, s.block_table, 80, 1, params)
        for s in seqs
    ]

    def last_residuals(fused: bool) -> list[torch.Tensor]:
        monkeypatch.setenv("LLMSERVE_CPU_FUSED_DECODER", "1" if fused else "0")
        cpu_decoder.reset(model)
        seen: list[torch.Tensor] = []
        real_norm, real_fused = model.norm.forward, cpu_decoder.forward

        def fused_spy(m, x, *args):  # x is the residual stream, overwritten by the kernel
            out = real_fused(m, x, *args)
            if out is not None:
                seen.append(x.clone())
            return out

        with monkeypatch.context() as m:
            m.setattr(model.norm, "forward", lambda x: seen.append(x.clone()) or real_norm(x))
            m.setattr(cpu_decoder, "forward", fused_spy)
            runner.execute(seqs, [], [], [])
            runner.execute(decode, [], [], [])
        assert (model._cpu_decoder_plan is not None) == fused
        return seen

    ref, got = last_residuals(False), last_residuals(True)
    assert len(ref) == len(got) == 2
    assert _denormals(ref[0]).sum() > 50, "no sum cancelled to a denormal: the case tests nothing"
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
