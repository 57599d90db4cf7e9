"""The CPU kernel library's elementwise ops against torch (csrc/elementwise.cpp): the MLP's
activation, RMSNorm with its residual add, and the embedding lookup."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from executor_svc.kernels import elementwise, library

needs_kernel = pytest.mark.skipif(not library.available(), reason="no C++ compiler here")


@needs_kernel
@pytest.mark.parametrize("rows,inter", [(1, 1536), (7, 40), (64, 1539)])
def test_silu_mul_matches_torch(rows, inter):
    g = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 2 * inter + 3, generator=g) * 6  # large |gate| too: both tails
    gate_up = wide[:, : 2 * inter]  # row stride wider than the row
    gate_up[0, 0], gate_up[0, 1] = -200.0, 200.0  # saturated silu: 0 and the input
    out = elementwise.silu_mul(gate_up)
    ref = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    assert out is not None and out.shape == (rows, inter)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_silu_mul_declines_what_it_does_not_take():
    assert elementwise.silu_mul(torch.randn(2, 8, dtype=torch.float64)) is None
    assert elementwise.silu_mul(torch.randn(2, 7)) is None  # odd width: no [gate | up] halves
    assert elementwise.silu_mul(torch.randn(4, 2, 8)) is None


@needs_kernel
@pytest.mark.parametrize("rows,dim", [(1, 576), (5, 40), (64, 4099)])
def test_add_rms_norm_matches_torch(rows, dim):
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(rows, dim + 5, generator=g)[:, :dim]  # strided rows
    delta = torch.randn(rows, dim, generator=g)
    w = torch.randn(dim, generator=g)
    total, normed = elementwise.add_rms_norm(x, delta, w, 1e-5)
    torch.testing.assert_close(total, x + delta, atol=0, rtol=0)
    ref = F.rms_norm(x + delta, (dim,), w, 1e-5)
    torch.testing.assert_close(normed, ref, atol=1e-5, rtol=1e-5)
    same, normed = elementwise.add_rms_norm(x, None, w, 1e-5)  # no residual: the norm alone
    assert same is x
    torch.testing.assert_close(normed, F.rms_norm(x, (dim,), w, 1e-5), atol=1e-5, rtol=1e-5)
    assert elementwise.add_rms_norm(x.double(), None, w.double(), 1e-5) is None
    assert elementwise.add_rms_norm(x, delta[:, :-1], w, 1e-5) is None  # shapes differ


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_gather_columns_is_torchs_lookup_bit_for_bit(dtype, num_threads):
    """The [hidden, vocab] table's columns for ids (repeated, the first and last column; 300
    x 40 elements: shared among the threads from kParallelMin on), with a row stride wider
    than the row; denormals and NaN payloads copied as they are."""
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        g = torch.Generator().manual_seed(3)
        table = torch.randn(40, 1003, generator=g).to(dtype)[:, :1000]
        table[5, 7] = torch.tensor(1e-39 if dtype == torch.float32 else 1e-40).to(dtype)
        as_int = torch.int16 if dtype == torch.bfloat16 else torch.int32
        table.view(as_int)[6, 7] = 0x7FC1 if dtype == torch.bfloat16 else 0x7FC00001  # NaN
        ids = torch.cat([torch.tensor([0, 999, 7, 7]), torch.randint(0, 1000, (296,), generator=g)])
        out = elementwise.gather_columns(table, ids)
        ref = table.index_select(1, ids).t().contiguous()
        assert out is not None and out.shape == (300, 40)
        assert torch.equal(out.view(as_int), ref.view(as_int))
        assert elementwise.gather_columns(table, torch.tensor([1000])) is None  # out of range
        assert elementwise.gather_columns(table, torch.tensor([1], dtype=torch.int32)) is None
    finally:
        torch.set_num_threads(before)
