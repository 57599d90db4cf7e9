"""The sampler's argmax + logsumexp on CUDA (kernels/triton_sampling.py): torch's answer, and
the same bits for a row whatever rows are beside it. On the CPU it runs in Triton's interpreter;
on a GPU compiled (and then also through the sampler under LLMSERVE_CUDA_INVARIANT=1)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from executor_svc.kernels import sampling  # noqa: E402
from executor_svc.kernels import triton_sampling as ts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("vocab", [7, 2048, 5000])
def test_matches_torch(vocab):
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(5, vocab, generator=g) * 4).to(DEVICE)
    x[1, 3] = x[1, vocab - 1] = 100.0  # a tie: the first index wins, as torch.argmax says
    x[2] = float("-inf")  # a fully masked row: lse -inf, index 0
    x[3, : vocab // 2] = float("-inf")  # a half-masked row
    ids, lse = ts.argmax_logsumexp(x)
    assert torch.equal(ids, x.argmax(dim=-1))
    assert ids[1].item() == 3
    assert lse[2].item() == float("-inf")
    ref = torch.logsumexp(x.double(), dim=-1).float()
    keep = torch.isfinite(ref)
    torch.testing.assert_close(lse[keep], ref[keep], rtol=1e-6, atol=1e-5)


def test_a_row_gets_the_same_bits_whatever_rows_are_beside_it():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(33, 5000, generator=g) * 8).to(DEVICE)
    ids, lse = ts.argmax_logsumexp(x)
    for rows in ([7], [0, 7], list(range(7, 33))):
        sub_ids, sub_lse = ts.argmax_logsumexp(x[rows].contiguous())
        assert torch.equal(sub_ids, ids[rows]) and torch.equal(sub_lse, lse[rows])


def test_dispatch():
    x = torch.randn(3, 100)
    # CPU: the compiled library (or None without it), never Triton; non-fp32 or strided: None.
    assert sampling.argmax_logsumexp(x.double()) is None
    assert sampling.argmax_logsumexp(x.t()) is None
    torch.testing.assert_close(sampling.row_logsumexp(x), torch.logsumexp(x, dim=-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_dispatch_follows_the_invariant_experiment(monkeypatch):
    x = torch.randn(3, 100, device="cuda")
    monkeypatch.setenv("LLMSERVE_CUDA_INVARIANT", "0")
    assert sampling.argmax_logsumexp(x) is None
    monkeypatch.setenv("LLMSERVE_CUDA_INVARIANT", "1")
    ids, lse = sampling.argmax_logsumexp(x)
    assert torch.equal(ids, x.argmax(dim=-1))
