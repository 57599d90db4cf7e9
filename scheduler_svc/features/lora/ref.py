"""Which adapter a request runs with, and what that means for the scheduling core: the root of
its prefix-cache hash chain (a hit never crosses adapters) and the core request's tag.

An adapter is (name, path): the registry (``registry.py``) resolves a name to its directory
when a request arrives, and the pair travels with the request (Redis, the step message), so an
adapter unloaded and loaded again from another directory is another adapter everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from hashlib import blake2b
from typing import Any

__all__ = ["LoraRef", "core_fields", "lora_root_hash", "stored_lora"]


@dataclass(frozen=True, slots=True)
class LoraRef:
    name: str
    path: str


def lora_root_hash(lora: LoraRef | None) -> bytes | None:
    """Parent hash of a sequence's first block: None for the base model, else the adapter's
    (its KV differs from the base model's from the first layer's k/v projections on)."""
    if lora is None:
        return None
    h = blake2b(b"llmserve-lora\0", digest_size=16)
    h.update(lora.name.encode() + b"\0" + lora.path.encode())
    return h.digest()


def core_fields(lora: LoraRef | None) -> dict[str, Any]:
    """The core Request's fields for a request on ``lora``: the adapter as its tag (the step
    limit and the step message read it) and the adapter's prefix-cache root."""
    if lora is None:
        return {}
    return {"tag": lora, "cache_root": lora_root_hash(lora)}


def stored_lora(lora: LoraRef | None) -> list[str] | None:
    """How a request's adapter is stored with it (Redis): [name, path], or None."""
    return None if lora is None else [lora.name, lora.path]
