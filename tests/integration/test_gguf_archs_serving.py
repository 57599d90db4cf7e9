"""A qwen2 / qwen3 / mistral GGUF file named as the executor's model (``--model file.gguf``)
through the real gRPC executor: it describes the file's model and its greedy outputs, several
sequences batched, equal transformers' GGUF loader's greedy choices (teacher-forced on ours)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from protos import executor_pb2 as pb
from tests.support.executor_driver import ExecutorDriver, executor_channel, running_executor
from tests.support.model_factory import make_tiny_checkpoint

gguf = pytest.importorskip("gguf")

PROMPTS = [[1, 40, 300, 7, 99, 12], [1, 5], [1, 200, 511, 17, 18, 3, 3, 60, 61, 62, 9]]
MAX_NEW = 8
ARCH_OVERRIDES = {"qwen3": {"head_dim": 128}}


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_gguf_file_served_over_grpc(tmp_path: Path, monkeypatch, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    from tests.support.gguf_writer import write_gguf

    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path / "cache"))
    hf_dir = make_tiny_checkpoint(tmp_path / "hf", arch, seed=9, **ARCH_OVERRIDES.get(arch, {}))
    path = write_gguf(hf_dir, tmp_path / "g" / f"{arch}.gguf", arch)
    kwargs = dict(device="cpu", block_size=4, num_device_blocks=64)
    with running_executor(path, **kwargs) as (_, port), executor_channel(port) as stub:
        info = stub.Describe(pb.DescribeRequest())
        hf_arch = "LlamaForCausalLM" if arch == "mistral" else f"{arch.capitalize()}ForCausalLM"
        assert (info.model_name, info.architecture, info.dtype) == (arch, hf_arch, "float32")
        assert (info.vocab_size, list(info.eos_token_ids)) == (512, [2])
        outputs = ExecutorDriver(stub, info).generate(PROMPTS, MAX_NEW)
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    for i, prompt in enumerate(PROMPTS):
        ours = outputs[f"seq-{i}"]
        assert len(ours) == MAX_NEW
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1 : -1]
        assert logits.argmax(-1).tolist() == ours, f"{arch} prompt {i}"
