"""``LoraRegistry``: adapter name -> PEFT directory, for the requests that name an adapter.

Filled from ``--lora-modules name=path`` at start and by LoadLoraAdapter/UnloadLoraAdapter
live. A load reads the adapter's config (no torch here: the executor checks the tensors against
the model when it first loads them) so that a missing or malformed adapter is refused at load
time with a message that names what is wrong, not when a request first runs it.

A request resolves its adapter's name once, when it arrives; the (name, path) pair is then
stored with it (Redis) so that it resumes on the same adapter after a restart even if the name
was unloaded or reloaded meanwhile.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from protos import executor_pb2 as epb
from scheduler_svc.core.errors import NotFound, ValidationError
from scheduler_svc.features.lora.ref import LoraRef

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TARGETS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


@dataclass(frozen=True, slots=True)
class LoraAdapterInfo:
    ref: LoraRef
    rank: int


def read_adapter(name: str, path: str, max_rank: int) -> LoraAdapterInfo:
    """Check a PEFT LoRA directory's config (ValidationError or NotFound saying why)."""
    where = f"LoRA adapter {name!r} ({path})"
    root = Path(path)
    if not root.is_dir():
        raise NotFound(f"{where}: no such directory")
    try:
        cfg = json.loads((root / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise ValidationError(f"{where}: not a PEFT adapter (no {CONFIG_FILE})") from None
    except (OSError, ValueError) as e:
        raise ValidationError(f"{where}: unreadable {CONFIG_FILE} ({e})") from None
    if not isinstance(cfg, dict) or str(cfg.get("peft_type", "")).upper() != "LORA":
        raise ValidationError(f"{where}: peft_type is not LORA")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValidationError(f"{where}: r must be a positive integer, got {rank!r}")
    if max_rank and rank > max_rank:
        raise ValidationError(
            f"{where}: rank {rank} exceeds the executors' max LoRA rank {max_rank}"
        )
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str) or not set(targets) <= TARGETS:
        raise ValidationError(
            f"{where}: target_modules {targets!r} not supported; use a list of {sorted(TARGETS)}"
        )
    for key in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise ValidationError(f"{where}: {key} is not supported")
    if not (root / WEIGHTS_FILE).is_file():
        raise ValidationError(f"{where}: no {WEIGHTS_FILE}")
    return LoraAdapterInfo(LoraRef(name, str(root.resolve())), rank)


def parse_lora_modules(specs: list[str]) -> list[tuple[str, str]]:
    """``["name=path", ...]`` -> [(name, path)] (ValueError naming a bad entry)."""
    out = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules entry {spec!r} is not name=path")
        out.append((name, path))
    return out


class LoraRegistry:
    def __init__(self, base_model_names: tuple[str, ...] = (), max_rank: int = 0) -> None:
        self._adapters: dict[str, LoraAdapterInfo] = {}
        self.base_model_names = base_model_names  # names an adapter may not take
        self.max_rank = max_rank  # 0: not known (no executor described yet)

    @classmethod
    def of(cls, modules: list[tuple[str, str]]) -> LoraRegistry:
        """The registry of ``--lora-modules``; a bad entry fails the start."""
        registry = cls()
        for name, path in modules:
            registry.load(name, path)
        return registry

    def __len__(self) -> int:
        return len(self._adapters)

    def has(self, name: str) -> bool:
        return name in self._adapters

    def adapters(self) -> list[LoraAdapterInfo]:
        return list(self._adapters.values())

    def load(self, name: str, path: str) -> LoraAdapterInfo:
        info = self.check(name, path)
        self._adapters[name] = info
        return info

    def check(self, name: str, path: str) -> LoraAdapterInfo:
        """What ``load`` would register, without registering it."""
        if not name or any(c.isspace() for c in name):
            raise ValidationError(f"LoRA adapter name {name!r} is not valid")
        if name in self.base_model_names:
            raise ValidationError(f"LoRA adapter name {name!r} is the base model's name")
        info = read_adapter(name, path, self.max_rank)
        old = self._adapters.get(name)
        if old is not None and old.ref != info.ref:
            raise ValidationError(
                f"LoRA adapter {name!r} is loaded from {old.ref.path}; unload it first"
            )
        return info

    def unload(self, name: str) -> None:
        if self._adapters.pop(name, None) is None:
            raise NotFound(f"LoRA adapter {name!r} is not loaded")

    def resolve(self, name: str) -> LoraRef:
        info = self._adapters.get(name)
        if info is None:
            known = ", ".join(sorted(self._adapters)) or "none loaded"
            raise NotFound(f"LoRA adapter {name!r} is not loaded (adapters: {known})")
        return info.ref


async def load_on_executors(executors: Iterable[Any], name: str, path: str) -> None:
    """Have every reachable executor read the adapter and check it against its model; the
    first refusal is raised (ValidationError / NotFound). One that cannot be reached now loads
    it with the first step that names it."""
    req = epb.LoadLoraAdapterRequest(name=name, path=path)
    for ex in executors:
        if not ex.healthy:
            continue
        try:
            await ex.stub.LoadLoraAdapter(req, timeout=60)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise NotFound(f"executor {ex.address}: {e.details()}") from None
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValidationError(f"executor {ex.address}: {e.details()}") from None
