"""The scheduler's tokenizer: built from files the executor serves, plus prompt helpers.

Prompts must tokenize exactly as `AutoTokenizer.from_pretrained(model_dir)` tokenizes them, and
that is not the same as loading `tokenizer.json` alone: classes such as `Qwen2Tokenizer` and
`LlamaTokenizer` rebuild the normalizer and pre-tokenizer in their own `__init__` (Qwen2 adds NFC
and splits digits one by one; Llama swaps Llama 2's Prepend/Replace normalizers for Metaspace),
and which class `AutoTokenizer` picks depends on `tokenizer_config.json` *and* `config.json` (a
Mistral model that declares `LlamaTokenizerFast` keeps the file's pipeline). So the class is
chosen by `AutoTokenizer` itself and the tokenizer is then built from that class.

`AutoTokenizer` cannot run here: its import chain (`configuration_utils` ->
`modeling_rope_utils`) imports torch whenever torch is installed, and the scheduler must stay
torch-free. It therefore runs once, in a child interpreter, and only reports the class it
chose; the class itself (a `transformers.models.*.tokenization_*` module) imports no torch. The
child costs about a second at scheduler start; its answer is kept per set of files.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from transformers import PreTrainedTokenizerFast

__all__ = [
    "ChatMessage",
    "encode_chat",
    "encode_prompt",
    "eos_token_ids",
    "load_tokenizer",
    "render_chat",
    "special_token_ids",
]

# A chat turn as the template sees it: {"role": ..., "content": ...}.
ChatMessage = Mapping[str, str]


# `AutoTokenizer.from_pretrained(argv[1])`'s class, printed as the last line of stdout. torch is
# hidden (as in a tokenizers-only install of transformers): the choice of class does not depend
# on it, and not importing it makes the child start in about half the time.
_RESOLVE_CLASS = """
import sys
sys.modules["torch"] = None
from transformers import AutoTokenizer
cls = type(AutoTokenizer.from_pretrained(sys.argv[1], local_files_only=True))
print(f"{cls.__module__}:{cls.__qualname__}")
"""
_RESOLVE_TIMEOUT_S = 300

# Tokenizer class by digest of the files it was resolved from.
_class_by_digest: dict[str, type[PreTrainedTokenizerFast]] = {}


def load_tokenizer(files: Mapping[str, bytes]) -> PreTrainedTokenizerFast:
    """Build a tokenizer from `{file name: contents}` (the executor's GetTokenizer reply).

    The files are written to a temporary directory that is removed again: once loaded, the fast
    tokenizer holds everything in memory. `config.json` should be among them, as `AutoTokenizer`
    reads the model type from it.
    """
    if "tokenizer.json" not in files:
        raise ValueError(
            f"tokenizer files must include tokenizer.json, got {sorted(files) or 'none'}"
        )
    with tempfile.TemporaryDirectory(prefix="llmserve-tokenizer-") as tmp:
        root = Path(tmp)
        for name, data in files.items():
            # Names come from another process: refuse anything that could escape the directory.
            if not name or "/" in name or "\\" in name or name in (".", ".."):
                raise ValueError(f"invalid tokenizer file name {name!r}")
            (root / name).write_bytes(data)
        return _tokenizer_class(files, tmp).from_pretrained(tmp, local_files_only=True)


def _tokenizer_class(files: Mapping[str, bytes], model_dir: str) -> type[PreTrainedTokenizerFast]:
    """The class `AutoTokenizer` picks for `model_dir` (which holds exactly `files`)."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(hashlib.sha256(name.encode()).digest())
        digest.update(hashlib.sha256(files[name]).digest())
    key = digest.hexdigest()
    cls = _class_by_digest.get(key)
    if cls is None:
        cls = _resolve_class(model_dir)
        _class_by_digest[key] = cls
    return cls


def _resolve_class(model_dir: str) -> type[PreTrainedTokenizerFast]:
    # -P: nothing in the working directory may shadow transformers; offline: the directory is
    # all there is, never the Hub.
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-P", "-c", _RESOLVE_CLASS, model_dir],
        capture_output=True,
        text=True,
        env=env,
        timeout=_RESOLVE_TIMEOUT_S,
        check=False,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise ValueError(f"AutoTokenizer cannot load these tokenizer files: {proc.stderr[-2000:]}")
    module_name, _, qualname = lines[-1].partition(":")
    # Only transformers' own classes: a class from a checkpoint's remote code is not run here.
    if module_name != "transformers" and not module_name.startswith("transformers."):
        raise ValueError(f"unsupported tokenizer class {module_name}.{qualname}")
    cls = getattr(importlib.import_module(module_name), qualname)
    if not (isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerFast)):
        raise ValueError(f"{module_name}.{qualname} is not a fast (tokenizers) tokenizer")
    return cls


def encode_prompt(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """Token ids of a plain-text prompt, with the tokenizer's own special tokens (e.g. BOS)."""
    return list(tokenizer.encode(text, add_special_tokens=True))


def render_chat(
    tokenizer: PreTrainedTokenizerFast,
    messages: Iterable[ChatMessage],
    *,
    add_generation_prompt: bool = True,
) -> str:
    """Render chat messages to prompt text with the tokenizer's chat template."""
    if not tokenizer.chat_template:
        raise ValueError(
            "this model's tokenizer has no chat template; send the prompt as text or token ids"
        )
    conversation = [{"role": m["role"], "content": m["content"]} for m in messages]
    if not conversation:
        raise ValueError("chat prompt must contain at least one message")
    rendered = tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert isinstance(rendered, str)
    return rendered


def encode_chat(
    tokenizer: PreTrainedTokenizerFast,
    messages: Iterable[ChatMessage],
    *,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of rendered chat messages.

    Templates write their own BOS and role markers, so no special tokens are added on top (that
    would double the BOS).
    """
    text = render_chat(tokenizer, messages, add_generation_prompt=add_generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=False))


def special_token_ids(tokenizer: PreTrainedTokenizerFast) -> frozenset[int]:
    """Ids of every special token (those skip_special_tokens leaves out of the text)."""
    return frozenset(tokenizer.all_special_ids)


def eos_token_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """The tokenizer's EOS id as a list (empty if it has none).

    The executor's `Describe` reply (from generation_config.json) is the authoritative source and
    may list several; this is the fallback when it lists none.
    """
    eos = tokenizer.eos_token_id
    return [] if eos is None else [int(eos)]
