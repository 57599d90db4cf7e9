"""The Llama-family decoder split over a tensor-parallel group.

Each rank builds ``LlamaForCausalLM`` at its local size (its heads, its share of the MLP width
and of the vocabulary), then swaps in the sharded projections of ``parallel_layers.py``; rotary, norms and
the attention backend are unchanged, and run on the rank's own heads. Per layer the forward
communicates twice (after o_proj and after down_proj), plus once for the embedding and once to
gather the logits of the sampling rows onto rank 0.
"""

from __future__ import annotations

import dataclasses

import torch

from executor_svc.attention import AttentionBackend, AttentionMetadata
from executor_svc.models.llama import KVCaches, LlamaConfig, LlamaForCausalLM, matmul_io
from executor_svc.models.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    vocab_loader,
)
from executor_svc.parallel.group import TPGroup, shard_heads, tp_shape_error


class ParallelLlamaForCausalLM(LlamaForCausalLM):
    """One rank's shard. ``config`` stays the full model's; ``local_config`` is this rank's."""

    def __init__(
        self, cfg: LlamaConfig, backend: AttentionBackend, max_positions: int, tp: TPGroup
    ) -> None:
        error = tp_shape_error(
            cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, tp.world_size
        )
        if error is not None:
            raise ValueError(error)
        n, rank = tp.world_size, tp.rank
        heads = shard_heads(cfg.num_heads, cfg.num_kv_heads, n, rank)
        width = cfg.intermediate_size // n
        vocab = -(-cfg.vocab_size // n)  # per rank; the last rank's tail is padding
        local = dataclasses.replace(
            cfg,
            num_heads=heads.num_heads,
            num_kv_heads=heads.num_kv_heads,
            intermediate_size=width,
            vocab_size=vocab,
        )
        super().__init__(local, backend, max_positions)
        self.config = cfg
        self.local_config = local
        self.heads = heads
        self.tp = tp
        self.vocab_start = rank * vocab
        d, hidden = cfg.head_dim, cfg.hidden_size
        q_cols = (heads.num_heads * d, heads.first_head * d)
        kv_cols = (heads.num_kv_heads * d, heads.first_kv_head * d)
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj = ColumnParallelLinear(
                hidden, {"q": q_cols, "k": kv_cols, "v": kv_cols}, cfg.qkv_bias
            )
            attn.o_proj = RowParallelLinear(q_cols[0], hidden, cfg.o_bias, q_cols[1], tp)
            mlp.gate_up_proj = ColumnParallelLinear(
                hidden, {0: (width, rank * width), 1: (width, rank * width)}, cfg.mlp_bias
            )
            mlp.down_proj = RowParallelLinear(width, hidden, cfg.mlp_bias, rank * width, tp)
        load = vocab_loader(self.vocab_start, cfg.vocab_size)
        for param in {id(p): p for p in (self.embed_tokens, self.lm_head)}.values():
            param.weight_loader = load  # type: ignore[attr-defined]
            param.loads_slice = True  # type: ignore[attr-defined]

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: KVCaches,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size], after the final norm, the same on every rank
        local_ids = input_ids - self.vocab_start
        foreign = (local_ids < 0) | (local_ids >= self.local_config.vocab_size)
        local_ids = local_ids.masked_fill(foreign, 0)
        x = self.embed_tokens.index_select(1, local_ids).t().contiguous()  # [num_tokens, hidden]
        x = self.tp.all_reduce(x.masked_fill_(foreign[:, None], 0.0))
        rope = self.rotary.cos_sin(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(rope, x, kv_cache, attn_metadata)
        return self.norm(x)

    def prepack_weights(self) -> int:
        """As the base class, the row-parallel projections included (not ``Linear``s)."""
        rows = [m for m in self.modules() if isinstance(m, RowParallelLinear)]
        return super().prepack_weights() + sum(m.prepack() for m in rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        """[num_rows, vocab] on rank 0, None on the others; every rank must call it."""
        if self.packed_lm_head is not None:
            local = self.packed_lm_head.linear(hidden, None)
        else:
            local = matmul_io(hidden, self.lm_head)
        logits = self.tp.gather_last_dim(local)
        if logits is None or logits.shape[-1] == self.config.vocab_size:
            return logits
        return logits[:, : self.config.vocab_size].contiguous()
