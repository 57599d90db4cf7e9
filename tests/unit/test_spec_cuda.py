"""Speculative decoding on CUDA (Triton attention, cuBLAS, CUDA graphs for plain decodes): the
n-gram, oracle and draft-model tests of test_spec_decode.py and test_spec_draft.py, run again
on a GPU runner. Skipped without a GPU.

The tests hold outputs and logprobs bit for bit, which needs the step-invariant CUDA kernels
(LLMSERVE_CUDA_INVARIANT=1, set for this module): a verify step computes k + 1 rows of a
sequence where plain decoding computes one. Under the default CUDA numerics (cuBLAS, split
attention) an H200 run gave the same tokens in every test and logprobs that differed by ~1e-5.
"""

from __future__ import annotations

import os

import pytest
import torch

from executor_svc.runner.model_runner import ModelRunner
from tests.support.draft_models import truncate_checkpoint
from tests.support.model_factory import make_tiny_checkpoint
from tests.unit.test_spec_decode import (  # noqa: F401 - collected again with the CUDA runner
    test_ngram_on_equals_off_with_stops_and_logprobs,
    test_oracle_proposals_change_nothing,
    test_preemption_and_prefix_cache,
)
from tests.unit.test_spec_draft import (  # noqa: F401
    test_draft_on_equals_off,
    test_stops_and_max_tokens,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Triton's tl.dot needs tiles of 16 and up: head_dim 32 here.
SHAPE = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
KW = dict(block_size=4, num_device_blocks=256, device="cuda", dtype="float32",
          attention_backend="triton", swap_space_gib=0.01)  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _invariant_kernels():
    """Before the runners (their CUDA graphs capture the kernels chosen then)."""
    before = os.environ.get("LLMSERVE_CUDA_INVARIANT")
    os.environ["LLMSERVE_CUDA_INVARIANT"] = "1"
    yield
    if before is None:
        del os.environ["LLMSERVE_CUDA_INVARIANT"]
    else:
        os.environ["LLMSERVE_CUDA_INVARIANT"] = before


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "tiny", **SHAPE)
    return ModelRunner(model_dir, **KW)


@pytest.fixture(scope="module")
def runners(tmp_path_factory) -> dict[str, ModelRunner]:
    root = tmp_path_factory.mktemp("draft")
    target = make_tiny_checkpoint(root / "target", num_hidden_layers=3, **SHAPE)
    truncated = truncate_checkpoint(target, root / "truncated", 1)
    return {
        "off": ModelRunner(target, **KW),
        "same": ModelRunner(target, speculative_model=target, **KW),
        "truncated": ModelRunner(target, speculative_model=truncated, **KW),
    }
