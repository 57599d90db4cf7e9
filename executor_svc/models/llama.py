"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flattened batch.

A batch is one row per scheduled token, sequences back to back, no padding: prefill chunks and
decode tokens go through the same forward. Attention reads and writes the paged KV cache through
the attention backend, so the model itself keeps no per-sequence state.

Parameters are packed (``qkv_proj`` = q|k|v, ``gate_up_proj`` = gate|up) so that each layer does
two fewer matmul launches and reads its weights in long contiguous runs; every parameter carries a
``weight_loader(param, loaded, shard_id)`` that places a checkpoint tensor into its slice.

Matrices are stored transposed, ``[in, out]`` (checkpoints are ``[out, in]``); see ``matmul_io``
for why and how they are applied.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import executor_svc.models.cpu_decoder as cpu_decoder
from executor_svc.attention import AttentionBackend, AttentionMetadata
from executor_svc.config import envs, numerics
from executor_svc.kernels import elementwise, gemm

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer (key_cache, value_cache)


@dataclass(slots=True)
class LlamaConfig:
    """The subset of a Hugging Face config.json this model needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # None = default rope
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (and Llama with attention_bias)
    o_bias: bool = False  # attention_bias also covers o_proj (not Qwen2's built-in qkv bias)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rope
    mlp_bias: bool = False

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlamaConfig:
        model_type = cfg.get("model_type", "llama")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        # transformers >= 5 writes rope settings as "rope_parameters" (theta inside); older
        # checkpoints use "rope_theta" + "rope_scaling" with "type" or "rope_type".
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=bool(cfg.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
        )


def _set_loader(param: nn.Parameter, loader: Callable[..., None]) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
    assert param.shape == loaded.shape, (param.shape, loaded.shape)
    param.data.copy_(loaded)


def transposed_weight_loader(
    param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None
) -> None:
    assert param.shape == loaded.shape[::-1], (param.shape, loaded.shape)
    param.data.copy_(loaded.t())


def _find_onednn_linear() -> Callable[..., torch.Tensor] | None:
    try:
        return torch.ops.mkldnn._linear_pointwise if torch.backends.mkldnn.is_available() else None
    except (AttributeError, RuntimeError):
        return None


_ONEDNN_LINEAR = _find_onednn_linear()


@functools.cache
def _cuda_elementwise() -> ModuleType | None:
    """The fused Triton elementwise kernels for CUDA tensors (None when turned off)."""
    if not envs.cuda_fused():
        return None
    from executor_svc.kernels import triton_elementwise

    return triton_elementwise


@functools.cache
def _cuda_gemm() -> ModuleType:
    """The step-invariant Triton GEMM (imported on first CUDA use: it needs triton)."""
    from executor_svc.kernels import triton_gemm

    return triton_gemm


def matmul_io(x: torch.Tensor, w_io: torch.Tensor, bias: torch.Tensor | None = None):
    """``x [num_tokens, in] @ w_io [in, out] (+ bias)``.

    On CPU a decode step is bound by reading the weights. Measured on the benchmark's model
    (benchmarks/bench_decode.py, one thread, AMD EPYC): for one row MKL streams ``[in, out]``
    weights ~1.4x faster than ``F.linear`` on ``[out, in]`` (2x for lm_head) but does not use a
    second thread; for 2+ rows, or one row with 2+ threads, oneDNN's linear on the same storage
    is 10-25% faster than either MKL form. CUDA (cuBLAS) runs every form at the same speed, so
    it takes the plain matmul; so do CPU fp16/bf16, which oneDNN supports only on CPUs with the
    matching instructions.

    With step-invariant numerics (the default) fp32 CPU goes to ``gemm.matmul`` instead: MKL
    and oneDNN give a row other bits depending on how many rows come with it. On CUDA cuBLAS
    does the same; ``LLMSERVE_CUDA_INVARIANT=1`` tries ``kernels.triton_gemm`` (experimental,
    see config/envs.py).
    """
    y = gemm.matmul(x, w_io, bias)  # None: not fp32 CPU, or numerics not step-invariant
    if y is not None:
        return y
    if x.is_cuda and numerics.deterministic() and envs.cuda_invariant():
        return _cuda_gemm().matmul(x, w_io, bias)  # cuBLAS picks its kernel by the row count
    use_onednn = x.shape[0] > 1 or torch.get_num_threads() > 1
    if use_onednn and x.is_cpu and x.dtype == torch.float32 and _ONEDNN_LINEAR is not None:
        return _ONEDNN_LINEAR(x.contiguous(), w_io.t(), bias, "none", [], "")
    y = torch.matmul(x, w_io)
    return y if bias is None else y + bias


class Linear(nn.Module):
    """y = x W (+ b) with W stored [in, out]; ``shard_sizes`` packs several along ``out``."""

    def __init__(
        self, in_features: int, shard_sizes: dict[Any, int] | int, bias: bool = False
    ) -> None:
        super().__init__()
        if isinstance(shard_sizes, int):
            shard_sizes = {None: shard_sizes}
        self.shard_offsets: dict[Any, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        self.weight = _set_loader(nn.Parameter(torch.empty(in_features, offset)), self._load)
        self.bias = _set_loader(nn.Parameter(torch.empty(offset)), self._load) if bias else None
        self.packed: gemm.PackedWeight | None = None  # set by prepack(); weight is emptied
        # A feature's per-layer extension point (None: the plain projection): an object whose
        # ``apply(x, y)`` returns ``y`` plus what the feature adds to this step's rows.
        self.delta: Any = None

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        start, size = self.shard_offsets[shard_id]
        if param.dim() == 2:  # checkpoint [out, in] -> our [in, out]
            param.data.narrow(1, start, size).copy_(loaded.t())
        else:
            param.data.narrow(0, start, size).copy_(loaded)

    def prepack(self) -> bool:
        """Replace the plain weight by its packed form for CPU fp32 (``gemm.pack``), keeping
        one copy in memory; False where packing does not apply."""
        if self.packed is None:
            self.packed = gemm.pack(self.weight.data)
            if self.packed is None:
                return False
            self.weight.data = self.weight.data.new_empty(0)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            y = self.packed.linear(x, self.bias)
        else:
            y = matmul_io(x, self.weight, self.bias)
        return y if self.delta is None else self.delta.apply(x, y)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _set_loader(nn.Parameter(torch.empty(dim)), default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dim() == 2 and (ops := _cuda_elementwise()) is not None:
            return ops.add_rms_norm(x, None, self.weight, self.eps)[1]
        fused = elementwise.add_rms_norm(x, None, self.weight, self.eps)  # fp32 / bf16 CPU rows
        if fused is not None:
            return fused[1]
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op
        # Statistics in fp32 whatever the compute dtype, as the reference implementation does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(x + delta, norm(x + delta)): one compiled pass for fp32 CPU rows and on CUDA."""
        if x.is_cuda and (ops := _cuda_elementwise()) is not None:
            return ops.add_rms_norm(x, delta, self.weight, self.eps)
        fused = elementwise.add_rms_norm(x, delta, self.weight, self.eps)
        if fused is not None:
            return fused
        x = x + delta
        return x, self(x)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency remap: long wavelengths slowed by ``factor``, short ones kept,
    a linear blend (in 1/wavelength) between ``low_freq_factor`` and ``high_freq_factor``."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # smooth = 0 where wavelen >= old_len / low (fully scaled), 1 where <= old_len / high (kept).
    smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (halves rotated) with a precomputed cos/sin table."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
    ) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        rope_type = (scaling or {}).get("rope_type", "default")
        if rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "dynamic":
            # Dynamic NTK only changes frequencies past max_position_embeddings, and
            # max_model_len never exceeds that, so within our range it is the default rope.
            pass
        elif rope_type != "default":
            raise ValueError(f"rope scaling type {rope_type!r} is not supported")
        inv_freq = inv_freq.float()
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim / 2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Tables for one forward ([num_tokens, 1, head_dim / 2]); looked up once, not per layer."""
        return (
            self.cos[positions].unsqueeze(1).to(dtype),
            self.sin[positions].unsqueeze(1).to(dtype),
        )

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, num_heads, head_dim]
        if x.is_cuda and x.stride(-1) == 1 and (ops := _cuda_elementwise()) is not None:
            return ops.rope(x, cos, sin)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, backend: AttentionBackend):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = Linear(
            cfg.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}, cfg.qkv_bias
        )
        self.o_proj = Linear(self.q_size, cfg.hidden_size, cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.backend = backend

    def forward(
        self,
        rope: tuple[torch.Tensor, ...],
        x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, kvh, d)
        if self.q_norm is not None:
            q = self.q_norm(qkv[:, : self.q_size].view(num_tokens, h, d))
            k = self.k_norm(
                qkv[:, self.q_size : self.q_size + self.kv_size].view(num_tokens, kvh, d)
            )
            qk = torch.cat((q, k), dim=1)
        else:
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, h + kvh, d)
        key_cache, value_cache = kv_cache
        fused = self.backend.attend_rope_fn
        out = None
        if fused is not None:  # rope, K/V write and attention in one call
            out = fused(qk, v, *rope, h, key_cache, value_cache, md, self.scale)
        if out is None:
            # One rotary call for q and k together: they share positions and frequencies.
            qk = RotaryEmbedding.apply(qk, *rope)
            q, k = qk[:, :h], qk[:, h:]
            out = self.backend.attend(q, k, v, key_cache, value_cache, md, self.scale)
        return self.o_proj(out.reshape(num_tokens, h * d))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(
            cfg.hidden_size, {0: cfg.intermediate_size, 1: cfg.intermediate_size}, cfg.mlp_bias
        )
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        act = elementwise.silu_mul(gate_up)  # fp32 / bf16 CPU: one pass; None for anything else
        if act is None and gate_up.is_cuda and (ops := _cuda_elementwise()) is not None:
            act = ops.silu_mul(gate_up)
        if act is None:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            act = F.silu(gate) * up
        return self.down_proj(act)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, backend: AttentionBackend):
        super().__init__()
        self.self_attn = Attention(cfg, backend)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        rope: tuple[torch.Tensor, ...],
        x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.self_attn(rope, self.input_layernorm(x), kv_cache, md)
        x, normed = self.post_attention_layernorm.add_forward(x, h)
        return x + self.mlp(normed)


class LlamaForCausalLM(nn.Module):
    """The whole decoder; parameter names follow HF checkpoints, with q/k/v and gate/up packed."""

    # checkpoint sub-name -> (packed parameter sub-name, shard id)
    packed_modules: dict[str, tuple[str, Any]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: LlamaConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        # [hidden, vocab] like every matrix here, so a tied lm_head shares it as is.
        self.embed_tokens = _set_loader(
            nn.Parameter(torch.empty(cfg.hidden_size, cfg.vocab_size)), transposed_weight_loader
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.packed_lm_head: gemm.PackedWeight | None = None  # set by prepack_weights()
        # A GGUF embedding kept as blocks (kernels.quant.QuantWeight, features/gguf/weights.py):
        # lookups de-quantize their rows; embed_tokens is then empty.
        self.quant_embedding: Any = None
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = _set_loader(
                nn.Parameter(torch.empty(cfg.hidden_size, cfg.vocab_size)), transposed_weight_loader
            )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: KVCaches,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size], after the final norm
        if self.quant_embedding is not None:
            x = self.quant_embedding.rows(input_ids)  # [num_tokens, hidden]
        elif (x := elementwise.gather_columns(self.embed_tokens, input_ids)) is None:
            x = self.embed_tokens.index_select(1, input_ids).t().contiguous()
        rope = self.rotary.cos_sin(positions, x.dtype)
        if (
            x.device.type == "cpu"
            and (out := cpu_decoder.forward(self, x, rope, kv_caches, attn_metadata)) is not None
        ):
            return out  # every layer in one kernel call, the same bits (models/cpu_decoder.py)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(rope, x, kv_cache, attn_metadata)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> [num_rows, vocab]; call it only on the rows that sample."""
        if self.packed_lm_head is not None:
            return self.packed_lm_head.linear(hidden, None)
        return matmul_io(hidden, self.lm_head)

    def prepack_weights(self) -> int:
        """Pack every ``Linear`` and the lm_head for CPU fp32 (``kernels.gemm`` module doc) in place;
        returns how many were packed. A tied lm_head gets its own packed copy: the embedding
        lookup still reads the plain matrix."""
        cpu_decoder.reset(self)
        count = sum(m.prepack() for m in self.modules() if isinstance(m, Linear))
        if self.packed_lm_head is None:
            self.packed_lm_head = gemm.pack(self.lm_head.data)
            if self.packed_lm_head is not None:
                count += 1
                if self.lm_head is not self.embed_tokens:
                    self.lm_head.data = self.lm_head.data.new_empty(0)
        return count

    def checkpoint_to_param_name(self, name: str) -> tuple[str, Any] | None:
        """(parameter name, shard id) a checkpoint tensor loads into; None for tensors to skip."""
        name = name.removeprefix("model.")
        if "rotary_emb." in name:
            return None  # precomputed buffers some old checkpoints carry
        if name == "embed_tokens.weight":
            return "embed_tokens", None
        if name == "lm_head.weight":
            # With tied weights the embedding is authoritative (some checkpoints store both).
            return None if self.config.tie_word_embeddings else ("lm_head", None)
        for ckpt_part, (packed, shard_id) in self.packed_modules.items():
            if f".{ckpt_part}." in name:
                return name.replace(f".{ckpt_part}.", f".{packed}."), shard_id
        return name, None
