"""Random PEFT LoRA adapters for tests (made with ``peft`` on a tiny checkpoint, no downloads)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tests.support.model_factory import load_hf_model


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    name: str
    rank: int
    targets: tuple[str, ...]
    alpha: int = 16
    rslora: bool = False
    seed: int = 0


# Ranks 8 to 64, different target modules, rsLoRA once.
SPECS = (
    AdapterSpec("qv8", 8, ("q_proj", "v_proj"), alpha=16, seed=1),
    AdapterSpec(
        "all64",
        64,
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        alpha=32,
        rslora=True,
        seed=2,
    ),
    AdapterSpec("mlp8", 8, ("gate_proj", "down_proj", "o_proj"), alpha=8, seed=3),
    AdapterSpec("ku16", 16, ("k_proj", "up_proj"), alpha=32, seed=4),
)


def make_adapter(base_dir: Path, out_dir: Path, spec: AdapterSpec) -> Path:
    """Save a PEFT adapter of ``spec`` with random (nonzero) A and B for the base at ``base_dir``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(spec.seed)
    cfg = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        lora_dropout=0.0,
        use_rslora=spec.rslora,
        init_lora_weights=False,  # random B too, so that the adapter changes the outputs
    )
    model = get_peft_model(load_hf_model(base_dir), cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3 / spec.rank**0.5)
    model.save_pretrained(str(out_dir))
    return out_dir


def load_peft_reference(base_dir: Path, adapter_dir: Path) -> torch.nn.Module:
    from peft import PeftModel

    return PeftModel.from_pretrained(load_hf_model(base_dir), str(adapter_dir)).eval()
