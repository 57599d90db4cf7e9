"""The opt-in int8-activation mode of the split-layout quantized matmul (``LLMSERVE_QUANT_ACT=int8``,
csrc/quant_act8.cpp). What it promises, and what it does not:

* step invariance, as the fp32 path: a row's result has the same bits whatever the rows of the
  call, the threads and the library variant (each row is quantized on its own, one fixed chain);
* it equals, within fp32 rounding, the exact product of the weights with the activations
  quantized as the kernel's header defines (nearest-even of x * 127 / max|x| per group of 32);
* so its distance to de-quantize-then-matmul (the fp32 path's reference) is bounded by the
  activations' rounding: at most half a step (max|x| / 127 / 2) per activation;
* it is not the fp32 path's bits: the default stays fp32 activations. The K-quants ignore it.
"""

from __future__ import annotations

import pytest
import torch

from executor_svc.config import envs
from executor_svc.kernels import quant
from tests.unit.test_quant_kernels import random_blocks
from tests.unit.test_quant_split import _rows_alone_and_together, variants  # noqa: F401

pytestmark = pytest.mark.skipif(not quant.available(), reason="no C++ compiler for the kernels")

SPLIT = ["Q8_0", "Q4_0", "Q4_1"]


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x [m, k] as the kernel sees it: per group of 32, dx * xq (float64, exact)."""
    g = x.reshape(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))  # fp32 div
    xq = torch.round(g * inv)  # fp32 product, nearest-even
    dx = amax / 127.0
    return (xq.double() * dx.double()).reshape(x.shape)


def _weight(type_name: str, n: int, k: int, act: str, seed: int = 0) -> quant.QuantWeight:
    raw = torch.from_numpy(random_blocks(type_name, n, k, seed=seed))
    return quant.QuantWeight(raw, quant.TYPE_IDS[type_name], k, act=act)


@pytest.mark.parametrize("type_name", SPLIT)
def test_act8_row_bits_independent_of_rows_threads_and_variant(
    variants,  # noqa: F811
    monkeypatch,
    type_name: str,
) -> None:
    monkeypatch.setenv("LLMSERVE_QUANT_ACT", "int8")
    results = variants(lambda: _rows_alone_and_together(type_name))
    first = next(iter(results.values()))
    for name, got in results.items():
        for case, y in got.items():
            assert torch.equal(y, first[case]), (name, case)


@pytest.mark.parametrize("type_name", SPLIT)
def test_act8_equals_product_with_quantized_activations(type_name: str) -> None:
    for n, k in ((29, 608), (18, 8224)):
        weight = _weight(type_name, n, k, "int8", seed=5)
        w = weight.dequantize().double()
        bias = torch.randn(n)
        for m in (1, 5, 13):
            x = torch.randn(m, k) * torch.rand(m, k)  # groups of different ranges
            x[0, :32] = 0.0  # a group of zeros: dx = 0
            got = weight.linear(x, bias).double()
            want = quantized_activations(x) @ w.T + bias.double()
            scale = quantized_activations(x).abs() @ w.abs().T + bias.double().abs()
            assert ((got - want).abs() / scale).max() < 1e-5, (n, k, m)


@pytest.mark.parametrize("type_name", SPLIT)
def test_act8_within_half_a_step_of_fp32_activations(type_name: str) -> None:
    n, k = 37, 1024
    weight = _weight(type_name, n, k, "int8", seed=7)
    exact = _weight(type_name, n, k, "fp32", seed=7)
    w = exact.dequantize().double()
    x = torch.randn(9, k)
    got, ref = weight.linear(x, None).double(), exact.linear(x, None).double()
    assert not torch.equal(got, ref)  # a different mode, not the fp32 path's bits
    half_step = (x.reshape(9, -1, 32).abs().amax(-1, keepdim=True) / 254).expand(-1, -1, 32)
    bound = half_step.reshape(9, k).double() @ w.abs().T
    scale = x.double().abs() @ w.abs().T
    assert ((got - ref).abs() <= bound * 1.001 + 1e-5 * scale).all()


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_k_quants_keep_fp32_activations(type_name: str) -> None:
    weight = _weight(type_name, 5, 512, "int8")
    assert weight.act == "fp32" and weight.kernel_type == quant.TYPE_IDS[type_name]
    x = torch.randn(3, 512)
    assert torch.equal(weight.linear(x, None), _weight(type_name, 5, 512, "fp32").linear(x, None))


def test_mode_comes_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("LLMSERVE_QUANT_ACT", raising=False)
    assert _weight("Q4_1", 3, 64, envs.quant_act()).act == "fp32"
    monkeypatch.setenv("LLMSERVE_QUANT_ACT", "int8")
    weight = quant.QuantWeight(
        torch.from_numpy(random_blocks("Q4_1", 3, 64)), quant.TYPE_IDS["Q4_1"], 64
    )
    assert weight.act == "int8" and weight.kernel_type == quant.TYPE_IDS["Q4_1"] | quant.ACT_INT8
    monkeypatch.setenv("LLMSERVE_QUANT_ACT", "int4")
    with pytest.raises(ValueError, match="LLMSERVE_QUANT_ACT"):
        envs.quant_act()
