"""The decoder's layers in one kernel call on the CPU (``csrc/decoder.cpp``).

A fp32 CPU forward of ``models.llama`` makes seven kernel calls a layer through ctypes, with
the tensors, views and checks around each: on a 30-layer model that Python measured 5-13 ms a
step whatever the batch (``benchmarks/bench_cpu_decoder.py``; docs/benchmarks.md, issue 29).
``decoder.cpp`` runs the same kernels with the same arguments in the same order from C++, so
its output is bit for bit the Python path's, decode or prefill, whatever the batch
(tests/unit/test_cpu_decoder.py checks both against each other).

bf16 models take ``decoder_bf16.cpp`` (issue 44): the bf16 Python forward's kernels (the bf16
GEMM on ``gemm_bf16`` panels, the bf16 norms and SiLU, the bf16-K/V attention on widened rows)
and, done in C++ with torch's rounding, the torch ops between them (the residual add after the
MLP, the attention output's cast), so the same bits too (tests/unit/test_cpu_decoder_bf16.py).

It takes a model whose every projection the compiled kernels run as they are: fp32 panels or a
plain fp32 matrix (step-invariant numerics), or GGUF / ``--quantization`` blocks, with fp32
activations and KV cache; or bf16 panels (every input size even) with bf16 activations, norms
and KV cache; the CPU attention backend; no feature's delta on a projection
(``Linear.delta``); no q/k norm (Qwen3). Any other model, and ``LLMSERVE_CPU_FUSED_DECODER=0``,
keeps the per-layer Python forward.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from executor_svc.attention import AttentionMetadata, cpu_ops
from executor_svc.config import envs, numerics
from executor_svc.kernels import gemm, gemm_bf16, library, quant

_p, _i32, _i64, _f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
_PANELS, _PLAIN, _QUANT_SPLIT, _QUANT_BLOCKS, _BF16_PANELS = 0, 1, 2, 3, 4
_ENTRY = {torch.float32: "llmserve_decoder_f32", torch.bfloat16: "llmserve_decoder_bf16"}


class _Linear(ctypes.Structure):
    _fields_ = [("kind", _i32), ("type", _i32), ("w", _p), ("n", _i64), ("ld", _i64), ("bias", _p)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("ln_in", _p),
        ("ln_post", _p),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("k_cache", _p),
        ("v_cache", _p),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        *((name, _i64) for name in ("hidden", "intermediate", "num_heads", "num_kv_heads")),
        *((name, _i64) for name in ("head_dim", "block_size", "num_layers")),
        ("eps", _f32),
        ("scale", _f32),
        ("final_norm", _p),
    ]


def _vector(t: torch.Tensor | None, n: int, dtype: torch.dtype = torch.float32) -> bool:
    return t is None or (
        t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() and t.shape == (n,)
    )


def _describe(linear: Any, k: int, n: int) -> _Linear | None:
    """The kernel's view of a ``models.llama.Linear`` of ``k`` inputs and ``n`` outputs; None
    where the compiled kernels do not run it as it is."""
    if getattr(linear, "delta", None) is not None or not _vector(linear.bias, n):
        return None
    bias = None if linear.bias is None else linear.bias.data_ptr()
    packed, w = linear.packed, linear.weight
    if isinstance(packed, gemm.PanelWeight):
        if packed.panels.shape[1] != k or packed.out_features != n:
            return None
        return _Linear(_PANELS, 0, packed.panels.data_ptr(), n, 0, bias)
    if isinstance(packed, quant.QuantWeight):
        if packed.in_features != k or packed.out_features != n:
            return None
        kind = _QUANT_SPLIT if packed.split else _QUANT_BLOCKS
        data = packed.data
        return _Linear(kind, packed.kernel_type, data.data_ptr(), n, data.shape[1], bias)
    if packed is None and numerics.deterministic() and gemm.available():
        plain = w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2
        if plain and w.shape == (k, n) and w.stride(1) == 1 and w.stride(0) >= n:
            return _Linear(_PLAIN, 0, w.data_ptr(), n, w.stride(0), bias)
    return None


def _describe_bf16(linear: Any, k: int, n: int, keep: list[torch.Tensor]) -> _Linear | None:
    """``_describe`` for a bf16 model: bf16 panels of an even ``k`` (gemm_bf16.py pads an odd
    one), the bias as the fp32 copy ``Bf16PanelWeight.linear`` makes each call (kept here)."""
    packed, bias = linear.packed, linear.bias
    if getattr(linear, "delta", None) is not None or not isinstance(
        packed, gemm_bf16.Bf16PanelWeight
    ):
        return None
    if k % 2 or packed.in_features != k or packed.out_features != n:
        return None
    if bias is not None:
        if bias.device.type != "cpu" or bias.shape != (n,):
            return None
        bias = bias.detach().to(torch.float32).contiguous()
        keep.append(bias)
    ptr = None if bias is None else bias.data_ptr()
    return _Linear(_BF16_PANELS, 0, packed.panels.data_ptr(), n, 0, ptr)


@dataclass(eq=False)
class _Plan:
    model_desc: _Model
    layers: Any  # ctypes array of _Layer
    linears: list[Any]  # every projection described (their deltas are checked per call)
    keep: list[torch.Tensor]  # the norm weights (and bf16 biases) the descriptors point into
    dtype: torch.dtype = torch.float32  # of the activations, norms and KV cache
    kv_key: tuple[int, ...] = ()


def _build(model: Any) -> _Plan | None:
    cfg = model.config
    if cfg.qk_norm or type(model).__name__ != "LlamaForCausalLM":
        return None
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    dtype = model.norm.weight.dtype
    if dtype not in _ENTRY:
        return None
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    layers = (_Layer * cfg.num_layers)()
    linears: list[Any] = []
    keep: list[torch.Tensor] = []
    for desc, layer in zip(layers, model.layers, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        if attn.backend.attend_rope_fn is not cpu_ops.attend_rope or attn.q_norm is not None:
            return None
        sizes = {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * i), "down": (i, h)}
        linear = dict(
            zip(sizes, (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj), strict=True)
        )
        if dtype == torch.float32:
            parts = {name: _describe(linear[name], *sizes[name]) for name in sizes}
        else:
            parts = {name: _describe_bf16(linear[name], *sizes[name], keep) for name in sizes}
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if any(p is None for p in parts.values()) or not all(_vector(w, h, dtype) for w in norms):
            return None
        for name, part in parts.items():
            setattr(desc, name, part)
        desc.ln_in, desc.ln_post = (w.data_ptr() for w in norms)
        linears += [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        keep += norms
    final = model.norm.weight
    if not _vector(final, h, dtype):
        return None
    model_desc = _Model(h, i, cfg.num_heads, cfg.num_kv_heads, d, 0, cfg.num_layers)
    model_desc.eps, model_desc.scale, model_desc.final_norm = (
        cfg.rms_norm_eps,
        d**-0.5,
        final.data_ptr(),
    )
    keep.append(final)
    return _Plan(model_desc, layers, linears, keep, dtype)


def _no_delta(plan: _Plan) -> bool:
    """No feature's delta (Linear.delta) was installed since the plan was made (weights swapped by packing or
    quantizing reset the plan: ``reset``)."""
    return all(m.delta is None for m in plan.linears)


def _set_caches(plan: _Plan, kv_caches: Any) -> bool:
    first_k = kv_caches[0][0]
    # Every cache's address (~10 us): a cache reallocated at the same first address must not
    # leave the other layers' pointers stale.
    key = tuple(c.data_ptr() for pair in kv_caches for c in pair)
    if plan.kv_key == key:
        return True
    for desc, (k_cache, v_cache) in zip(plan.layers, kv_caches, strict=True):
        if not all(
            c.device.type == "cpu" and c.dtype == plan.dtype and c.is_contiguous()
            for c in (k_cache, v_cache)
        ):
            return False
        if k_cache.shape != v_cache.shape or k_cache.shape[1:] != first_k.shape[1:]:
            return False
        desc.k_cache, desc.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
    plan.model_desc.block_size = first_k.shape[1]
    plan.kv_key = key
    return True


def forward(
    model: Any,
    x: torch.Tensor,  # [num_tokens, hidden] fp32 or bf16: the input hidden states (overwritten)
    rope: tuple[torch.Tensor, torch.Tensor],
    kv_caches: Any,
    md: AttentionMetadata,
) -> torch.Tensor | None:
    """The final-normed hidden states of ``model``'s layers over ``x``, bit for bit what the
    per-layer forward gives; None when the model or the inputs are not ones this path takes
    (module doc), and the caller runs its layers itself."""
    plan = getattr(model, "_cpu_decoder_plan", False)
    if plan is False:
        lib = library.load()
        plan = _build(model) if envs.cpu_fused_decoder() and lib is not None else None
        if plan is not None and not hasattr(lib, _ENTRY[plan.dtype]):
            plan = None
        model._cpu_decoder_plan = plan
    if plan is None or x.dtype != plan.dtype or x.device.type != "cpu":
        return None
    if not _no_delta(plan) or not _set_caches(plan, kv_caches):
        return None
    cos, sin = rope
    # bf16: the tables cast once per forward (RotaryEmbedding.cos_sin), widened in the kernel
    # as attention/cpu_ops.py widens them.
    if not (cos.is_contiguous() and sin.is_contiguous() and cos.dtype == sin.dtype == plan.dtype):
        return None
    x = x.contiguous()
    out = torch.empty_like(x)
    meta = cpu_ops._Meta.of(md)
    rc = getattr(library.load(), _ENTRY[plan.dtype])(
        ctypes.addressof(plan.model_desc), ctypes.addressof(plan.layers), x.data_ptr(), x.shape[0],
        cos.data_ptr(), sin.data_ptr(), meta.tables.data_ptr(), meta.tables.stride(0),
        meta.seq_lens.data_ptr(), meta.qsl.data_ptr(), meta.seq_lens.shape[0],
        meta.slots.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"the CPU decoder kernel rejected its inputs (code {rc})")
    return out


def reset(model: Any) -> None:
    """Forget ``model``'s plan (its weights or their layout changed); the next forward builds
    a new one."""
    model.__dict__.pop("_cpu_decoder_plan", None)
