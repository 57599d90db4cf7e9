"""Model code; one class per family, chosen by the checkpoint's ``architectures`` entry."""

from __future__ import annotations

from executor_svc.models.llama import LlamaConfig, LlamaForCausalLM

# HF architecture name -> (model class, config class). Mistral, Qwen2 and Qwen3 are Llama with
# small switches (qkv bias, q/k norm) that LlamaConfig.from_hf reads from config.json.
MODEL_REGISTRY: dict[str, tuple[type[LlamaForCausalLM], type[LlamaConfig]]] = {
    "LlamaForCausalLM": (LlamaForCausalLM, LlamaConfig),
    "MistralForCausalLM": (LlamaForCausalLM, LlamaConfig),
    "Qwen2ForCausalLM": (LlamaForCausalLM, LlamaConfig),
    "Qwen3ForCausalLM": (LlamaForCausalLM, LlamaConfig),
}

__all__ = ["MODEL_REGISTRY", "LlamaConfig", "LlamaForCausalLM"]
