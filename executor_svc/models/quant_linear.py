"""``--quantization int8 | int4``: an fp32 checkpoint's matrices quantized at load into GGUF
blocks, run by the same kernels as a GGUF file's (``kernels/quant.py``).

Group-wise, 32 consecutive input weights of one output row per group (the GGUF block):

* int8 = Q8_0: symmetric, ``d = max|w| / 127`` (stored fp16), ``q = round(w / d)`` in
  [-127, 127]; 8.5 bits a weight.
* int4 = Q4_1: asymmetric, ``d = (max - min) / 15``, ``m = min`` (both fp16),
  ``q = round((w - m) / d)`` in [0, 15]; 5 bits a weight.

The lm_head (tied or not) is quantized to int8 in both modes, as llama.cpp keeps its output
matrix at 6-8 bits: the logits are where 4-bit error shows most. The embedding lookup keeps its
fp32 matrix. Every ``Linear`` whose input size is a multiple of 32 is quantized; others stay fp32.

Under tensor parallelism each rank quantizes its own shard, into the blocks the whole matrix
would have: column-parallel shards are whole rows; a row-parallel shard is quantized only when
its input slice starts and ends on a 32-weight boundary (else it stays fp32); the lm_head shard
is this rank's vocabulary rows.
"""

from __future__ import annotations

import torch

import executor_svc.models.cpu_decoder as cpu_decoder
from executor_svc.kernels import quant

SCHEMES = {"int8": quant.TYPE_IDS["Q8_0"], "int4": quant.TYPE_IDS["Q4_1"]}


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """[..., 1] fp32 -> [..., 2] uint8, the fp16 value's bytes (little-endian)."""
    return v.to(torch.float16).view(torch.uint8)


def quantize(w_oi: torch.Tensor, type_id: int) -> torch.Tensor:
    """``[out, in]`` fp32 -> ``[out, row_bytes]`` uint8 blocks of ``type_id`` (Q8_0 or Q4_1)."""
    out_features, in_features = w_oi.shape
    if in_features % 32:
        raise ValueError(f"input size {in_features} is not a multiple of 32")
    g = w_oi.float().reshape(out_features, in_features // 32, 32)
    if type_id == quant.TYPE_IDS["Q8_0"]:
        d = g.abs().amax(-1, keepdim=True) / 127
        d = d.to(torch.float16).float()  # quantize against the scale the kernel will read
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = torch.round(g * inv).clamp(-127, 127).to(torch.int8).view(torch.uint8)
        blocks = torch.cat((_f16_bytes(d), q), -1)
    elif type_id == quant.TYPE_IDS["Q4_1"]:
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        d = ((hi - lo) / 15).to(torch.float16).float()
        m = lo.to(torch.float16).float()
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = torch.round((g - m) * inv).clamp(0, 15).to(torch.uint8)
        packed = q[..., :16] | (q[..., 16:] << 4)  # element i low nibble, 16 + i high
        blocks = torch.cat((_f16_bytes(d), _f16_bytes(m), packed), -1)
    else:
        raise ValueError(f"cannot quantize to {quant.type_name(type_id)}")
    return blocks.reshape(out_features, -1).contiguous()


def quantize_model(model: torch.nn.Module, scheme: str) -> int:
    """Quantize ``model``'s ``Linear`` layers (``scheme`` "int8" or "int4") and its lm_head
    (int8) in place, before ``prepack_weights``; returns how many matrices were quantized."""
    from executor_svc.models.llama import Linear
    from executor_svc.models.parallel_layers import RowParallelLinear

    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization {scheme!r}; expected one of {', '.join(SCHEMES)}")
    cpu_decoder.reset(model)
    type_id, count = SCHEMES[scheme], 0
    for module in model.modules():
        if not isinstance(module, Linear | RowParallelLinear) or module.packed is not None:
            continue
        w_io = module.weight.data  # [in (this rank's slice, row-parallel), out]
        # A row-parallel slice must start on a block boundary to get the whole matrix's blocks.
        if w_io.dim() != 2 or w_io.shape[0] % 32 or getattr(module, "first", 0) % 32:
            continue
        module.packed = quant.QuantWeight(quantize(w_io.t(), type_id), type_id, w_io.shape[0])
        module.weight.data = w_io.new_empty(0)
        count += 1
    head = getattr(model, "lm_head", None)
    if isinstance(head, torch.Tensor) and head.dim() == 2 and head.shape[0] % 32 == 0:
        q8 = quant.TYPE_IDS["Q8_0"]
        model.packed_lm_head = quant.QuantWeight(quantize(head.data.t(), q8), q8, head.shape[0])
        if head is not getattr(model, "embed_tokens", None):
            head.data = head.data.new_empty(0)
        count += 1
    return count
