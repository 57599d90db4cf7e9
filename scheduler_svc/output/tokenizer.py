"""The scheduler's tokenizer: built from files the executor serves, plus prompt helpers.

Prompts must tokenize exactly as `AutoTokenizer.from_pretrained(model_dir)` tokenizes them, and
that is not the same as loading `tokenizer.json` alone: classes such as `Qwen2Tokenizer` and
`LlamaTokenizer` rebuild the normalizer and pre-tokenizer in their own `__init__` (Qwen2 adds NFC
and splits digits one by one; Llama swaps Llama 2's Prepend/Replace normalizers for Metaspace),
and which class `AutoTokenizer` picks depends on `tokenizer_config.json` *and* `config.json` (a
Mistral model that declares `LlamaTokenizerFast` keeps the file's pipeline).

`AutoTokenizer` itself cannot run here: its import chain (`configuration_utils` ->
`modeling_rope_utils`) imports torch, and the scheduler must stay torch-free. The executor,
which has torch and the model directory, runs it and names the class it picked in its
GetTokenizer reply; the class itself (a `transformers.models.*.tokenization_*` module) imports
no torch, and is built here from the files alone.
"""

from __future__ import annotations

import importlib
import json
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerFast

__all__ = [
    "ChatMessage",
    "Conversation",
    "encode_chat",
    "encode_infill",
    "fim_token_ids",
    "encode_prompt",
    "eos_token_ids",
    "load_tokenizer",
    "render_chat",
    "special_token_ids",
    "tokenizer_class",
]

# A chat turn as the template sees it: {"role": ..., "content": ...}, and where the turn has
# them "tool_calls" (OpenAI tool-call objects), "tool_call_id" and "name".
ChatMessage = Mapping[str, Any]


class Conversation(list):
    """Chat messages and the tools the template is handed (`tools=`, OpenAI tool objects).

    A list, so that everything that carries a conversation from the API to `encode_chat`
    (`GenerateInput.chat`) carries its tools along without knowing about them.
    """

    def __init__(
        self, messages: Iterable[ChatMessage] = (), tools: list[dict[str, Any]] | None = None
    ) -> None:
        super().__init__(messages)
        self.tools = tools


def load_tokenizer(files: Mapping[str, bytes], class_name: str = "") -> PreTrainedTokenizerFast:
    """Build a tokenizer from `{file name: contents}` and the class the executor names
    ("module:QualName"; empty = a plain fast tokenizer over tokenizer.json).

    The files are written to a temporary directory that is removed again: once loaded, the fast
    tokenizer holds everything in memory.
    """
    if "tokenizer.json" not in files:
        raise ValueError(
            f"tokenizer files must include tokenizer.json, got {sorted(files) or 'none'}"
        )
    cls = tokenizer_class(class_name) if class_name else PreTrainedTokenizerFast
    with tempfile.TemporaryDirectory(prefix="llmserve-tokenizer-") as tmp:
        root = Path(tmp)
        for name, data in files.items():
            # Names come from another process: refuse anything that could escape the directory.
            if not name or "/" in name or "\\" in name or name in (".", ".."):
                raise ValueError(f"invalid tokenizer file name {name!r}")
            (root / name).write_bytes(data)
        return cls.from_pretrained(tmp, local_files_only=True)


def tokenizer_class(class_name: str) -> type[PreTrainedTokenizerFast]:
    """The class named "module:QualName", if it is one of transformers' fast tokenizers (the
    name comes from another process: nothing outside transformers is imported)."""
    module_name, _, qualname = class_name.partition(":")
    if not (module_name == "transformers" or module_name.startswith("transformers.")):
        raise ValueError(f"unsupported tokenizer class {class_name!r}")
    try:
        cls = getattr(importlib.import_module(module_name), qualname)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"unknown tokenizer class {class_name!r}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerFast)):
        raise ValueError(f"{class_name!r} is not a fast (tokenizers) tokenizer")
    return cls


def encode_prompt(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """Token ids of a plain-text prompt, with the tokenizer's own special tokens (e.g. BOS)."""
    return list(tokenizer.encode(text, add_special_tokens=True))


# Fill-in-the-middle token names, as code models' tokenizers spell them (prefix, suffix, middle):
# StarCoder and SmolLM; Qwen2.5-Coder.
FIM_TOKENS = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
)


def fim_token_ids(tokenizer: PreTrainedTokenizerFast) -> tuple[int, int, int] | None:
    """The tokenizer's (prefix, suffix, middle) FIM token ids, or None if it has none."""
    vocab = tokenizer.get_vocab()
    for names in FIM_TOKENS:
        if all(n in vocab for n in names):
            pre, suf, mid = (vocab[n] for n in names)
            return pre, suf, mid
    return None


def encode_infill(tokenizer: PreTrainedTokenizerFast, prefix: str, suffix: str) -> list[int]:
    """Token ids of a fill-in-the-middle prompt in prefix-suffix-middle order: the tokenizer's
    own leading special tokens (e.g. BOS), `<fim_prefix>`, the prefix, `<fim_suffix>`, the
    suffix, `<fim_middle>`; the model generates the middle. The texts are tokenized apart, so
    FIM token names inside them stay text. ValueError if the model has no FIM tokens."""
    fim = fim_token_ids(tokenizer)
    if fim is None:
        raise ValueError(
            "this model's tokenizer has no fill-in-the-middle tokens "
            "(<fim_prefix>/<fim_suffix>/<fim_middle>); suffix is not supported"
        )
    pre, suf, mid = fim
    head = list(tokenizer.encode("", add_special_tokens=True))  # e.g. [BOS]; [] for most BPEs

    def text(t: str) -> list[int]:
        return list(tokenizer.encode(t, add_special_tokens=False, split_special_tokens=True))

    return [*head, pre, *text(prefix), suf, *text(suffix), mid]


def render_chat(
    tokenizer: PreTrainedTokenizerFast,
    messages: Iterable[ChatMessage],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Render chat messages to prompt text with the tokenizer's chat template; `tools` (or, if
    None, those of a `Conversation`) are handed to the template as `tools`."""
    if not tokenizer.chat_template:
        raise ValueError(
            "this model's tokenizer has no chat template; send the prompt as text or token ids"
        )
    if tools is None:
        tools = getattr(messages, "tools", None)
    conversation = [_template_message(m) for m in messages]
    if not conversation:
        raise ValueError("chat prompt must contain at least one message")
    try:
        rendered = tokenizer.apply_chat_template(
            conversation,
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
    except TemplateError as e:
        # Templates raise on what they do not support (a role, tools): the client's to fix.
        raise ValueError(f"the model's chat template refused the messages: {e}") from None
    assert isinstance(rendered, str)
    return rendered


def _template_message(m: ChatMessage) -> dict[str, Any]:
    """A message as chat templates expect it: only the keys it has (templates test `message.
    tool_calls is defined`), and tool-call arguments as objects, not OpenAI's JSON text
    (transformers' convention: templates write them with `tojson`)."""
    out: dict[str, Any] = {"role": m["role"], "content": m["content"]}
    for key in ("tool_call_id", "name"):
        if m.get(key):
            out[key] = m[key]
    if m.get("tool_calls"):
        out["tool_calls"] = [_template_call(c) for c in m["tool_calls"]]
    return out


def _template_call(call: Mapping[str, Any]) -> dict[str, Any]:
    call = dict(call)
    function = dict(call.get("function") or {})
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            function["arguments"] = json.loads(args) if args.strip() else {}
        except ValueError:
            raise ValueError(f"tool call arguments must be JSON text, got {args[:64]!r}") from None
    elif args is None:
        function["arguments"] = {}
    call["function"] = function
    return call


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
