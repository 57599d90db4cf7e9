"""Tiny random Hugging Face checkpoints for tests (no downloads, no tokenizer).

The weights use a large ``initializer_range`` so that logits are spread out and greedy decoding
visits many different tokens instead of repeating one; this makes equivalence tests meaningful.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ARCHS: dict[str, tuple[type, type]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}

TINY_DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "initializer_range": 0.5,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

# Qwen3 carries head_dim in its config; give it one that differs from hidden/heads so that the
# loader cannot get away with deriving it.
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {"use_sliding_window": False},
    "qwen3": {"head_dim": 32, "use_sliding_window": False},
}


def make_tiny_config(arch: str = "llama", *, tie_word_embeddings: bool = False, **overrides: Any):
    """The transformers config of a tiny model of ``arch`` with ``overrides`` applied."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCHS)}")
    config_cls, _ = ARCHS[arch]
    kwargs = {**TINY_DEFAULTS, **ARCH_DEFAULTS[arch], **overrides}
    kwargs["tie_word_embeddings"] = tie_word_embeddings
    return config_cls(**kwargs)


def make_tiny_checkpoint(
    out_dir: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    max_shard_size: str | int | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a random tiny ``arch`` checkpoint (safetensors + generation_config) to ``out_dir``.

    ``config_overrides`` go to the config, e.g. ``rope_scaling={"rope_type": "llama3", ...}``
    or ``hidden_size=32``. ``max_shard_size`` (e.g. ``"20KB"``) writes a sharded checkpoint with
    ``model.safetensors.index.json``. Returns the directory.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = make_tiny_config(arch, tie_word_embeddings=tie_word_embeddings, **config_overrides)
    _, model_cls = ARCHS[arch]
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **save_kwargs)
    eos = config.eos_token_id
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=eos,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out)
    return out


def load_hf_model(model_dir: str | Path) -> torch.nn.Module:
    """The reference transformers model of a checkpoint made here, fp32 and in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
