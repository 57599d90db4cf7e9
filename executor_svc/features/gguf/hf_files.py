"""The Hugging Face side of a GGUF model: config.json, generation_config.json and the tokenizer
files, built from the GGUF metadata by transformers' own GGUF loader and cached beside nothing
the user owns (``$LLMSERVE_CACHE/gguf/<stem>-<key>/``, the key a hash of the file's path, size
and modification time).

Why transformers builds them: the issue's reference is transformers' GGUF loader, so the config
and the tokenizer (its pre-tokenizer, special tokens and chat template) are exactly what it makes
of the file, and the scheduler, which never reads a GGUF, gets ordinary tokenizer files through
``GetTokenizer`` as it does for a checkpoint directory. The directory also names its GGUF file
(``GGUF_LINK``), which is how ``runner.loader`` knows to take the weights from it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import structlog

from executor_svc.config import envs
from executor_svc.features.gguf.reader import ARCHITECTURES, GGUFError, GGUFFile

log = structlog.get_logger(__name__)

GGUF_LINK = "llmserve_gguf.json"  # {"gguf": "/abs/path/file.gguf"} inside the side directory
_DONE = ".complete"


def gguf_source(model_dir: str | Path) -> Path | None:
    """The GGUF file a side directory stands for; None for an ordinary checkpoint directory."""
    link = Path(model_dir) / GGUF_LINK
    if not link.is_file():
        return None
    return Path(json.loads(link.read_text())["gguf"])


def _key(path: Path) -> str:
    st = path.stat()
    text = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v2"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def prepare(gguf_path: str | Path, cache: Path | None = None) -> Path:
    """The side directory of ``gguf_path`` (checked first: a corrupt file or an unsupported
    tensor type fails here, at start-up), built on first use."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    file = GGUFFile(gguf_path)  # raises GGUFError
    root = (cache or envs.cache_dir()) / "gguf"
    final = root / f"{gguf_path.stem}-{_key(gguf_path)}"
    if (final / _DONE).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        _write(file, tmp)
        (tmp / _DONE).write_text("")
        if not (final / _DONE).is_file():
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)  # atomic: a second executor keeps the first one's result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("gguf.prepared", gguf=str(gguf_path), side_dir=str(final), types=file.type_counts())
    return final


def _write(file: GGUFFile, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    src, name = str(file.path.parent), file.path.name
    try:
        config = AutoConfig.from_pretrained(src, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    except Exception as e:
        raise GGUFError(f"{file.path}: transformers cannot read its metadata ({e})") from e
    _check_head_dim(file, config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the side directory holds no weights to de-quantize
    # A llama-architecture file transformers reads as Mistral (general.name "mistral") is named
    # as its model type says, as a Mistral checkpoint is (v2 of the cache key: this changed).
    config.architectures = [ARCHITECTURES.get(config.model_type, file.hf_architecture)]
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / GGUF_LINK).write_text(json.dumps({"gguf": str(file.path)}) + "\n")


def _check_head_dim(file: GGUFFile, config: object) -> None:
    """transformers' GGUF loader does not read ``attention.key_length`` for every architecture
    (qwen3 keeps Qwen3Config's default head_dim, 128); a file whose heads differ would only
    fail later on a tensor shape, so say why here."""
    key_length = file.field(f"{file.architecture}.attention.key_length")
    heads = getattr(config, "num_attention_heads", 0) or 1
    head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // heads
    if key_length is not None and int(key_length) != head_dim:
        raise GGUFError(
            f"{file.path}: its heads are {key_length} wide (attention.key_length) but "
            f"transformers' GGUF loader, whose config this executor serves, reads head_dim "
            f"{head_dim} for {file.architecture}; not served"
        )
