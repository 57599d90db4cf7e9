"""``--load-format dummy``: a checkpoint directory with a config and tokenizer but no weights
serves with seeded random weights (benchmarks of model shapes without their weights)."""

from __future__ import annotations

import pytest
import torch

from executor_svc.demo.demo_model import build_demo_model
from executor_svc.runner.model_runner import ModelRunner, ScheduledSequence


def _logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    seq = ScheduledSequence("0", prompt, len(prompt), [0, 1], 0, len(prompt), None)
    _, logits = runner.forward_logits([seq])
    return logits


def test_dummy_weights_need_no_checkpoint_and_are_seeded(tmp_path, monkeypatch):
    model_dir = build_demo_model(tmp_path / "shape", size="tiny", weights=False)
    assert not list(model_dir.glob("*.safetensors"))
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        ModelRunner(model_dir, num_device_blocks=4)
    monkeypatch.setenv("LLMSERVE_LOAD_FORMAT", "dummy")
    a = _logits(ModelRunner(model_dir, num_device_blocks=4), [5, 9, 11])
    b = _logits(ModelRunner(model_dir, num_device_blocks=4), [5, 9, 11])
    assert torch.isfinite(a).all() and a.std() > 0
    assert torch.equal(a, b)  # the same weights every start
