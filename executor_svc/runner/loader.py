"""Hugging Face checkpoint directory -> model on its device + ``ModelInfo``.

Reads ``config.json``, ``generation_config.json`` and the safetensors weights (one file or a
sharded set with ``model.safetensors.index.json``). Checkpoint names map onto the model's packed
parameters through each parameter's ``weight_loader``; every parameter (and every shard of a
packed one) must be filled, so a truncated or foreign checkpoint fails loudly at start-up.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch
from safetensors import safe_open

from executor_svc.attention import AttentionBackend
from executor_svc.config import envs
from executor_svc.features.gguf.hf_files import gguf_source
from executor_svc.kernels import cpu_dtype
from executor_svc.models import MODEL_REGISTRY, LlamaForCausalLM

if TYPE_CHECKING:
    from executor_svc.parallel.group import TPGroup

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class ModelInfo:
    """What the runner and the service report about the loaded model."""

    architecture: str  # e.g. "LlamaForCausalLM"
    model_name: str  # directory base name
    vocab_size: int
    max_model_len: int  # longest prompt + output accepted (<= max_position_embeddings)
    eos_token_ids: list[int]  # generation_config.json first, config.json as fallback
    num_layers: int
    num_kv_heads: int  # K/V heads this process holds (all of them without tensor parallelism)
    head_dim: int
    dtype: torch.dtype  # of weights and KV cache
    device: torch.device
    hidden_size: int
    tensor_parallel_size: int = 1

    @property
    def dtype_name(self) -> str:
        """ "float32", "float16" or "bfloat16" (the wire spelling)."""
        return str(self.dtype).removeprefix("torch.")


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if device == "auto":
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """ "auto" is bf16 on CUDA (halves memory traffic); on CPU bf16 where it has AMX or
    AVX512-BF16, fp32 elsewhere (``kernels.cpu_dtype``)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else cpu_dtype.auto_cpu_dtype()
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _eos_token_ids(model_dir: Path, config: dict[str, Any]) -> list[int]:
    eos = _read_json(model_dir / "generation_config.json").get("eos_token_id")
    if eos is None:
        eos = config.get("eos_token_id")
    if eos is None:
        return []
    ids = [eos] if isinstance(eos, int) else list(eos)
    return list(dict.fromkeys(int(i) for i in ids))


def _max_model_len(config: dict[str, Any], requested: int | None) -> int:
    limit = int(config.get("max_position_embeddings", 2048))
    window = config.get("sliding_window")
    # Sliding-window attention is not implemented; within the window it equals full attention,
    # so capping the length keeps results exact. Qwen2/3 only use it when use_sliding_window.
    uses_window = config.get("model_type") == "mistral" or config.get("use_sliding_window", False)
    if window and uses_window:
        limit = min(limit, int(window))
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len {requested} exceeds the model's limit of {limit} tokens")
    return requested


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(_read_json(index)["weight_map"].values()))
        return [model_dir / n for n in names]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    return files


def load_weights(model: LlamaForCausalLM, files: list[Path]) -> None:
    """Copy every checkpoint tensor into its (packed) parameter; fail on gaps or strays."""
    params = dict(model.named_parameters(remove_duplicate=False))
    expected: set[tuple[str, Any]] = set()
    for name in params:
        owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else None
        shard_ids = getattr(owner, "shard_offsets", {None: None})
        expected.update((name, sid) for sid in shard_ids)
    if model.config.tie_word_embeddings:
        expected.discard(("lm_head", None))
    loaded: set[tuple[str, Any]] = set()
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for ckpt_name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                target = model.checkpoint_to_param_name(ckpt_name)
                if target is None:
                    continue
                name, shard_id = target
                if name not in params:
                    raise KeyError(f"checkpoint tensor {ckpt_name!r} matches no model parameter")
                param = params[name]
                # A sharded parameter reads only its slice of the tensor (tensor parallelism).
                if getattr(param, "loads_slice", False):
                    tensor = f.get_slice(ckpt_name)
                else:
                    tensor = f.get_tensor(ckpt_name)
                # copy_ inside the loader converts dtype and moves to the device in one step.
                param.weight_loader(param, tensor, shard_id)
                loaded.add((name, shard_id))
    missing = sorted(str(m) for m in expected - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks weights for: {', '.join(missing[:8])}")


def fill_dummy_weights(model: torch.nn.Module, std: float, seed: int = 0) -> None:
    """Seeded random weights in place, on the parameters' device (``--load-format dummy``):
    norms near 1, biases near 0, matrices N(0, std). For benchmarks only: outputs are noise."""
    for i, (name, param) in enumerate(model.named_parameters()):
        gen = torch.Generator(device=param.device).manual_seed(seed * 100_003 + i)
        if name.endswith("norm.weight"):
            param.uniform_(0.9, 1.1, generator=gen)
        elif name.endswith("bias"):
            param.normal_(0.0, 0.1 * std, generator=gen)
        else:
            param.normal_(0.0, std, generator=gen)


def load_model(
    model_dir: str | Path,
    backend: AttentionBackend,
    *,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    max_model_len: int | None = None,
    tp: TPGroup | None = None,
    quantization: str | None = None,
) -> tuple[LlamaForCausalLM, ModelInfo]:
    """Build the model for ``model_dir`` on ``device`` in ``dtype`` and load its weights; with
    ``tp``, this rank's shard of it, reading only that shard from the checkpoint."""
    model_dir = Path(model_dir)
    gguf_path = gguf_source(model_dir)  # a GGUF model's side directory (executor_svc/features/gguf)
    if gguf_path is not None:
        dtype = "float32"  # the quantized kernels take fp32 activations
    if quantization is not None:  # models/quant_linear.py: int8 / int4 at load
        if gguf_path is not None:
            raise ValueError("--quantization applies to a checkpoint directory, not a GGUF file")
        dtype = "float32"
    config = _read_json(model_dir / "config.json")
    if not config:
        raise FileNotFoundError(f"{model_dir / 'config.json'} is missing or empty")
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in MODEL_REGISTRY), None)
    if arch is None:
        raise ValueError(f"unsupported architecture {archs}; supported: {sorted(MODEL_REGISTRY)}")
    model_cls, config_cls = MODEL_REGISTRY[arch]
    cfg = config_cls.from_hf(config)
    dev = resolve_device(device)
    if (gguf_path is not None or quantization is not None) and dev.type != "cpu":
        raise ValueError("quantized weights (GGUF, --quantization) run on the CPU only")
    torch_dtype = resolve_dtype(dtype, dev)
    max_len = _max_model_len(config, max_model_len)

    # Allocate parameters directly on the device in the target dtype (no random init, no
    # fp32 staging copy); the rotary tables pick their own fp32 dtype explicitly.
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device(dev):
            if tp is None:
                model = model_cls(cfg, backend, max_positions=max_len)
            else:
                from executor_svc.models.parallel_llama import ParallelLlamaForCausalLM

                model = ParallelLlamaForCausalLM(cfg, backend, max_len, tp)
    finally:
        torch.set_default_dtype(old_dtype)
    with torch.no_grad():
        if envs.load_format() == "dummy":
            fill_dummy_weights(model, float(config.get("initializer_range", 0.02)))
        elif gguf_path is not None:
            from executor_svc.features.gguf.weights import load_gguf_weights

            held = load_gguf_weights(model, gguf_path)
            log.info("gguf.loaded", gguf=str(gguf_path), **held)
        else:
            load_weights(model, _weight_files(model_dir))
        if quantization is not None:
            from executor_svc.models.quant_linear import quantize_model

            log.info("quantized", scheme=quantization, matrices=quantize_model(model, quantization))
    model.eval().requires_grad_(False)
    # fp32 tensor-parallel shards too (issue 28): packed or plain, the kernel gives the same
    # bits. bf16 shards stay plain (torch's matmul) for now.
    if dev.type == "cpu" and (
        torch_dtype == torch.float32 or (tp is None and torch_dtype == torch.bfloat16)
    ):
        model.prepack_weights()

    info = ModelInfo(
        architecture=arch,
        model_name=model_dir.resolve().name,
        vocab_size=cfg.vocab_size,
        max_model_len=max_len,
        eos_token_ids=_eos_token_ids(model_dir, config),
        num_layers=cfg.num_layers,
        num_kv_heads=model.local_config.num_kv_heads if tp is not None else cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=torch_dtype,
        device=dev,
        hidden_size=cfg.hidden_size,
        tensor_parallel_size=tp.world_size if tp is not None else 1,
    )
    return model, info


def tokenizer_class_name(model_dir: str | Path) -> str:
    """ "module:QualName" of the class `AutoTokenizer.from_pretrained(model_dir)` picks, or ""
    when the directory holds no tokenizer it can load (offline: the directory is all there is).

    The scheduler builds its tokenizer from the files with this class: AutoTokenizer's choice
    depends on tokenizer_config.json and config.json, and some classes (Qwen2Tokenizer,
    LlamaTokenizer) rebuild the pre-tokenizer, so tokenizer.json alone tokenizes differently.
    AutoTokenizer is run here because it imports torch, which the scheduler must not.
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:  # any failure: the scheduler then falls back to tokenizer.json
        log.warning("tokenizer.unresolved", model_dir=str(model_dir), error=str(e)[:500])
        return ""
    cls = type(tok)
    return f"{cls.__module__}:{cls.__qualname__}"
