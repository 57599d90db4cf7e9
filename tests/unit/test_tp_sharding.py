"""How attention heads split over tensor-parallel ranks, and which sizes are refused."""

from __future__ import annotations

import pytest

from executor_svc.parallel.group import HeadShard, shard_heads, tp_shape_error
from executor_svc.runner.tp_launcher import tensor_parallel_error


def shards(num_heads: int, num_kv_heads: int, world_size: int) -> list[HeadShard]:
    return [shard_heads(num_heads, num_kv_heads, world_size, r) for r in range(world_size)]


def test_kv_heads_split_when_there_are_enough() -> None:
    assert shards(8, 4, 2) == [HeadShard(4, 2, 0, 0), HeadShard(4, 2, 4, 2)]
    assert shards(4, 2, 2) == [HeadShard(2, 1, 0, 0), HeadShard(2, 1, 2, 1)]


def test_fewer_kv_heads_than_ranks_replicates_the_head_each_rank_needs() -> None:
    # 8 query heads in 2 groups of 4 over 4 ranks: ranks 0-1 serve group 0, ranks 2-3 group 1.
    assert [s.first_kv_head for s in shards(8, 2, 4)] == [0, 0, 1, 1]
    assert all(s.num_kv_heads == 1 and s.num_heads == 2 for s in shards(8, 2, 4))
    assert [s.first_kv_head for s in shards(4, 1, 2)] == [0, 0]


def test_every_query_head_keeps_its_own_kv_head() -> None:
    for h, kv, n in [(8, 4, 2), (8, 2, 4), (8, 8, 4), (4, 1, 2), (12, 4, 2), (16, 2, 8)]:
        group = h // kv
        for s in shards(h, kv, n):
            local_group = s.num_heads // s.num_kv_heads
            for j in range(s.num_heads):
                assert s.first_kv_head + j // local_group == (s.first_head + j) // group


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((9, 3, 1536, 2), "tensor-parallel size 2 does not divide the model's 9 attention heads"),
        ((12, 3, 1536, 2), "tensor-parallel size 2 and the model's 3 KV heads: one must divide"),
        ((8, 2, 100, 8), "tensor-parallel size 8 does not divide the MLP width 100"),
        ((8, 2, 128, 0), "tensor-parallel size must be >= 1, got 0"),
    ],
)
def test_shapes_that_do_not_split(shape: tuple[int, int, int, int], message: str) -> None:
    error = tp_shape_error(*shape)
    assert error is not None and message in error
    if "MLP" not in message:  # the head split itself refuses the rest
        with pytest.raises(ValueError, match="tensor-parallel size"):
            shard_heads(shape[0], shape[1], shape[3], 0)


def test_config_check_reads_hf_names_and_counts_cuda_devices() -> None:
    config = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}
    assert tensor_parallel_error(config, 2, "cpu") is None
    assert "4 attention heads" in (tensor_parallel_error(config, 3, "cpu") or "")
    mha = {"num_attention_heads": 6, "intermediate_size": 128}  # no num_key_value_heads: MHA
    assert tensor_parallel_error(mha, 2, "cpu") is None
    assert tensor_parallel_error(config, 2, "cuda") == (
        None
        if _cuda_devices() >= 2
        else f"--tensor-parallel-size 2 needs 2 CUDA devices, {_cuda_devices()} visible"
    )


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count()
