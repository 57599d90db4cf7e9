"""Draft models for speculative decoding tests and benchmarks, built offline from a checkpoint:
the same model with only its first layers (same embeddings, final norm and LM head, so the same
tokenizer and a partial agreement with the full model)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

__all__ = ["truncate_checkpoint"]


def truncate_checkpoint(src: str | Path, dst: str | Path, num_layers: int) -> Path:
    """Write ``src`` with only decoder layers [0, num_layers) to ``dst``; returns ``dst``."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in [1, {config['num_hidden_layers']}]")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():  # tokenizer and generation files as they are
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)
    config["num_hidden_layers"] = num_layers
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    kept = {}
    for shard in sorted(src.glob("*.safetensors")):
        for name, t in load_file(shard).items():
            parts = name.split(".")
            if "layers" in parts:
                layer = int(parts[parts.index("layers") + 1])
                if layer >= num_layers:
                    continue
            kept[name] = t.contiguous()
    save_file(kept, dst / "model.safetensors", metadata={"format": "pt"})
    return dst
