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

from executor_svc.kernels import quant
from executor_svc.models import LlamaForCausalLM
from executor_svc.models.llama import Linear
from executor_svc.runner.gguf.reader import GGUFError, GGUFFile, GGUFTensor

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
    params = dict(model.named_parameters(remove_duplicate=False))
    # Linear module name -> shard id -> (tensor, rows in HF order)
    quantized: dict[str, dict[Any, tuple[GGUFTensor, np.ndarray]]] = {}
    loaded: set[tuple[str, Any]] = set()
    embed: GGUFTensor | None = None
    head: GGUFTensor | None = None  # an untied lm_head of a block type
    for t in file.tensors.values():
        if t.hf_name is None:
            continue
        target = model.checkpoint_to_param_name(t.hf_name)
        if t.hf_name == "model.embed_tokens.weight":
            embed = t
        if target is None:
            continue
        name, shard_id = target
        if name == "lm_head" and t.type_id not in quant.FLOAT_TYPES:
            head = t  # its blocks, below
            loaded.add((name, shard_id))
            continue
        if name == "embed_tokens" and t.type_id not in quant.FLOAT_TYPES:
            loaded.add((name, shard_id))  # kept as blocks, below
            continue
        if name not in params:
            raise GGUFError(f"{file.path}: tensor {t.name} matches no model parameter ({name})")
        rows = _rows(t, file, model)
        owner_name = name.rpartition(".")[0]
        owner = model.get_submodule(owner_name) if owner_name else None
        is_block = t.type_id not in quant.FLOAT_TYPES
        if isinstance(owner, Linear) and name.endswith(".weight") and is_block:
            if t.shape[0] != owner.shard_offsets[shard_id][1]:
                raise GGUFError(f"{file.path}: tensor {t.name} has shape {list(t.shape)}")
            quantized.setdefault(owner_name, {})[shard_id] = (t, rows)
            loaded.add((name, shard_id))
            continue
        param = params[name]
        try:
            param.weight_loader(param, _to_fp32(t, rows), shard_id)
        except (AssertionError, RuntimeError) as e:
            raise GGUFError(f"{file.path}: tensor {t.name} has shape {list(t.shape)}") from e
        loaded.add((name, shard_id))
    held = {"quantized": 0, "fp32": 0}
    for owner_name, shards in quantized.items():
        held_q = _pack_linear(model.get_submodule(owner_name), owner_name, shards, params)
        held["quantized"] += held_q
    if head is None and model.config.tie_word_embeddings:
        head = embed if embed is not None and embed.type_id not in quant.FLOAT_TYPES else None
    if embed is not None and embed.type_id not in quant.FLOAT_TYPES:
        data = torch.from_numpy(np.array(embed.data))
        model.quant_embedding = quant.QuantWeight(data, embed.type_id, embed.shape[1])
        model.embed_tokens.data = model.embed_tokens.data.new_empty(0)
        held["quantized"] += data.numel()
        if head is embed:  # tied: the lm_head reads the same blocks
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
        data = np.concatenate([shards[s][1] for s in order], axis=0)
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
