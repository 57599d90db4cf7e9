"""The one-call CPU decoder (models/cpu_decoder.py over csrc/decoder.cpp) gives bit for bit the
per-layer Python forward's logits, tokens and logprobs: every weight form it takes (fp32 panels,
plain fp32 matrices, int8 / int4 blocks in the split layout with fp32 or the opt-in int8
activations, K-quant blocks), biases, a tied embedding, GQA, prefill chunks and decodes in random
batches with swaps, recompute and prefix hits. Models it does not take (q/k norm, LoRA slots) keep
the per-layer forward.

Mutation check: a decoder that skips one layer's residual add is caught."""

from __future__ import annotations

import random

import pytest
import torch

from executor_svc.attention import cpu_ops
from executor_svc.features.lora.layers import LoraStep
from executor_svc.features.lora.manager import install_slots
from executor_svc.kernels import quant
from executor_svc.models import cpu_decoder
from executor_svc.runner.model_runner import ModelRunner
from tests.support.invariance import mismatches, one_token_steps, random_batches, run_plan
from tests.support.model_factory import make_tiny_checkpoint
from tests.unit.test_quant_kernels import random_blocks
from tests.unit.test_step_invariance import (  # the autouse fixture: numerics step-invariant
    CASES,
    _deterministic,  # noqa: F401
    _model,
    _workload,
)

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler for the kernels")


def _runner(model_dir, **kwargs) -> ModelRunner:
    return ModelRunner(
        model_dir,
        device="cpu",
        dtype="float32",
        block_size=4,
        num_device_blocks=1024,
        swap_space_gib=0.05,
        attention_backend="cpu",
        **kwargs,
    )


def _k_quant_mlp(runner: ModelRunner) -> None:
    """Random Q4_K / Q6_K blocks in every MLP projection (the GGUF-block kernel's weights)."""
    for i, layer in enumerate(runner.model.layers):
        for name, type_name in (("gate_up_proj", "Q4_K"), ("down_proj", "Q6_K")):
            linear = getattr(layer.mlp, name)
            k = linear.packed.panels.shape[1]
            n = linear.packed.out_features
            raw = torch.from_numpy(random_blocks(type_name, n, k, seed=i))
            linear.packed = quant.QuantWeight(raw, quant.TYPE_IDS[type_name], k)
    cpu_decoder.reset(runner.model)


def _use(runner: ModelRunner, fused: bool, monkeypatch) -> ModelRunner:
    """``runner`` set to take the fused decoder or not (the switch is read at its first forward)."""
    monkeypatch.setenv("LLMSERVE_CPU_FUSED_DECODER", "1" if fused else "0")
    cpu_decoder.reset(runner.model)
    return runner


def _compare(runners, monkeypatch, seed: int, shared_prefix: bool = True) -> None:
    rng = random.Random(seed)
    seqs, shared = _workload(rng, runners[True].info.vocab_size, num_short=8, long=shared_prefix)
    results = {}
    for fused, runner in runners.items():
        _use(runner, fused, monkeypatch)
        results[fused] = (
            run_plan(runner, seqs, one_token_steps),
            run_plan(runner, seqs, random_batches(random.Random(seed), p_swap=0.1, shared=shared)),
        )
        assert (runner.model._cpu_decoder_plan is not None) == fused
    for ref, got in zip(results[False], results[True], strict=True):
        bad = mismatches(ref, got)
        assert not bad, f"{len(bad)} differences, first: {bad[:5]}"


WEIGHTS = ["panels", "plain", "int8", "int4", "k-quants", "int4-act8"]


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[3]], ids=["llama", "qwen2", "tied"])
def test_fused_decoder_equals_the_layer_by_layer_forward(tmp_path, monkeypatch, case, weights):
    seed = 5 + WEIGHTS.index(weights)
    if weights in ("panels", "plain"):
        model_dir = _model(tmp_path, *case, seed=seed)
    else:  # every input size a multiple of 32 (256 for the K-quants)
        arch, tied, head_dim, heads, kv_heads = case
        model_dir = make_tiny_checkpoint(
            tmp_path / "q", arch, seed=seed, tie_word_embeddings=tied, head_dim=head_dim,
            num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=509,
            hidden_size=256, intermediate_size=512, initializer_range=0.2,
        )  # fmt: skip
    if weights == "plain":
        monkeypatch.setenv("LLMSERVE_PREPACK", "0")
    if weights == "int4-act8":  # the opt-in int8 activations (kernels/quant.py)
        monkeypatch.setenv("LLMSERVE_QUANT_ACT", "int8")
        weights = "int4"
    kwargs = {"quantization": weights} if weights in ("int8", "int4") else {}
    runners = {fused: _runner(model_dir, **kwargs) for fused in (False, True)}
    if weights == "k-quants":
        for runner in runners.values():
            _k_quant_mlp(runner)
    # The long shared-prefix sequences (past the attention kernel's 128-key chunk, prefix hits)
    # test the decoder's attention and block tables, which no weight form changes: one form per
    # architecture takes them; the others test their GEMMs on the short sequences' prefills,
    # chunks and decodes (a third of the time on 2 cores, issue 41).
    _compare(runners, monkeypatch, seed, shared_prefix=weights == "panels")


def test_models_it_does_not_take_keep_the_layer_forward(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSERVE_CPU_FUSED_DECODER", "1")
    qwen3 = _runner(_model(tmp_path, *CASES[2], seed=3))  # q/k norm
    run_plan(
        qwen3, _workload(random.Random(3), qwen3.info.vocab_size, 2, False)[0], one_token_steps
    )
    assert qwen3.model._cpu_decoder_plan is None
    # LoRA slots installed after a forward: the plan made before is not used any more.
    runner = _runner(_model(tmp_path, *CASES[0], seed=4))
    seqs = _workload(random.Random(4), runner.info.vocab_size, 2, False)[0]
    run_plan(runner, seqs, one_token_steps)
    assert runner.model._cpu_decoder_plan is not None
    install_slots(runner.model, LoraStep())
    called = []
    real = type(runner.model.layers[0]).forward
    monkeypatch.setattr(
        type(runner.model.layers[0]), "forward", lambda *a: called.append(1) or real(*a)
    )
    run_plan(runner, seqs[:1], one_token_steps)
    assert called, "the fused decoder ran a model with LoRA slots"


def test_a_decoder_that_drops_a_residual_is_caught(tmp_path, monkeypatch):
    """The comparison above can fail: the fused path with a bias of 1.0 on layer 1's o_proj
    (which the per-layer forward does not have) differs from it."""
    model_dir = _model(tmp_path, *CASES[0], seed=9)
    runner = _runner(model_dir)
    model = runner.model
    seqs = _workload(random.Random(9), runner.info.vocab_size, 2, False)[0]
    ref = run_plan(_use(runner, False, monkeypatch), seqs, one_token_steps)
    run_plan(_use(runner, True, monkeypatch), seqs, one_token_steps)  # builds the plan
    bias = torch.ones(model.config.hidden_size)
    model._cpu_decoder_plan.layers[1].o.bias = bias.data_ptr()
    model._cpu_decoder_plan.keep.append(bias)
    assert mismatches(ref, run_plan(runner, seqs, one_token_steps))
