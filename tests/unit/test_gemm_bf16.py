"""The step-invariant bf16 GEMM (kernels/gemm_bf16.py, csrc/gemm_bf16.cpp): its results against
torch, its fixed order whatever the rows and threads, and its hook into the model's prepack."""

from __future__ import annotations

import pytest
import torch

from executor_svc.kernels import gemm, gemm_bf16

needs_kernel = pytest.mark.skipif(not gemm_bf16.available(), reason="no C++ compiler here")


def _data(m: int, k: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(k, n, generator=g) * 0.05).bfloat16()
    return x, w, torch.randn(n, generator=g)


@needs_kernel
@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (3, 576, 960), (9, 130, 50), (70, 96, 200)])
def test_matches_fp32_accumulation_of_bf16_products(m, k, n):
    x, w, bias = _data(m, k, n)
    packed = gemm_bf16.pack(w)
    ref = x.double() @ w.double() + bias.double()
    got = packed.linear(x.float(), bias)  # fp32 in, fp32 out
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got.double(), ref, atol=2e-5 * k**0.5, rtol=1e-5)
    got_bf16 = packed.linear(x, bias)  # bf16 in, bf16 out: the fp32 result rounded once
    assert got_bf16.dtype == torch.bfloat16
    assert torch.equal(got_bf16, got.bfloat16())


@needs_kernel
def test_odd_inner_size_is_padded():
    x, w, _ = _data(4, 33, 20)
    got = gemm_bf16.pack(w).linear(x.float(), None)
    torch.testing.assert_close(got, x.float() @ w.float(), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_a_row_has_the_same_bits_in_any_batch_and_thread_count():
    x, w, bias = _data(133, 256, 300, seed=3)
    packed = gemm_bf16.pack(w)
    alone = torch.cat([packed.linear(x[i : i + 1], bias) for i in range(x.shape[0])])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in (2, 3, 5, 7, 8, 9, 64, 133):
                assert torch.equal(packed.linear(x[:rows], bias), alone[:rows]), (threads, rows)
            # A strided view of the rows (every other one) too.
            assert torch.equal(packed.linear(x[::2], bias), alone[::2])
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_gemm_pack_takes_bf16_matrices():
    _, w, _ = _data(1, 64, 96)
    assert isinstance(gemm.pack(w), gemm_bf16.Bf16PanelWeight)
    assert gemm.pack(w.half()) is None  # fp16 keeps torch's matmul
