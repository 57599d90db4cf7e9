"""A GGUF file opened and checked at start-up: every tensor's type is one this build runs, every
tensor lies inside the file, and the names map onto the model's parameters.

Anything wrong is a ``GGUFError`` naming the file and what is wrong (an unsupported tensor type
by name, a truncated file), raised before the model is built, never a crash mid-run. Reading
uses the ``gguf`` package (memory-mapped: the quantized blocks are not copied until a layer
takes its rows).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from executor_svc.kernels import quant

# Architectures served (GGUF's general.architecture) -> the HF architecture name.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# GGUF tensor name parts -> HF checkpoint names (per layer; ``{}`` is the layer index).
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL = re.compile(r"^([a-z_]+)\.(weight|bias)$")


class GGUFError(ValueError):
    """A GGUF file this executor cannot serve; the message names the file and the reason."""


@dataclass(slots=True)
class GGUFTensor:
    """One tensor of the file, as stored: ``data`` is [rows, row_bytes] uint8 for block types,
    the values for F32 / F16, raw uint8 for BF16."""

    name: str  # GGUF name, e.g. "blk.0.attn_q.weight"
    hf_name: str | None  # HF checkpoint name, None for tensors the model does not use
    type_id: int
    shape: tuple[int, ...]  # HF order: [out, in] for matrices
    data: np.ndarray

    @property
    def type_name(self) -> str:
        return quant.type_name(self.type_id)


def hf_name(name: str) -> str | None:
    """The HF checkpoint name of GGUF tensor ``name``; None for ones the model does not read
    (rope frequency tables some converters store)."""
    m = _LAYER.match(name)
    if m:
        part = _LAYER_NAMES.get(m.group(2))
        return None if part is None else f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
    m = _GLOBAL.match(name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: the file itself, or the one ``.gguf`` in a directory that
    holds no config.json; None when ``path`` is not a GGUF model."""
    path = Path(path).expanduser()
    if path.is_file():
        return path if path.suffix == ".gguf" or _has_magic(path) else None
    if path.is_dir() and not (path / "config.json").is_file():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            names = ", ".join(f.name for f in files)
            raise GGUFError(f"{path} holds several GGUF files ({names}); name one of them")
        return files[0] if files else None
    return None


def _has_magic(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


class GGUFFile:
    """The file's metadata and tensors, checked (module doc)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not _has_magic(self.path):
            raise GGUFError(f"{self.path}: not a GGUF file (no GGUF magic at its start)")
        try:
            from gguf import GGUFReader
        except ImportError as e:
            raise GGUFError(
                f"{self.path}: serving a GGUF file needs the `gguf` package "
                "(pip install 'llmserve[gguf]')"
            ) from e
        try:
            self._reader = GGUFReader(str(self.path), "r")
            tensors = list(self._reader.tensors)
        except Exception as e:  # the package raises ValueError, struct errors, mmap errors
            raise GGUFError(f"{self.path}: corrupt or truncated GGUF file ({e})") from e
        self.architecture = str(self.field("general.architecture", ""))
        if self.architecture not in ARCHITECTURES:
            raise GGUFError(
                f"{self.path}: architecture {self.architecture!r} is not served; "
                f"supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        self.tensors: dict[str, GGUFTensor] = {}
        for t in tensors:
            type_id = int(t.tensor_type)
            if type_id not in quant.TYPES:
                raise GGUFError(
                    f"{self.path}: tensor {t.name} has type {t.tensor_type.name}, which this "
                    f"executor does not run (supported: "
                    f"{', '.join(n for n, _, _ in quant.TYPES.values())})"
                )
            shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists the innermost first
            data = np.asarray(t.data)
            expected = int(np.prod(shape)) // quant.TYPES[type_id][1] * quant.TYPES[type_id][2]
            if data.nbytes != expected:
                raise GGUFError(
                    f"{self.path}: tensor {t.name} holds {data.nbytes} bytes, its shape "
                    f"{list(shape)} of {quant.type_name(type_id)} needs {expected} (truncated?)"
                )
            if type_id not in quant.FLOAT_TYPES or type_id == 30:
                data = data.view(np.uint8).reshape(shape[0] if len(shape) > 1 else 1, -1)
            self.tensors[t.name] = GGUFTensor(t.name, hf_name(t.name), type_id, shape, data)

    def field(self, key: str, default: object = None) -> object:
        """A metadata value (strings decoded, arrays as lists), or ``default``."""
        f = self._reader.fields.get(key)
        if f is None:
            return default
        return f.contents()

    @property
    def hf_architecture(self) -> str:
        return ARCHITECTURES[self.architecture]

    def type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.type_name] = counts.get(t.type_name, 0) + 1
        return counts
