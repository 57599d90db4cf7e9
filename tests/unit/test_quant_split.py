"""The split layout of the 32-weight block types (Q8_0, Q4_0, Q4_1; csrc/quant_split.cpp): the
relayout round-trips, de-quantizing it equals de-quantizing the GGUF blocks bit for bit, and a
row's matmul result has the same bits whatever the number of rows in the call (one row = the
decode path, whole tiles = the prefill path, the rest), the weight rows' tails and the library
variant (avx2 and the AVX-512 builds) — the step-invariance promise on the fast paths; the
K-quants' GGUF-layout kernel likewise across variants."""

from __future__ import annotations

import pytest
import torch

from executor_svc.kernels import library, quant
from tests.unit.test_quant_kernels import random_blocks

pytestmark = pytest.mark.skipif(not quant.available(), reason="no C++ compiler for the kernels")

SPLIT = ["Q8_0", "Q4_0", "Q4_1"]


@pytest.fixture
def variants(monkeypatch):
    """Calls ``fn`` under every library variant this CPU runs; returns {variant: result}."""

    def run_all(fn):
        out = {}
        for name in library.supported_variants():
            monkeypatch.setenv("LLMSERVE_CPU_ISA", name)
            library.reset()
            assert library.variant() == name
            out[name] = fn()
        return out

    yield run_all
    monkeypatch.delenv("LLMSERVE_CPU_ISA", raising=False)
    library.reset()


@pytest.mark.parametrize("type_name", SPLIT)
def test_relayout_round_trips_and_dequantizes_like_the_blocks(type_name: str) -> None:
    tid, k = quant.TYPE_IDS[type_name], 608
    raw = torch.from_numpy(random_blocks(type_name, 13, k))
    split = quant.relayout(tid, raw, k, to_split=True)
    assert not torch.equal(split, raw)
    assert torch.equal(quant.relayout(tid, split, k, to_split=False), raw)
    want = quant.dequantize(tid, raw, k)
    assert torch.equal(quant.dequantize(tid, split, k, split=True).view(torch.int32),
                       want.view(torch.int32))  # fmt: skip
    weight = quant.QuantWeight(raw, tid, k)
    assert weight.split and torch.equal(weight.data, split)
    rows = torch.tensor([12, 0, 5, 5])
    assert torch.equal(weight.rows(rows), want[rows])


# 61 weight rows: whole passes of kOut plus a tail; k = 608: 19 groups, past one chunk of 16;
# k = 8224: 257 groups, past the decode's chunk of 256 groups' scales.
SHAPES = ((61, 608), (16, 1536), (17, 8224))


def _rows_alone_and_together(type_name: str, shapes=SHAPES) -> dict[str, torch.Tensor]:
    """Each x row alone and inside calls of 7 and 64 rows (threads 1 and 2); asserts they are
    the same bits and returns the rows' results."""
    tid = quant.TYPE_IDS[type_name]
    out = {}
    for n, k in shapes:
        weight = quant.QuantWeight(torch.from_numpy(random_blocks(type_name, n, k, seed=n)), tid, k)
        g = torch.Generator().manual_seed(k)
        x = torch.randn(64, k, generator=g)
        bias = torch.randn(n, generator=g)
        alone = torch.cat([weight.linear(x[i : i + 1], bias) for i in range(64)])
        threads = torch.get_num_threads()
        try:
            for t in (1, 2):
                torch.set_num_threads(t)
                assert torch.equal(weight.linear(x, bias), alone), (n, k, t)
                assert torch.equal(weight.linear(x[3:10], bias), alone[3:10]), (n, k, t)
                assert torch.equal(weight.linear(x[:, :], None), weight.linear(x, None))
        finally:
            torch.set_num_threads(threads)
        out[f"{n}x{k}"] = alone
    return out


@pytest.mark.parametrize("type_name", SPLIT)
def test_row_bits_independent_of_rows_threads_and_variant(variants, type_name: str) -> None:
    results = variants(lambda: _rows_alone_and_together(type_name))
    first = next(iter(results.values()))
    for name, got in results.items():
        for case, y in got.items():
            assert torch.equal(y, first[case]), (name, case)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_k_quants_row_bits_independent_of_rows_threads_and_variant(variants, type_name: str):
    """The GGUF-layout kernel (csrc/quant_gemm.cpp) shares quant_vec.h's per-ISA vector."""
    results = variants(lambda: _rows_alone_and_together(type_name, ((13, 512), (5, 768))))
    first = next(iter(results.values()))
    for name, got in results.items():
        for case, y in got.items():
            assert torch.equal(y, first[case]), (name, case)


@pytest.mark.parametrize("type_name", SPLIT)
def test_split_matmul_close_to_dequantize_then_matmul(type_name: str) -> None:
    tid = quant.TYPE_IDS[type_name]
    for n, k in ((29, 1024), (18, 8224)):
        raw = random_blocks(type_name, n, k, seed=3)
        weight = quant.QuantWeight(torch.from_numpy(raw), tid, k)
        w = weight.dequantize().double()
        for m in (1, 8, 13):
            x = torch.randn(m, k)
            got = weight.linear(x, None).double()
            want = x.double() @ w.T
            scale = x.double().abs() @ w.abs().T
            assert ((got - want).abs() / scale).max() < 1e-5, (n, k, m)
