"""A GGUF file's tensors into the model, the block types kept as they are.

- Matrices of a block type (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) become ``QuantWeight``s in their
  ``Linear``'s ``packed`` slot (the fp32 weight is emptied): q|k|v and gate|up pack their rows
  one after the other, as the fp32 layer packs columns. Where the shards of one packed layer
  have different types (some quantizers give v another type than q), the layer is de-quantized
  to fp32 instead, logged.
- A block-type embedding stays as blocks too (``model.quant_embedding``): a lookup de-quantizes
  its rows (bit for bit gguf's values); a tied lm_head runs on the same blocks
  (``packed_lm_head``), an untied one on its own.
- F32 / F16 / BF16 tensors are de-quantized to fp32 and go through the parameters' own loaders.
- Tensor parallelism (``ParallelLlamaForCausalLM``): a rank keeps the blocks of its shard, the
  same blocks the whole matrix has: its output rows of a column-parallel layer, its block
  columns of a row-parallel one (when its input slice starts and ends on a block boundary; else
  that layer is de-quantized to fp32, logged), its vocabulary rows of the lm_head (the last
  rank's padding rows are zero blocks). The embedding is de-quantized to fp32 there: the
  sharded lookup indexes the parameter.
- Llama GGUFs store q and k rows permuted for llama.cpp's rope (interleaved pairs); the inverse
  permutation is applied to the rows, as transformers' GGUF loader applies it to its fp32
  matrices, so the blocks need no change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from executor_svc.features.gguf.reader import GGUFError, GGUFFile, GGUFTensor
from executor_svc.kernels import quant
from executor_svc.models import LlamaForCausalLM
from executor_svc.models.llama import Linear
from executor_svc.models.parallel_layers import RowParallelLinear

log = structlog.get_logger(__name__)


def _unpermute_rows(num_rows: int, num_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (transformers' reverse_permute)."""
    dim = num_rows // num_heads // 2
    return np.arange(num_rows).reshape(num_heads, dim, 2).swapaxes(2, 1).reshape(-1)


def _rows(t: GGUFTensor, file: GGUFFile, model: LlamaForCausalLM) -> np.ndarray:
    """The tensor's storage rows in HF order (q and k un-permuted for llama)."""
    data = t.data
    if file.architecture == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
        cfg = model.config
        heads = cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads
        data = data[_unpermute_rows(data.shape[0], heads)]
    return data


def _blocks(t: GGUFTensor, rows: np.ndarray) -> np.ndarray:
    """A block-type tensor's rows as ``[out, row_bytes]`` uint8."""
    return np.asarray(rows).reshape(t.shape[0], quant.row_bytes(t.type_id, t.shape[1]))


def _to_fp32(t: GGUFTensor, rows: np.ndarray) -> torch.Tensor:
    """The tensor's values as fp32, HF shape."""
    if t.type_id == 0:
        return torch.from_numpy(np.array(rows, dtype=np.float32)).reshape(t.shape)
    if t.type_id == 1:
        return torch.from_numpy(rows.astype(np.float32)).reshape(t.shape)
    k = t.shape[-1]
    data = torch.from_numpy(np.array(rows)).reshape(-1, quant.row_bytes(t.type_id, k))
    return quant.dequantize(t.type_id, data, k).reshape(t.shape)


def load_gguf_weights(model: LlamaForCausalLM, gguf_path: str | Path) -> dict[str, int]:
    """Fill every parameter of ``model`` from the GGUF file; returns bytes held per kind
    ("quantized", "fp32") for the start-up log. Fails on gaps, strays and shape mismatches."""
    file = GGUFFile(gguf_path)
    sharded = getattr(model, "tp", None) is not None  # a ParallelLlamaForCausalLM rank
    params = dict(model.named_parameters(remove_duplicate=False))
    # Linear module name -> shard id -> (tensor, rows in HF order)
    quantized: dict[str, dict[Any, tuple[GGUFTensor, np.ndarray]]] = {}
    loaded: set[tuple[str, Any]] = set()
    token_embd: GGUFTensor | None = None
    head: GGUFTensor | None = None  # an untied lm_head of a block type
    held_rows = 0  # row-parallel shards kept as blocks
    for t in file.tensors.values():
        if t.hf_name is None:
            continue
        target = model.checkpoint_to_param_name(t.hf_name)
        if t.hf_name == "model.embed_tokens.weight":
            token_embd = t
        if target is None:
            continue
        name, shard_id = target
        if name == "lm_head" and t.type_id not in quant.FLOAT_TYPES:
            head = t  # its blocks, below
            loaded.add((name, shard_id))
            continue
        if name == "embed_tokens" and t.type_id not in quant.FLOAT_TYPES and not sharded:
            loaded.add((name, shard_id))  # kept as blocks, below
            continue
        if name not in params:
            raise GGUFError(f"{file.path}: tensor {t.name} matches no model parameter ({name})")
        rows = _rows(t, file, model)
        owner_name = name.rpartition(".")[0]
        owner = model.get_submodule(owner_name) if owner_name else None
        is_block = t.type_id not in quant.FLOAT_TYPES
        if isinstance(owner, Linear) and name.endswith(".weight") and is_block:
            size = owner.shard_offsets[shard_id][1]
            first = getattr(owner, "source_offsets", {}).get(shard_id, 0)  # column-parallel
            if (t.shape[0] != size and not sharded) or first + size > t.shape[0]:
                raise GGUFError(f"{file.path}: tensor {t.name} has shape {list(t.shape)}")
            quantized.setdefault(owner_name, {})[shard_id] = (t, rows)
            loaded.add((name, shard_id))
            continue
        row_shard = isinstance(owner, RowParallelLinear) and name.endswith(".weight")
        if row_shard and is_block and _pack_row_shard(owner, owner_name, t, rows):
            held_rows += owner.packed.nbytes
            loaded.add((name, shard_id))
            continue
        param = params[name]
        try:
            param.weight_loader(param, _to_fp32(t, rows), shard_id)
        except (AssertionError, RuntimeError) as e:
            raise GGUFError(f"{file.path}: tensor {t.name} has shape {list(t.shape)}") from e
        loaded.add((name, shard_id))
    held = {"quantized": held_rows, "fp32": 0}
    for owner_name, shards in quantized.items():
        held_q = _pack_linear(model.get_submodule(owner_name), owner_name, shards, params)
        held["quantized"] += held_q
    if head is None and model.config.tie_word_embeddings:
        head = (
            token_embd
            if token_embd is not None and token_embd.type_id not in quant.FLOAT_TYPES
            else None
        )
    if sharded and head is not None:  # this rank's vocabulary rows, padding rows zero blocks
        model.packed_lm_head = _vocab_shard(model, head)
        if model.lm_head is not model.embed_tokens:
            model.lm_head.data = model.lm_head.data.new_empty(0)
        held["quantized"] += model.packed_lm_head.nbytes
        head = None
    if token_embd is not None and token_embd.type_id not in quant.FLOAT_TYPES and not sharded:
        data = torch.from_numpy(np.array(token_embd.data))
        model.quant_embedding = quant.QuantWeight(data, token_embd.type_id, token_embd.shape[1])
        model.embed_tokens.data = model.embed_tokens.data.new_empty(0)
        held["quantized"] += data.numel()
        if head is token_embd:  # tied: the lm_head reads the same blocks
            model.packed_lm_head = model.quant_embedding
            head = None
    if head is not None:
        data = torch.from_numpy(np.array(head.data))
        model.packed_lm_head = quant.QuantWeight(data, head.type_id, head.shape[1])
        if model.lm_head is not model.embed_tokens:
            model.lm_head.data = model.lm_head.data.new_empty(0)
        held["quantized"] += data.numel()
    expected: set[tuple[str, Any]] = set()
    for name in params:
        owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else None
        expected.update((name, sid) for sid in getattr(owner, "shard_offsets", {None: None}))
    if model.config.tie_word_embeddings:
        expected.discard(("lm_head", None))
    missing = sorted(str(m) for m in expected - loaded)
    if missing:
        raise GGUFError(f"{file.path}: lacks weights for {', '.join(missing[:8])}")
    held["fp32"] = sum(p.numel() * 4 for p in model.parameters())
    return held


def _pack_linear(
    linear: Linear,
    name: str,
    shards: dict[Any, tuple[GGUFTensor, np.ndarray]],
    params: dict[str, torch.nn.Parameter],
) -> int:
    """Put one Linear's quantized shards into its ``packed`` slot; bytes held."""
    order = list(linear.shard_offsets)
    types = {shards[s][0].type_id for s in order}
    weight = params[f"{name}.weight"]
    if len(types) == 1:
        # A column-parallel shard takes its rows of each part (all of them without TP).
        firsts = getattr(linear, "source_offsets", {})
        parts = []
        for s in order:
            first, size = firsts.get(s, 0), linear.shard_offsets[s][1]
            parts.append(_blocks(shards[s][0], shards[s][1])[first : first + size])
        data = np.concatenate(parts, axis=0)
        in_features = shards[order[0]][0].shape[1]
        linear.packed = quant.QuantWeight(
            torch.from_numpy(np.array(data)), types.pop(), in_features
        )
        weight.data = weight.data.new_empty(0)
        return linear.packed.nbytes
    log.info("gguf.mixed_types", layer=name, types=sorted(quant.type_name(t) for t in types))
    for s in order:
        t, rows = shards[s]
        weight.weight_loader(weight, _to_fp32(t, rows), s)
    return 0


def _pack_row_shard(layer: RowParallelLinear, name: str, t: GGUFTensor, rows: np.ndarray) -> bool:
    """A row-parallel layer's input slice as its own blocks; False (the caller de-quantizes)
    where the slice does not start and end on a block boundary."""
    _, block, nbytes = quant.TYPES[t.type_id]
    first, n = layer.first, layer.in_features
    if first % block or n % block:
        log.info("gguf.tp_dequantized", layer=name, type=quant.type_name(t.type_id), block=block)
        return False
    data = _blocks(t, rows)[:, first // block * nbytes : (first + n) // block * nbytes]
    layer.packed = quant.QuantWeight(torch.from_numpy(np.ascontiguousarray(data)), t.type_id, n)
    layer.weight.data = layer.weight.data.new_empty(0)
    return True


def _vocab_shard(model: LlamaForCausalLM, t: GGUFTensor) -> quant.QuantWeight:
    """Rows [vocab_start, vocab_start + local vocab) of a block-type lm_head / embedding; rows
    past the vocabulary (the last rank's padding) are zero blocks, whose logits are cut off."""
    start, n = model.vocab_start, model.local_config.vocab_size
    part = _blocks(t, t.data)[start : start + n]
    data = np.zeros((n, part.shape[1]), dtype=np.uint8)
    data[: part.shape[0]] = part
    return quant.QuantWeight(torch.from_numpy(data), t.type_id, t.shape[1])
