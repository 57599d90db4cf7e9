"""``LoraManager``: the executor's adapter table. It installs a ``LoraSlot`` on every packed
projection of the model, keeps loaded adapters in an LRU cache on the host (``max_cpu_loras``)
and the step's adapters on the model's device (at most ``max_loras``), and turns a step's
sequences into row groups (``begin_step``).

An adapter is named by (name, path): the scheduler owns the registry of names and sends a new
sequence's adapter with the path it stands for, so a name unloaded and loaded again from
another directory is another adapter here.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from executor_svc.features.lora.layers import LoraGroup, LoraSlot, LoraStep, pack_adapter
from executor_svc.features.lora.peft import (
    LoraAdapter,
    LoraError,
    ModelShapes,
    ModuleShape,
    load_peft_adapter,
)

AdapterKey = tuple[str, str]  # (name, path)

# packed module -> (attribute path inside a decoder layer, input width from the model config)
_MODULES = {
    "qkv_proj": ("self_attn", "hidden"),
    "o_proj": ("self_attn", "attn_out"),
    "gate_up_proj": ("mlp", "hidden"),
    "down_proj": ("mlp", "intermediate"),
}


class LoraSequence(Protocol):
    """What the manager reads of a scheduled sequence (its adapter: ``adapter_of``)."""

    features: dict[str, Any] | None
    num_scheduled_tokens: int


FEATURE = "lora"  # the feature's name: its entry in a sequence's ``features``


def adapter_of(s: Any) -> AdapterKey | None:
    """A sequence's adapter (a SeqState or the runner's view of it): (name, directory, None if
    not sent); None for the base model."""
    f = s.features
    return f.get(FEATURE) if f else None


def set_adapter(state: Any, name: str, path: str | None) -> None:
    """Give a SeqState its adapter (``name`` non-empty)."""
    if state.features is None:
        state.features = {}
    state.features[FEATURE] = (name, path)


@dataclass(frozen=True, slots=True)
class LoraConfig:
    max_loras: int = 4  # distinct adapters in one step (device slots)
    max_lora_rank: int = 64
    max_cpu_loras: int = 16  # adapters kept loaded on the host (LRU)

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be positive")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be at least max_loras")


@dataclass(slots=True)
class LoraStats:
    loads_from_disk: int = 0
    loads_from_cache: int = 0  # host cache -> device slot
    seconds_from_disk: float = 0.0
    seconds_from_cache: float = 0.0


def install_slots(model: Any, step: LoraStep) -> ModelShapes:
    """Put a ``LoraSlot`` on each packed projection of ``model`` (a models.llama decoder);
    returns the shapes adapters are checked against."""
    cfg = model.config  # the whole model's, also under tensor parallelism
    widths = {
        "hidden": cfg.hidden_size,
        "attn_out": cfg.num_heads * cfg.head_dim,
        "intermediate": cfg.intermediate_size,
    }
    kv = cfg.num_kv_heads * cfg.head_dim
    full_sizes = {
        "qkv_proj": {"q": widths["attn_out"], "k": kv, "v": kv},
        "gate_up_proj": {0: cfg.intermediate_size, 1: cfg.intermediate_size},
    }
    shapes: ModelShapes = {}
    for i, layer in enumerate(model.layers):
        for name, (block, width) in _MODULES.items():
            linear = getattr(getattr(layer, block), name)
            linear.delta = LoraSlot((i, name), step)
            shapes[(i, name)] = _module_shape(linear, widths[width], full_sizes.get(name))
    return shapes


def _module_shape(linear: Any, full_in: int, full_sizes: dict | None) -> ModuleShape:
    """The shape of a plain, column-parallel (``source_offsets``) or row-parallel (``first``,
    no ``shard_offsets``) projection of models/."""
    offsets = getattr(linear, "shard_offsets", None)
    if offsets is None:  # row-parallel: this rank's input rows, the whole output
        rows, out = linear.in_features, linear.out_features  # weight is empty once prepacked
        return ModuleShape(rows, {None: (0, out)}, in_first=linear.first, full_in=full_in)
    sources = getattr(linear, "source_offsets", None)
    return ModuleShape(
        full_in, dict(offsets), source_offsets=sources, full_sizes=full_sizes if sources else None
    )


class LoraManager:
    def __init__(
        self, model: Any, config: LoraConfig, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.config = config
        self.device, self.dtype = device, dtype
        self.step = LoraStep()
        self.shapes = install_slots(model, self.step)
        self._host: OrderedDict[AdapterKey, LoraAdapter] = OrderedDict()  # fp32, LRU order
        self._device: OrderedDict[AdapterKey, LoraAdapter] = OrderedDict()  # model dtype
        self.stats = LoraStats()

    # ------------------------------------------------------------------ cache

    def names(self) -> list[str]:
        """Adapters held (host cache), least recently used first."""
        return [name for name, _ in self._host]

    def load(self, name: str, path: str) -> LoraAdapter:
        """The adapter on the host, read from disk unless cached (LoraError if it cannot be)."""
        key = (name, path)
        adapter = self._host.get(key)
        if adapter is not None:
            self._host.move_to_end(key)
            return adapter
        t0 = time.perf_counter()
        adapter = load_peft_adapter(name, path, self.shapes, self.config.max_lora_rank)
        self.stats.loads_from_disk += 1
        self.stats.seconds_from_disk += time.perf_counter() - t0
        self._host[key] = adapter
        while len(self._host) > self.config.max_cpu_loras:
            old, _ = self._host.popitem(last=False)
            self._device.pop(old, None)
        return adapter

    def unload(self, name: str) -> bool:
        """Drop every cached copy of ``name``; False when none was held."""
        keys = [k for k in self._host if k[0] == name] + [k for k in self._device if k[0] == name]
        for k in keys:
            self._host.pop(k, None)
            self._device.pop(k, None)
        return bool(keys)

    def _on_device(self, key: AdapterKey) -> LoraAdapter:
        adapter = self._device.get(key)
        if adapter is not None:
            self._device.move_to_end(key)
            return adapter
        host = self.load(*key)
        t0 = time.perf_counter()
        adapter = pack_adapter(host.to(self.device, self.dtype))
        self.stats.loads_from_cache += 1
        self.stats.seconds_from_cache += time.perf_counter() - t0
        self._device[key] = adapter
        while len(self._device) > self.config.max_loras:
            self._device.popitem(last=False)
        return adapter

    # ------------------------------------------------------------------ step

    def check_step(self, seqs: Sequence[LoraSequence]) -> None:
        """Refuse a step with more distinct adapters than ``max_loras`` (before it runs)."""
        keys = {k for k in map(adapter_of, seqs) if k is not None}
        if len(keys) > self.config.max_loras:
            raise LoraError(
                f"a step holds {len(keys)} LoRA adapters; --max-loras is {self.config.max_loras}"
            )

    def begin_step(self, seqs: Sequence[LoraSequence]) -> None:
        """Group the step's rows (sequences back to back, ``num_scheduled_tokens`` each) by
        adapter, loading what is missing; groups keep the order of first appearance."""
        self.check_step(seqs)
        self.begin_groups(row_groups(seqs))

    def begin_groups(self, rows: dict[AdapterKey, list[int]]) -> None:
        """The step's groups from (adapter -> rows); tensor-parallel workers get them so."""
        groups = [
            LoraGroup(self._on_device(k), torch.tensor(r, dtype=torch.long, device=self.device))
            for k, r in rows.items()
        ]
        self.step.set(groups)

    def end_step(self) -> None:
        self.step.clear()


def row_groups(seqs: Sequence[LoraSequence]) -> dict[AdapterKey, list[int]]:
    """The batch rows of each adapter (sequences back to back, ``num_scheduled_tokens``
    each), adapters in order of first appearance."""
    rows: dict[AdapterKey, list[int]] = {}
    start = 0
    for s in seqs:
        n = s.num_scheduled_tokens
        key = adapter_of(s)
        if key is not None:
            if not key[1]:
                raise LoraError(f"LoRA adapter {key[0]!r} was sent without its path")
            rows.setdefault(key, []).extend(range(start, start + n))
        start += n
    return rows


def no_lora_error(seqs: Sequence[Any]) -> None:
    """A runner without LoRA refuses sequences that name an adapter."""
    for s in seqs:
        key = adapter_of(s)
        if key is not None:
            raise LoraError(f"LoRA adapter {key[0]!r} requested but LoRA is not enabled")
