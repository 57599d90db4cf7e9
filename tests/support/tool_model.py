"""A tiny Llama checkpoint that writes known texts: tool calls in the Hermes format, and
reasoning in `<think>` tags, for testing the frontend's tool-call and reasoning paths end to
end with a real model behind it.

Its tokenizer is byte-level with no merges, plus one added token per piece of each script
below. The weights make the model a bigram machine: every layer adds nothing to the residual
stream (zero output projections), so the logits at a position depend on its token alone, and
`lm_head` maps each script piece to the next one (and the last to EOS) with a margin of 100
logits, so sampling at temperature 1 follows the script. After the generation prompt's last
token ("\\n") `single_call`'s first piece leads the other scripts' first pieces by 50 logits;
`SCRIPT_BIAS` on one of those (`logit_bias`) puts it 30 ahead instead, and still 20 behind
the script's next piece wherever else it appears.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from executor_svc.demo.demo_model import COMMON_CONFIG, _write_config, make_weights
from tests.support.stack import Stack, serving_stack

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# The frontend's flags that read this model's calls (the Hermes format its scripts write).
HERMES_FRONTEND_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")

SCRIPTS: dict[str, list[str]] = {
    "single_call": [
        '<tool_call>\n{"name": "get_weather", ',
        '"arguments": {"city": "Par',
        'is", "unit": "cel',
        'sius"}}\n</tool_call>',
    ],
    "text_then_two_calls": [
        "Let me look that up.\n",
        '<tool_call>\n{"name": "get_weather", "arguments": ',
        '{"city": "Tokyo"}}\n</tool_call>\n',
        '<tool_call>\n{"name": "get_time", ',
        '"arguments": {"zone": "Asia/Tokyo"}}',
        "\n</tool_call>",
    ],
    "plain_text": ["The weather", " is nice today."],
    # Reasoning (`<think>` is one token, as in Qwen3's tokenizer): the tags also split across
    # pieces, so a stream splits them.
    "think_then_answer": ["<thi", "nk>\nA greeting", "; say hi.\n</", "think>\n\nHello", " there!"],
    "think_then_json": ["<think>", "Which city? Paris.", "</think>", '\n\n{"city": ', '"Paris"}'],
}
DEFAULT_SCRIPT = "single_call"

# A Qwen2.5-style template with tools (written for these tests after Qwen2.5's, shortened).
TOOL_CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}Be helpful.{%- endif %}
{{- '\\n# Tools\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{{- tool_call.arguments | tojson }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

HIDDEN = 64
_MARGIN = 12.5  # x sqrt(HIDDEN) = 100 logits between a script's next piece and anything else
SCRIPT_BIAS = 80.0


def build_tokenizer() -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False) for t in (IM_START, IM_END)])
    pieces = [p for script in SCRIPTS.values() for p in script]
    assert len(set(pieces)) == len(pieces), "script pieces must be distinct tokens"
    tok.add_tokens([AddedToken(p, normalized=False) for p in pieces])
    return tok


def write_tokenizer(out: Path) -> Tokenizer:
    tok = build_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": IM_END,
        "pad_token": IM_END,
        "chat_template": TOOL_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok


def build_tool_model(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = write_tokenizer(out)
    eos = tok.token_to_id(IM_END)
    config = {
        **COMMON_CONFIG,
        "hidden_size": HIDDEN,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": tok.get_vocab_size(),
        "max_position_embeddings": 4096,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "pad_token_id": eos,
    }
    _write_config(out, config)
    weights = make_weights(config, seed=0)
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name].zero_()
        elif name.endswith("norm.weight"):
            weights[name].fill_(1.0)
    _script_weights(weights, tok, eos)
    save_file(weights, str(out / "model.safetensors"), {"format": "pt"})
    return out


def _script_weights(weights: dict[str, torch.Tensor], tok: Tokenizer, eos: int) -> None:
    """Orthonormal embeddings for "\\n" and every piece (scaled to rms 1, so the final norm
    passes them on as `unit * sqrt(HIDDEN)`), and `lm_head` rows that map each to the next."""
    newline = tok.token_to_id("Ċ")  # the byte-level "\n"
    chains = [[tok.token_to_id(p) for p in script] + [eos] for script in SCRIPTS.values()]
    states = [newline] + [t for chain in chains for t in chain[:-1]]
    gen = torch.Generator().manual_seed(0)
    basis, _ = torch.linalg.qr(torch.randn(HIDDEN, len(states), generator=gen))
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    head.zero_()
    for k, t in enumerate(states):
        embed[t] = basis[:, k] * HIDDEN**0.5
    unit = {t: basis[:, k] for k, t in enumerate(states)}
    for name, chain in zip(SCRIPTS, chains, strict=True):
        head[chain[0]] += (1.0 if name == DEFAULT_SCRIPT else 0.5) * _MARGIN * unit[newline]
        for a, b in zip(chain, chain[1:], strict=False):
            head[b] += _MARGIN * unit[a]


@contextlib.contextmanager
def tool_stack(tmp: Path) -> Iterator[Stack]:
    """Redis, an executor and a scheduler serving the tool model built under `tmp`."""
    executor_args = ["--num-device-blocks", "512", "--swap-space", "0.05"]
    with serving_stack(tmp, build_tool_model(tmp / "model"), executor_args) as stack:
        yield stack


def script_bias(tok: Tokenizer, name: str) -> dict[str, float]:
    """The logit_bias (OpenAI's shape) that makes the model write SCRIPTS[name]."""
    return {str(tok.token_to_id(SCRIPTS[name][0])): SCRIPT_BIAS}
