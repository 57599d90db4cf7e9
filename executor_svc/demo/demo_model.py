"""Offline demo checkpoint: random Llama weights and a byte-level BPE tokenizer trained locally.

``build_demo_model(out_dir)`` writes a Hugging Face checkpoint directory that transformers (and
the executor's loader) can open with no network access:

- ``config.json``: ``LlamaForCausalLM``, fp32;
- ``model.safetensors``: seeded random weights;
- ``generation_config.json``: BOS, EOS (``<|end_of_text|>`` and ``<|eot_id|>``), pad;
- ``tokenizer.json`` + ``tokenizer_config.json``: a byte-level BPE trained here on a generated
  corpus (English-like sentences, numbers, punctuation, accented Latin, CJK and other scripts,
  emoji), with a chat template.

Everything is a pure function of ``(size, seed, overrides)``: the same arguments give
byte-identical ``model.safetensors`` and ``tokenizer.json``. ``config.json`` carries the
transformers version, so only the two big files are promised to be identical across installs.

Vocabulary: for ``vocab_size <= MAX_BPE_VOCAB`` the tokenizer has exactly ``vocab_size`` entries
(BPE merges, topped up with ``<|reserved_special_token_N|>`` should the corpus run out of merges),
so every id the model can emit decodes. Above that (e.g. the SmolLM-135M benchmark shape with
``vocab_size=49152``) the tokenizer stops at ``MAX_BPE_VOCAB`` real tokens and the ids beyond it
exist only as embedding / lm_head rows. That is fine for timing (benchmarks feed token ids),
but such a model can sample ids the tokenizer cannot decode, so do not serve it for text.

CLI: ``python -m executor_svc.demo.demo_model OUT_DIR [--seed N] [--size demo|tiny] [--set K=V ...]``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from executor_svc.config import envs

# Bump when anything below changes what gets written; cached builds with another version are
# rebuilt by ensure_demo_model.
DEMO_FORMAT_VERSION = 1
MARKER_FILE = "llmserve_demo.json"

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
PAD = "<|pad|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
# Order fixes the ids: the trainer puts special tokens first, so BOS=0, EOS=1, ... EOT=5.
SPECIAL_TOKENS = [BOS, EOS, PAD, START_HEADER, END_HEADER, EOT]

# Llama-3-style turns. `trim` keeps stray whitespace in messages from shifting the token layout;
# BOS comes from the template, so apply_chat_template(tokenize=True) must not add another one
# (transformers passes add_special_tokens=False for rendered chats).
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim }}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

# Training more merges than this would need a far larger corpus (and time) for no gain in a demo.
MAX_BPE_VOCAB = 8192

SIZES: dict[str, dict[str, Any]] = {
    # What `make run` serves on a CPU: a few ms per decode step, still a real multi-layer GQA model.
    "demo": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 688,
        "vocab_size": 4096,
        "max_position_embeddings": 2048,
    },
    # For tests: within the CI budget in docs/internals.md (hidden <= 64, <= 2 layers, vocab <= 512).
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 512,
        "max_position_embeddings": 512,
    },
}

COMMON_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    # A std this large (vs. ~1/sqrt(hidden) for a trained model) spreads the logits far apart, so
    # greedy decoding wanders over many tokens instead of locking onto one, and near-ties that
    # would make kernel-vs-reference comparisons flaky are rare.
    "initializer_range": 0.5,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "dtype": "float32",
}

# Corpus sizes (sentences) per BPE target: enough distinct words that the trainer reaches the
# target vocabulary, small enough that training takes about a second.
_SENTENCES_PER_MERGE = 4
_MIN_SENTENCES = 3000


def build_demo_model(
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    size: str = "demo",
    weights: bool = True,
    **overrides: Any,
) -> Path:
    """Write the demo checkpoint of ``size`` ("demo" or "tiny") for ``seed`` into ``out_dir``.

    ``overrides`` replace any config field, e.g. the SmolLM-135M shape:
    ``hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True``. ``weights=False`` writes
    the config and tokenizer alone, for the executor's ``--load-format dummy`` (a model shape too
    large to write out, e.g. Llama-3-8B's for a GPU benchmark). Returns the directory.
    """
    if size not in SIZES:
        raise ValueError(f"unknown demo model size {size!r}; expected one of {sorted(SIZES)}")
    config = {**COMMON_CONFIG, **SIZES[size], **overrides}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer(min(config["vocab_size"], MAX_BPE_VOCAB), seed=seed)
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    config.setdefault("bos_token_id", ids[BOS])
    config.setdefault("eos_token_id", [ids[EOS], ids[EOT]])
    config.setdefault("pad_token_id", ids[PAD])

    _write_config(out, config)
    _write_tokenizer(out, tokenizer, config)
    weights_path = out / "model.safetensors"
    if not weights:
        return out
    save_file(make_weights(config, seed=seed), str(weights_path), {"format": "pt"})
    # safetensors creates the file owner-only; a shared cache (one volume, several users) needs
    # it readable like the other files.
    weights_path.chmod(0o644)
    marker = {"version": DEMO_FORMAT_VERSION, "size": size, "seed": seed, "overrides": overrides}
    (out / MARKER_FILE).write_text(json.dumps(marker, sort_keys=True, default=str) + "\n")
    return out


def ensure_demo_model(
    cache_dir: str | os.PathLike[str] | None = None, size: str = "demo", seed: int = 0
) -> Path:
    """The cached demo checkpoint ``<cache>/demo-<size>-<seed>``, built on first use.

    ``cache`` is ``cache_dir``, else ``$LLMSERVE_CACHE``, else ``~/.cache/llmserve``. Safe for
    concurrent callers (e.g. several executors starting on one volume): each builds into its own
    temporary directory and renames it into place; a rename onto an existing directory fails, so
    exactly one build wins and the others discard theirs. Readers therefore never see a partly
    written checkpoint.
    """
    root = Path(cache_dir) if cache_dir else envs.cache_dir()
    target = root / f"demo-{size}-{seed}"
    if _is_current(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".build-demo-{size}-{seed}-", dir=root))
    try:
        build_demo_model(tmp, seed=seed, size=size)
        tmp.chmod(0o755)  # mkdtemp makes it owner-only
        if target.exists() and not _is_current(target):
            # A build from an older generator: move it aside atomically, then replace it.
            stale = Path(tempfile.mkdtemp(prefix=".stale-", dir=root))
            with contextlib.suppress(OSError):  # another caller moved it first
                os.rename(target, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_current(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_current(model_dir: Path) -> bool:
    try:
        marker = json.loads((model_dir / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("version") == DEMO_FORMAT_VERSION


# --------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(vocab_size: int, *, seed: int = 0) -> Tokenizer:
    """A byte-level BPE of exactly ``vocab_size`` tokens trained on ``generate_corpus(seed)``."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} cannot hold the 256 bytes and special tokens")
    tokenizer = Tokenizer(models.BPE())
    # No normalizer and no prefix space: decode(encode(s)) == s for every string, which the
    # scheduler's incremental detokenizer tests rely on.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        # All 256 bytes up front: text never seen in training (any script, any emoji) still
        # encodes, byte by byte.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    num_sentences = max(_MIN_SENTENCES, vocab_size * _SENTENCES_PER_MERGE)
    tokenizer.train_from_iterator(generate_corpus(seed, num_sentences), trainer=trainer)

    # Should the corpus run out of merges, top up with reserved tokens (as Llama 3 does) so that
    # every id below vocab_size decodes to something.
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing > 0:
        tokenizer.add_special_tokens([f"<|reserved_special_token_{i}|>" for i in range(missing)])
    assert tokenizer.get_vocab_size() == vocab_size, (tokenizer.get_vocab_size(), vocab_size)

    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B:1",
        special_tokens=[(BOS, bos_id)],
    )
    return tokenizer


def _write_tokenizer(out: Path, tokenizer: Tokenizer, config: dict[str, Any]) -> None:
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "chat_template": CHAT_TEMPLATE,
        # The default clean-up rewrites " ." as "." on decode, which breaks round trips.
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "padding_side": "left",
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)


def generate_corpus(seed: int, num_sentences: int) -> Iterator[str]:
    """Seeded English-like text with numbers, punctuation and multi-byte UTF-8, one line each."""
    words = _word_lists()
    rng = random.Random(f"llmserve-demo-corpus-{seed}")
    # Invented names and places widen the set of distinct words, which is what lets BPE find
    # thousands of merges from a small hand-written word list.
    syllables = words["syllables"]
    names = sorted(
        {"".join(rng.choices(syllables, k=rng.randint(2, 3))).capitalize() for _ in range(2500)}
    )
    kinds = [_statement, _past_story, _question, _numbers, _dialogue, _multilingual, _code_line]
    weights = [30, 18, 10, 12, 8, 14, 8]
    for _ in range(num_sentences):
        kind = rng.choices(kinds, weights)[0]
        yield kind(rng, words, names)


def _word_lists() -> dict[str, list[str]]:
    text = resources.files("executor_svc.demo").joinpath("data/demo_words.json").read_text("utf-8")
    return {k: v for k, v in json.loads(text).items() if isinstance(v, list)}


def _noun_phrase(rng: random.Random, w: dict[str, list[str]], names: list[str]) -> str:
    if rng.random() < 0.25:
        return rng.choice(names)
    adjective = f"{rng.choice(w['adjectives'])} " if rng.random() < 0.5 else ""
    return f"{rng.choice(w['determiners'])} {adjective}{rng.choice(w['nouns'])}"


def _statement(rng: random.Random, w: dict[str, list[str]], names: list[str]) -> str:
    text = f"{_noun_phrase(rng, w, names)} {rng.choice(w['verbs'])}"
    if rng.random() < 0.7:
        text += f" {rng.choice(w['prepositions'])} {_noun_phrase(rng, w, names)}"
    if rng.random() < 0.3:
        text += f" {rng.choice(w['adverbs'])}"
    if rng.random() < 0.3:
        text += f", {rng.choice(w['conjunctions'])} {rng.choice(w['pronouns'])}"
        text += f" {rng.choice(w['verbs'])} {_noun_phrase(rng, w, names)}"
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "!", ";", "..."])


def _past_story(rng: random.Random, w: dict[str, list[str]], names: list[str]) -> str:
    who = rng.choice(names)
    other = _noun_phrase(rng, w, names)
    return (
        f"{rng.choice(['Yesterday', 'Long ago', 'Then', 'At dawn', 'Later'])}, {who} "
        f"{rng.choice(w['past_verbs'])} {other} {rng.choice(w['prepositions'])} "
        f"{_noun_phrase(rng, w, names)}, {rng.choice(w['conjunctions'])} "
        f"{rng.choice(w['pronouns'])} {rng.choice(w['past_verbs'])} {rng.choice(w['adverbs'])}."
    )


def _question(rng: random.Random, w: dict[str, list[str]], names: list[str]) -> str:
    verb = rng.choice(w["verbs"]).removesuffix("es").removesuffix("s")
    subject = _noun_phrase(rng, w, names)
    return f"{rng.choice(w['questions']).capitalize()} does {subject} {verb}?"


def _numbers(rng: random.Random, w: dict[str, list[str]], names: list[str]) -> str:
    pick = rng.randrange(5)
    if pick == 0:
        return f"{rng.choice(names)} counted {rng.randint(0, 99999):,} {rng.choice(w['nouns'])}s."
    if pick == 1:
        return (
            f"On {rng.randint(1900, 2099)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} "
            f"at {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}, it was "
            f"{rng.uniform(-30, 45):.1f}°C."
        )
    if pick == 2:
        return f"The price rose {rng.randint(1, 99)}% to ${rng.uniform(1, 5000):.2f} (or €{rng.randint(1, 999)})."
    if pick == 3:
        return ", ".join(str(rng.randint(0, 10 ** rng.randint(1, 6))) for _ in range(6)) + "."
    return f"{rng.randint(2, 99)} × {rng.randint(2, 99)} ≈ {rng.uniform(0, 1e4):.3e}, ±{rng.random():.2f}"


def _dialogue(rng: random.Random, w: dict[str, list[str]], names: list[str]) -> str:
    quote = _statement(rng, w, names)
    left, right = rng.choice([('"', '"'), ("“", "”"), ("«", "»"), ("'", "'")])
    said = rng.choice(["said", "asked", "whispered", "replied"])
    return f"{left}{quote}{right} {said} {rng.choice(names)} — {rng.choice(w['adverbs'])}."


def _multilingual(rng: random.Random, w: dict[str, list[str]], names: list[str]) -> str:
    parts = [_noun_phrase(rng, w, names)]
    for _ in range(rng.randint(2, 5)):
        pool = rng.choice(["accented", "accented", "scripts", "scripts", "emoji", "symbols"])
        parts.append(rng.choice(w[pool]))
    rng.shuffle(parts)
    sep = rng.choice([" ", " ", ", ", "\n"])
    return sep.join(parts) + rng.choice([".", "!", "", " 🙂"])


def _code_line(rng: random.Random, w: dict[str, list[str]], names: list[str]) -> str:
    name = rng.choice(w["nouns"])
    pick = rng.randrange(4)
    if pick == 0:
        return f"{name}_count = {rng.randint(0, 512)} * ({name}[{rng.randint(0, 9)}] + {rng.randint(1, 64)});"
    if pick == 1:
        return f"def {rng.choice(w['verbs'])}_{name}(x, y={rng.randint(0, 9)}):\n    return x + y"
    if pick == 2:
        return f'{{"{name}": {rng.randint(0, 99)}, "ok": true, "tags": ["{rng.choice(names)}"]}}'
    return (
        f"\t- [{rng.choice(['x', ' '])}] {rng.choice(w['verbs'])} the {name} <{name}@example.org>"
    )


# --------------------------------------------------------------------------------------------
# Config and weights


def make_weights(config: dict[str, Any], *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded fp32 weights named and shaped as transformers' LlamaForCausalLM expects."""
    from transformers import LlamaConfig, LlamaForCausalLM

    # Names and shapes come from transformers itself on the meta device (no memory, no init
    # work), so every override (head_dim, biases, a tied lm_head) lays out exactly as HF does.
    hf_config = LlamaConfig(**_config_kwargs(config))
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in LlamaForCausalLM(hf_config).state_dict().items()}
    if config["tie_word_embeddings"]:
        shapes.pop("lm_head.weight", None)

    std = float(config["initializer_range"])
    weights: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        # One generator per tensor, seeded by (seed, name): a tensor's values do not depend on
        # which other tensors exist, so e.g. adding layers leaves the first ones unchanged.
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        shape = shapes[name]
        if name.endswith("norm.weight"):
            # Not all ones: a loader that forgot to load a norm would still pass with ones.
            weights[name] = 1.0 + 0.2 * (torch.rand(shape, generator=gen) - 0.5)
        elif name.endswith(".bias"):
            weights[name] = 0.1 * std * torch.randn(shape, generator=gen)
        else:
            weights[name] = std * torch.randn(shape, generator=gen)
    return weights


def _config_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in ("architectures", "model_type")}


def _write_config(out: Path, config: dict[str, Any]) -> None:
    from transformers import GenerationConfig, LlamaConfig

    hf_config = LlamaConfig(**_config_kwargs(config))
    hf_config.architectures = list(config["architectures"])
    hf_config.save_pretrained(out)
    GenerationConfig(
        bos_token_id=config["bos_token_id"],
        eos_token_id=config["eos_token_id"],
        pad_token_id=config["pad_token_id"],
    ).save_pretrained(out)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _parse_override(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {item!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw  # bare strings such as hidden_act=gelu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m executor_svc.demo.demo_model",
        description="Write the offline demo Llama checkpoint (random weights, local BPE).",
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", choices=sorted(SIZES), default="demo")
    parser.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        type=_parse_override,
        action="append",
        default=[],
        help="override a config field (JSON value), e.g. --set hidden_size=576",
    )
    parser.add_argument(
        "--no-weights",
        action="store_true",
        help="config and tokenizer only (serve with the executor's --load-format dummy)",
    )
    args = parser.parse_args(argv)
    out = build_demo_model(
        args.out_dir,
        seed=args.seed,
        size=args.size,
        weights=not args.no_weights,
        **dict(args.overrides),
    )
    print(out)


if __name__ == "__main__":
    main()
