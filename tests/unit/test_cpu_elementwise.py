"""The CPU kernel library's elementwise ops against torch (csrc/elementwise.cpp)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from executor_svc.attention import cpu_ops

needs_kernel = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler here")


@needs_kernel
@pytest.mark.parametrize("rows,inter", [(1, 1536), (7, 40), (64, 1539)])
def test_silu_mul_matches_torch(rows, inter):
    g = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 2 * inter + 3, generator=g) * 6  # large |gate| too: both tails
    gate_up = wide[:, : 2 * inter]  # row stride wider than the row
    gate_up[0, 0], gate_up[0, 1] = -200.0, 200.0  # saturated silu: 0 and the input
    out = cpu_ops.silu_mul(gate_up)
    ref = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    assert out is not None and out.shape == (rows, inter)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_silu_mul_declines_what_it_does_not_take():
    assert cpu_ops.silu_mul(torch.randn(2, 8, dtype=torch.float64)) is None
    assert cpu_ops.silu_mul(torch.randn(2, 7)) is None  # odd width: no [gate | up] halves
    assert cpu_ops.silu_mul(torch.randn(4, 2, 8)) is None
