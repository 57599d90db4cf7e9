"""The attention backends (torch reference, Triton, the CPU kernel) and the choice among them;
``AttentionMetadata`` (``metadata.py``) is what every backend reads of one flattened batch."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from executor_svc.attention.metadata import AttentionMetadata


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
