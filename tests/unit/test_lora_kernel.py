"""The batched LoRA kernel (kernels/csrc/lowrank_rows.cpp via features/lora/kernel.py): each
row's result is bitwise the same alone and in groups of any size (rows are blocked four at a time inside), at 1 and 2
threads, for ranks and shard sizes that take every path (64-wide, 16-wide, scalar tails); and
it computes (x @ A) @ B_s added into each shard's columns."""

from __future__ import annotations

import pytest
import torch

from executor_svc.features.lora import kernel as lora_kernel

pytestmark = pytest.mark.skipif(lora_kernel._fn() is None, reason="no kernel library")


def _weights(k: int, rank: int, sizes: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(k, rank * len(sizes), generator=g)
    shards, start = [], 0
    for size in sizes:
        shards.append((start, size, torch.randn(rank, size, generator=g)))
        start += size + 3  # a gap: columns no shard writes
    return a, shards, start


@pytest.mark.parametrize(
    ("k", "rank", "sizes"),
    [
        (576, 16, [576, 192, 192]),
        (96, 8, [40, 40]),
        (33, 64, [100]),
        (1536, 16, [576]),
        (20, 5, [7]),
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_is_the_same_alone_and_in_any_group(k, rank, sizes, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, shards, width = _weights(k, rank, sizes, seed=k + rank)
        w = lora_kernel.LoraWeights.of(a, rank, shards)
        assert w is not None
        x = torch.randn(13, k)
        y0 = torch.randn(13, width)
        alone = y0.clone()
        for i in range(13):
            w.apply(x, torch.tensor([i]), alone)
        for group in ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [12, 3, 7], [5, 6, 7, 8, 9]):
            y = y0.clone()
            w.apply(x, torch.tensor(group), y)
            for i in group:
                assert torch.equal(y[i], alone[i]), (group, i)
        # What it computes, against float64.
        ref = y0.double().clone()
        xa = x.double() @ a.double()
        for j, (start, size, b) in enumerate(shards):
            ref[:, start : start + size] += xa[:, j * rank : (j + 1) * rank] @ b.double()
        torch.testing.assert_close(alone.double(), ref, rtol=1e-4, atol=1e-3)
    finally:
        torch.set_num_threads(before)
