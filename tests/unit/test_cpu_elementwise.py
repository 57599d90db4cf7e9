"""The CPU kernel library's elementwise ops against torch (csrc/elementwise.cpp): the MLP's
activation and RMSNorm with its residual add."""

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
