"""Attention metadata for one flattened batch and the choice of attention backend."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """What the attention layers of one forward need; tensors live on the model's device."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token, -1 = skip
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cu_seqlens_q
    max_query_len: int  # host copies, so kernels can size grids without a device sync
    max_seq_len: int
    num_decode_seqs: int = 0  # sequences with exactly one query token (informational)
    # Per-forward memo for backends: values derived from this metadata alone, computed by the
    # first layer and reused by the rest. Keys are prefixed with the backend name.
    scratch: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    """The two attention ops of one implementation (same signatures, see docs/internals.md)."""

    name: str  # "torch", "triton" or "cpu"
    write_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    # Optional fused entry point attend(q, k, v, key_cache, value_cache, md, scale) that may
    # reuse per-forward work through md.scratch; None = write_kv then paged_attention.
    attend_fn: Callable[..., torch.Tensor] | None = None
    # Optional attend_rope(qk, v, cos, sin, num_heads, key_cache, value_cache, md, scale): the
    # layer's rotary embedding folded into the same call; it returns None for inputs it does
    # not take, and the model then rotates q and k itself and calls attend.
    attend_rope_fn: Callable[..., torch.Tensor | None] | None = None

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """One layer's attention: store the new K/V, then attend over the paged cache."""
        if self.attend_fn is not None:
            return self.attend_fn(query, key, value, key_cache, value_cache, md, scale)
        self.write_kv(key, value, key_cache, value_cache, md.slot_mapping)
        return self.paged_attention(
            query, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc, scale
        )


def get_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """``"torch"``, ``"triton"``, ``"cpu"`` or ``"auto"``: Triton on CUDA; on CPU the compiled
    kernel of ``cpu_ops`` when it builds, else torch (see ``cpu_ops`` for the fallback)."""
    device = torch.device(device)
    if name == "auto":
        if device.type == "cuda":
            name = "triton"
        else:
            from executor_svc.attention import cpu_ops

            name = "cpu" if cpu_ops.available() else "torch"
    if name not in ("torch", "triton", "cpu"):
        raise ValueError(f"unknown attention backend {name!r}; expected torch, triton, cpu or auto")
    # Imported lazily: the Triton module needs triton (and a GPU or TRITON_INTERPRET=1).
    ops = importlib.import_module(f"executor_svc.attention.{name}_ops")
    return AttentionBackend(
        name=name,
        write_kv=ops.write_kv,
        paged_attention=ops.paged_attention,
        attend_fn=getattr(ops, "attend", None),
        attend_rope_fn=getattr(ops, "attend_rope", None),
    )


__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
