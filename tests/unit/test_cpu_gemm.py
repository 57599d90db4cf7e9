"""The step-invariant CPU GEMM (csrc/gemm.cpp via executor_svc/kernels/gemm.py): a row's output is
bitwise the same computed alone or among any number of other rows, on any thread count; it is
accurate against an fp64 reference; and the model uses it for every fp32 CPU matmul."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from executor_svc.config import numerics
from executor_svc.kernels import gemm as cpu_gemm
from executor_svc.models.llama import Linear
from tests.support.model_factory import make_tiny_checkpoint
from tests.unit.test_model_equivalence import assert_logits_match_hf, make_prompts

needs_kernel = pytest.mark.skipif(not cpu_gemm.available(), reason="no C++ compiler here")

ROW_COUNTS = (1, 2, 3, 4, 5, 6, 7, 8, 13, 24, 25, 64, 65, 300)
# (K, N): K not a multiple of 16, N not a multiple of the panel width (48), a single partial
# panel, one large enough that two threads split even a single row, and K = 100: chunks of
# 48, 48 and 4 in few_rows.
SHAPES = ((37, 100), (64, 48), (576, 200), (19, 7), (96, 1500), (100, 400))

Gemm = Callable[[torch.Tensor], torch.Tensor]  # x [M, K] -> y [M, N]


@contextmanager
def num_threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def row_invariance_failures(gemm: Gemm, x: torch.Tensor, threads: int) -> list[tuple[int, int]]:
    """(M, row) for every row whose output within ``gemm(x[:M])`` on ``threads`` threads is not
    bitwise equal to that row computed alone on one thread."""
    with num_threads(1):
        alone = [gemm(x[i : i + 1])[0] for i in range(x.shape[0])]
    failures = []
    with num_threads(threads):
        for m in ROW_COUNTS:
            y = gemm(x[:m])
            failures += [(m, i) for i in range(m) if not torch.equal(y[i], alone[i])]
    return failures


def make_xw(k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(max(ROW_COUNTS), k, generator=g)
    return x, torch.randn(k, n, generator=g), torch.randn(n, generator=g)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("k,n", SHAPES)
def test_each_row_is_the_same_alone_or_batched(k, n, with_bias, threads):
    x, w, b = make_xw(k, n, seed=k * n)
    bias = b if with_bias else None
    packed = cpu_gemm.PanelWeight.pack(w)
    assert row_invariance_failures(lambda rows: packed.linear(rows, bias), x, threads) == []


@needs_kernel
@pytest.mark.parametrize("k,n", SHAPES)
def test_plain_and_strided_inputs_give_the_packed_bits(k, n):
    x, w, b = make_xw(k, n, seed=n)
    want = cpu_gemm.PanelWeight.pack(w).linear(x, b)
    wide_w = torch.cat([w, torch.randn(k, 5)], dim=1)[:, :n]  # row stride > n: plain, strided
    wide_x = torch.cat([x, torch.randn(x.shape[0], 3)], dim=1)[:, :k]
    for xi, wi in ((x, w), (wide_x, wide_w), (x, w.t().contiguous().t())):
        got = cpu_gemm.matmul(xi, wi, b)
        assert got is not None and torch.equal(got, want)


@needs_kernel
@pytest.mark.parametrize("k,n", [(37, 100), (576, 960), (1536, 576), (4099, 64)])
def test_accuracy_against_fp64(k, n):
    g = torch.Generator().manual_seed(k)
    x, w, b = torch.randn(64, k, generator=g), torch.randn(k, n, generator=g), torch.randn(n)
    y = cpu_gemm.PanelWeight.pack(w).linear(x, b).double()
    ref = x.double() @ w.double() + b.double()
    # Relative to sum |x w| + |b| (the scale a sum's rounding error is measured against):
    # seen 3-4 units of roundoff at most, over K = 37 to 4 099; a sequential sum's worst case is
    # K units. MKL's blocked sums reach 0.4-3 units here.
    scale = x.double().abs() @ w.double().abs() + b.double().abs()
    assert ((y - ref).abs() / scale).max().item() <= 16 * 2.0**-24


def test_the_checker_catches_an_order_that_depends_on_m():
    """The mutation check: a GEMM that sums K in two halves when M > 1 (as a kernel that blocks
    K by the shape would) is exact per half and still fails the invariance check."""
    x, w, _ = make_xw(96, 40, seed=3)

    def split_k_when_batched(rows: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] == 1:
            return (rows.double() @ w.double()).float()
        h = rows.shape[1] // 2
        lo = (rows[:, :h].double() @ w[:h].double()).float()
        hi = (rows[:, h:].double() @ w[h:].double()).float()
        return lo + hi

    failures = row_invariance_failures(split_k_when_batched, x, threads=1)
    assert len(failures) > len(ROW_COUNTS)  # most rows of every M > 1
    assert {m for m, _ in failures} == set(ROW_COUNTS) - {1}


@needs_kernel
def test_empty_batch_and_bias_shape():
    w = cpu_gemm.PanelWeight.pack(torch.randn(8, 50))
    assert w.linear(torch.randn(0, 8), None).shape == (0, 50)
    with pytest.raises(AssertionError):
        w.linear(torch.randn(2, 8), torch.randn(49))


@contextmanager
def deterministic(enabled: bool) -> Iterator[None]:
    old = numerics.deterministic()
    numerics.set_deterministic(enabled)
    try:
        yield
    finally:
        numerics.set_deterministic(old)


@needs_kernel
def test_numerics_switch_picks_the_path():
    w = torch.randn(16, 32)
    assert isinstance(cpu_gemm.pack(w), cpu_gemm.PanelWeight)
    assert cpu_gemm.pack(w.double()) is None  # fp64: not ours to pack
    with deterministic(False):
        assert isinstance(cpu_gemm.pack(w), cpu_gemm.OneDnnWeight | type(None))
        assert cpu_gemm.matmul(torch.randn(3, 16), w) is None  # matmul_io's own MKL/oneDNN choice


@needs_kernel
@pytest.mark.parametrize("tied", [False, True])
def test_model_uses_the_kernel_and_matches_hf(tmp_path, tied):
    model_dir = make_tiny_checkpoint(
        tmp_path / "m", "llama", seed=4, tie_word_embeddings=tied, attention_bias=True
    )
    # Every matmul of the forward (biased q/k/v/o too) through the kernel, against HF.
    runner = assert_logits_match_hf(model_dir, make_prompts([9, 17, 1]))
    model = runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.packed, cpu_gemm.PanelWeight) for m in linears)
    assert all(m.weight.numel() == 0 for m in linears)  # one copy: the packed one
    assert isinstance(model.packed_lm_head, cpu_gemm.PanelWeight)
    assert (model.lm_head is model.embed_tokens) == tied
    assert model.embed_tokens.numel() > 0  # the embedding lookup keeps its plain matrix

    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(max(ROW_COUNTS), model.config.hidden_size, generator=g)
    qkv = model.layers[0].self_attn.qkv_proj
    for gemm in (model.compute_logits, qkv):
        assert row_invariance_failures(gemm, hidden, threads=2) == []
