"""Pooling under tensor parallelism: a TP = 2 executor (2 ranks on the CPU, gloo) driven step by
step over gRPC returns the embeddings Hugging Face transformers gives for the same checkpoint
(rank 0 pools: after the all-reduce every rank holds the full final-norm hidden states)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from executor_svc.features.pooling.pooling import vector_from_bytes
from protos import executor_pb2 as pb
from tests.integration.test_tensor_parallel import TP_ARGS
from tests.support.executor_driver import executor_channel, executor_subprocess
from tests.support.model_factory import make_tiny_checkpoint

A = [5, 17, 42, 9, 88, 13, 61]  # LAST, normalized, in one step
B = [12, 7, 7, 30, 101, 3, 44, 250, 9, 77]  # MEAN, not normalized, in chunks of 6 and 4


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("embed-tp")
    model_dir = make_tiny_checkpoint(tmp / "model", "llama", num_key_value_heads=2)
    with executor_subprocess(model_dir, tmp, *TP_ARGS) as (_, port):
        yield model_dir, port


def hf_hidden(model_dir, ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model.model(torch.tensor([ids])).last_hidden_state[0].float()


def new_seq(seq_id, ids, blocks, n, pooling: pb.PoolingParams) -> pb.NewSequence:
    params = pb.SamplingParams(prompt_only=True, pooling=pooling)
    return pb.NewSequence(
        seq_id=seq_id,
        token_ids=ids,
        num_prompt_tokens=len(ids),
        sampling_params=params,
        block_table=blocks,
        num_scheduled_tokens=n,
    )


def test_tp2_pooling_matches_hf(served):
    model_dir, port = served
    last = pb.PoolingParams(type=pb.POOLING_TYPE_LAST, normalize=True)
    mean = pb.PoolingParams(type=pb.POOLING_TYPE_MEAN, normalize=False)
    with executor_channel(port) as stub:
        stub.Reset(pb.ResetRequest())
        assert stub.Describe(pb.DescribeRequest()).tensor_parallel_size == 2
        first = stub.ExecuteModel(
            pb.ExecuteModelRequest(
                step_id=1,
                new_sequences=[
                    new_seq("a", A, [0, 1], 7, last),
                    new_seq("b", B, [2, 3, 4], 6, mean),
                ],
            )
        )
        assert [p.seq_id for p in first.pooled] == ["a"] and not first.sampled
        second = stub.ExecuteModel(
            pb.ExecuteModelRequest(
                step_id=2,
                cached_sequences=[
                    pb.CachedSequence(seq_id="b", num_scheduled_tokens=4, num_computed_tokens=6)
                ],
                finished_seq_ids=["a"],
            )
        )
        assert [p.seq_id for p in second.pooled] == ["b"]
    want_a = torch.nn.functional.normalize(hf_hidden(model_dir, A)[-1], dim=0).numpy()
    want_b = hf_hidden(model_dir, B).double().mean(0).float().numpy()
    for got, want in ((first.pooled[0].data, want_a), (second.pooled[0].data, want_b)):
        vec = vector_from_bytes(got)
        cos = float(vec @ want / (np.linalg.norm(vec) * np.linalg.norm(want)))
        assert np.max(np.abs(vec - want)) <= 1e-5 and cos >= 0.99999
