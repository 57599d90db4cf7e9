"""PEFT LoRA adapter directories (``adapter_config.json`` + ``adapter_model.safetensors``) ->
``LoraAdapter``: per layer and packed projection, one ``A [in, r * num_shards]`` and one
``B_s [r, size_s]`` per targeted shard with the output columns it lands in.

The model packs q|k|v into ``qkv_proj`` and gate|up into ``gate_up_proj``. An adapter's q, k and
v (gate and up) A matrices are stacked along the rank, ``A = [A_q | A_k | A_v]``, so that one
``x @ A`` (one read of the row) serves every shard; each shard's ``B_s`` then maps its ``r``
columns of ``x @ A`` onto its own output columns of the packed projection. (A block-diagonal
``B`` would do the same in one product but read and multiply its zeros: 2-3x the work of B.)
The scaling (``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA) is folded into ``B``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# checkpoint projection -> (packed module, shard id); the shard ids match models/llama.py.
TARGETS: dict[str, tuple[str, object]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "o_proj": ("o_proj", None),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
}


class LoraError(ValueError):
    """An adapter that cannot be served; ``not_found`` tells a missing one from a malformed one
    (gRPC NOT_FOUND vs INVALID_ARGUMENT)."""

    def __init__(self, message: str, *, not_found: bool = False) -> None:
        super().__init__(message)
        self.not_found = not_found


@dataclass(frozen=True, slots=True)
class ModuleShape:
    """What an adapter must match of one packed projection: its input width and its shards
    (shard id -> (output offset, size)), as ``models.llama.Linear.shard_offsets``. Under tensor
    parallelism a rank holds a slice: A is cut like the layer's input (rows ``in_first`` on),
    each B like its output (``source_offsets``: where the shard's columns start in the whole
    projection); ``full_in`` and ``full_sizes`` are the whole model's, which the adapter's
    tensors must match."""

    in_features: int
    shard_offsets: dict[object, tuple[int, int]]
    in_first: int = 0
    source_offsets: dict[object, int] | None = None  # None: 0 for every shard
    full_in: int | None = None  # None: in_features
    full_sizes: dict[object, int] | None = None  # None: the shard sizes

    @property
    def out_features(self) -> int:
        return sum(size for _, size in self.shard_offsets.values())


# (layer index, packed module name) -> shape
ModelShapes = dict[tuple[int, str], ModuleShape]


@dataclass(slots=True)
class LoraAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    # (layer, packed module) -> (A [in, r * num_shards], [(out start, size, B_s [r, size])]),
    # B scaled; modules the adapter skips are absent. On the device each matrix may be a
    # kernels.gemm.PackedWeight instead (lora.layers.pack_adapter).
    weights: dict[tuple[int, str], tuple[Any, Any]] = field(default_factory=dict)

    def to(self, device: torch.device, dtype: torch.dtype) -> LoraAdapter:
        moved = {
            k: (
                a.to(device, dtype).contiguous(),
                [(start, size, b.to(device, dtype).contiguous()) for start, size, b in bs],
            )
            for k, (a, bs) in self.weights.items()
        }
        return LoraAdapter(self.name, self.path, self.rank, self.scaling, moved)


def read_config(path: Path) -> dict:
    if not path.is_dir():
        raise LoraError(f"LoRA adapter directory {str(path)!r} does not exist", not_found=True)
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        raise LoraError(f"{str(path)!r} is not a PEFT adapter: no {CONFIG_FILE}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoraError(f"{cfg_path}: unreadable adapter config ({e})") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"{cfg_path}: the adapter config is not a JSON object")
    return cfg


def _scaling(cfg: dict, rank: int) -> float:
    alpha = float(cfg.get("lora_alpha", rank))
    return alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


def _check_config(cfg: dict, where: str, max_rank: int) -> int:
    if str(cfg.get("peft_type", "")).upper() != "LORA":
        raise LoraError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank <= 0:
        raise LoraError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoraError(f"{where}: rank {rank} exceeds --max-lora-rank {max_rank}")
    unsupported = {
        "use_dora": "DoRA",
        "modules_to_save": "modules_to_save",
        "rank_pattern": "rank_pattern",
        "alpha_pattern": "alpha_pattern",
        "fan_in_fan_out": "fan_in_fan_out",
    }
    for key, what in unsupported.items():
        if cfg.get(key):
            raise LoraError(f"{where}: {what} adapters are not supported")
    if cfg.get("bias", "none") != "none":
        raise LoraError(f"{where}: bias={cfg['bias']!r} is not supported (only 'none')")
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str):
        raise LoraError(f"{where}: target_modules as a regex is not supported; list the names")
    bad = sorted(set(targets) - set(TARGETS))
    if bad:
        raise LoraError(f"{where}: target modules {bad} are not supported; use {sorted(TARGETS)}")
    return rank


def _parse_key(key: str) -> tuple[int, str, str] | None:
    """``...layers.<i>.<block>.<proj>.lora_<A|B>.weight`` -> (i, proj, "A"|"B")."""
    parts = key.split(".")
    if len(parts) < 5 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
        return None
    proj = parts[-3]
    try:
        layer = int(parts[parts.index("layers") + 1])
    except (ValueError, IndexError):
        return None
    return layer, proj, parts[-2][-1]


def load_peft_adapter(
    name: str, path: str | Path, shapes: ModelShapes, max_rank: int
) -> LoraAdapter:
    """Read and check one adapter directory against the model's shapes (on the CPU, fp32)."""
    path = Path(path)
    cfg = read_config(path)
    where = f"adapter {name!r} ({path})"
    rank = _check_config(cfg, where, max_rank)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        raise LoraError(f"{where}: no {WEIGHTS_FILE}")
    try:
        tensors = load_file(str(weights_path))
    except Exception as e:  # safetensors raises its own error types
        raise LoraError(f"{where}: unreadable {WEIGHTS_FILE} ({e})") from None
    # (layer, proj) -> {"A": [r, in], "B": [out_shard, r]}
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        parsed = _parse_key(key)
        if parsed is None:
            raise LoraError(f"{where}: unexpected tensor {key!r}")
        layer, proj, which = parsed
        if proj not in TARGETS:
            raise LoraError(f"{where}: tensor {key!r} targets unsupported module {proj!r}")
        found.setdefault((layer, proj), {})[which] = t.float()
    if not found:
        raise LoraError(f"{where}: {WEIGHTS_FILE} holds no LoRA tensors")
    scaling = _scaling(cfg, rank)
    # packed (layer, module) -> [(shard id, A [r, in], B [out_shard, r])]
    by_module: dict[tuple[int, str], list[tuple[object, torch.Tensor, torch.Tensor]]] = {}
    for (layer, proj), ab in sorted(found.items()):
        module, shard_id = TARGETS[proj]
        shape = shapes.get((layer, module))
        if shape is None:
            raise LoraError(f"{where}: layer {layer} does not exist in the base model")
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{where}: layer {layer} {proj} lacks lora_A or lora_B")
        a, b = ab["A"], ab["B"]
        _, size = shape.shard_offsets[shard_id]
        full_in = shape.full_in or shape.in_features
        full_size = (shape.full_sizes or {}).get(shard_id, size)
        if a.shape != (rank, full_in) or b.shape != (full_size, rank):
            raise LoraError(
                f"{where}: layer {layer} {proj} has A {tuple(a.shape)} and B {tuple(b.shape)};"
                f" the base model needs A ({rank}, {full_in}) and B ({full_size}, {rank})"
            )
        # This rank's slices (the whole matrices without tensor parallelism).
        a = a[:, shape.in_first : shape.in_first + shape.in_features]
        src = (shape.source_offsets or {}).get(shard_id, 0)
        b = b[src : src + size]
        by_module.setdefault((layer, module), []).append((shard_id, a, b))
    adapter = LoraAdapter(name, str(path), rank, scaling)
    for key, shards in by_module.items():
        shape = shapes[key]
        a_packed = torch.cat([a.t() for _, a, _ in shards], dim=1)  # [in, r * num_shards]
        b_shards = []
        for shard_id, _, b in shards:
            start, size = shape.shard_offsets[shard_id]
            b_shards.append((start, size, (b.t() * scaling).contiguous()))  # [r, size]
        adapter.weights[key] = (a_packed.contiguous(), b_shards)
    return adapter
