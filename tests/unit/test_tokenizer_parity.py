"""The scheduler tokenizes as `AutoTokenizer.from_pretrained(model_dir)` does.

Several tokenizer classes rebuild the backend pipeline in their own `__init__` rather than use
the one in `tokenizer.json`: Qwen2's adds NFC and its own split regex, Llama's a Metaspace
pre-tokenizer in place of Llama 2's normalizers. Which class `AutoTokenizer` picks depends on
`tokenizer_config.json` and on `config.json` (a Mistral model that declares `LlamaTokenizerFast`
gets the generic backend). Every directory here is built offline with tiny vocabularies; each is
loaded once by `AutoTokenizer` and once by `load_tokenizer` from exactly the files the
executor's GetTokenizer sends, and the two must agree on ids, special tokens and chat text.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import (
    AutoTokenizer,
    GPT2Tokenizer,
    LlamaTokenizer,
    PreTrainedTokenizerFast,
    Qwen2Tokenizer,
)

from executor_svc.api.service import TOKENIZER_FILE_NAMES
from executor_svc.demo.demo_model import ensure_demo_model
from executor_svc.runner.loader import tokenizer_class_name
from scheduler_svc.output.tokenizer import (
    encode_chat,
    encode_prompt,
    eos_token_ids,
    load_tokenizer,
    render_chat,
    special_token_ids,
)

ROOT = Path(__file__).resolve().parents[2]

WORDS = [
    "the", "cat", "sat", "on", "a", "mat", "hello", "world", "don't", "it's", "we'll",
    "12", "345", "2024", "café", "naïve", "日本語", "東京", "😀", "👍🏽",
]  # fmt: skip
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA2_CHAT = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}"
    " [/INST]{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
GPT2_CHAT = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
# Spaces at either end, runs of digits, combining accents (NFC matters), CJK and emoji (bytes
# split over tokens), newlines and tabs, contractions, and the empty string.
TEXTS = [
    "",
    " ",
    " leading space",
    "   three leading, two trailing  ",
    "hello world",
    "12345 + 678 = 9999",
    "café naïve",
    "cafe\u0301 nai\u0308ve",
    "日本語 😀 👍🏽 東京",
    "line one\nline two\n\n\tindented\r\n",
    "don't SHOUT, we'll see",
]
MESSAGES = [
    {"role": "system", "content": "Be brief. 12345"},
    {"role": "user", "content": " café 日本語\n😀 "},
    {"role": "assistant", "content": "ok"},
    {"role": "user", "content": "and  then?"},
]


def corpus(num_lines: int = 300) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choices(WORDS, k=rng.randint(3, 12))) for _ in range(num_lines)]


def byte_level_bpe(special_tokens: list[str], vocab_size: int = 400) -> Tokenizer:
    """A GPT-2-style byte-level BPE: the pipeline a generic `tokenizer.json` carries."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    return tok


def llama2_bpe() -> Tokenizer:
    """Llama 2's `tokenizer.json` layout: byte-fallback BPE, spaces handled by normalizers."""
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens], show_progress=False
    )
    tok.train_from_iterator(corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return tok


def vocab_and_merges(tok: Tokenizer) -> tuple[dict[str, int], list[tuple[str, str]]]:
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], merges


def edit_json(path: Path, **fields: object) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}, indent=2))


def write_config(out: Path, model_type: str) -> None:
    (out / "config.json").write_text(json.dumps({"model_type": model_type}))


# --- Checkpoint directories ------------------------------------------------------------------


def qwen2_saved_by_its_class(out: Path) -> Path:
    """What Qwen2Tokenizer.save_pretrained writes: tokenizer.json matches the class."""
    vocab, merges = vocab_and_merges(
        byte_level_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    )
    tok = Qwen2Tokenizer(
        vocab=vocab, merges=merges, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tok.add_tokens([AddedToken("<|im_start|>", special=True)])
    tok.chat_template = CHATML  # saved as chat_template.jinja
    tok.save_pretrained(out)
    write_config(out, "qwen2")
    return out


def qwen2_class_over_generic_json(out: Path) -> Path:
    """tokenizer.json from a generic byte-level BPE, tokenizer_class Qwen2Tokenizer: the class
    brings NFC and a split regex (one digit per piece) that the file does not have."""
    tok = byte_level_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=["<|im_start|>"],
    ).save_pretrained(out)
    edit_json(out / "tokenizer_config.json", tokenizer_class="Qwen2Tokenizer", chat_template=CHATML)
    write_config(out, "qwen2")
    return out


def llama2_legacy(out: Path, *, model_type: str = "llama") -> Path:
    """A Llama 2 checkpoint: the class swaps the file's Prepend/Replace normalizers for its own
    Metaspace pre-tokenizer, which treats leading spaces differently."""
    PreTrainedTokenizerFast(
        tokenizer_object=llama2_bpe(), bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(out)
    edit_json(
        out / "tokenizer_config.json",
        tokenizer_class="LlamaTokenizerFast",
        legacy=True,
        add_bos_token=True,
        add_eos_token=False,
        chat_template=LLAMA2_CHAT,
    )
    write_config(out, model_type)
    return out


def mistral_declaring_llama(out: Path) -> Path:
    """Same files as llama2_legacy, but config.json says mistral: AutoTokenizer then keeps the
    file's pipeline, so the tokenizer class alone does not decide."""
    return llama2_legacy(out, model_type="mistral")


def llama_saved_by_its_class(out: Path) -> Path:
    vocab, merges = vocab_and_merges(llama2_bpe())
    tok = LlamaTokenizer(vocab=vocab, merges=merges, legacy=False, add_bos_token=True)
    tok.chat_template = LLAMA2_CHAT
    tok.save_pretrained(out)
    write_config(out, "llama")
    return out


def gpt2_saved_by_its_class(out: Path) -> Path:
    vocab, merges = vocab_and_merges(byte_level_bpe(["<|endoftext|>"]))
    tok = GPT2Tokenizer(vocab=vocab, merges=merges, add_bos_token=True)
    tok.chat_template = GPT2_CHAT
    tok.save_pretrained(out)
    write_config(out, "gpt2")
    return out


def demo_model(out: Path) -> Path:
    """The project's own checkpoint (tokenizer_class PreTrainedTokenizerFast, model_type llama)."""
    return ensure_demo_model(out, size="tiny", seed=0)


BUILDERS: dict[str, Callable[[Path], Path]] = {
    "qwen2": qwen2_saved_by_its_class,
    "qwen2-over-generic-json": qwen2_class_over_generic_json,
    "llama2-legacy": llama2_legacy,
    "mistral-declaring-llama": mistral_declaring_llama,
    "llama": llama_saved_by_its_class,
    "gpt2": gpt2_saved_by_its_class,
    "demo": demo_model,
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: build(tmp_path_factory.mktemp(name)) for name, build in BUILDERS.items()}


def executor_files(model_dir: Path) -> dict[str, bytes]:
    """What the executor's GetTokenizer sends for this directory."""
    return {
        name: (model_dir / name).read_bytes()
        for name in TOKENIZER_FILE_NAMES
        if (model_dir / name).is_file()
    }


def texts_for(tok: PreTrainedTokenizerFast) -> list[str]:
    specials = [t for t in tok.all_special_tokens if t]
    assert specials, "every fixture has special tokens to embed"
    return TEXTS + [f"before{t}after" for t in specials] + [f" {t} x {t}" for t in specials]


# --- Tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BUILDERS)
def test_ids_match_auto_tokenizer(model_dirs: dict[str, Path], name: str):
    model_dir = model_dirs[name]
    auto = AutoTokenizer.from_pretrained(model_dir)
    ours = load_tokenizer(executor_files(model_dir), tokenizer_class_name(model_dir))
    for text in texts_for(auto):
        for add_special_tokens in (True, False):
            assert ours.encode(text, add_special_tokens=add_special_tokens) == auto.encode(
                text, add_special_tokens=add_special_tokens
            ), (text, add_special_tokens)
        assert encode_prompt(ours, text) == auto(text)["input_ids"], text
        ids = auto.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(
                ids, skip_special_tokens=skip
            ), (text, skip)
    assert special_token_ids(ours) == frozenset(auto.all_special_ids)
    assert eos_token_ids(ours) == [auto.eos_token_id]
    assert ours.bos_token_id == auto.bos_token_id


@pytest.mark.parametrize("name", BUILDERS)
def test_chat_matches_auto_tokenizer(model_dirs: dict[str, Path], name: str):
    model_dir = model_dirs[name]
    auto = AutoTokenizer.from_pretrained(model_dir)
    ours = load_tokenizer(executor_files(model_dir), tokenizer_class_name(model_dir))
    assert ours.chat_template == auto.chat_template
    for add_generation_prompt in (True, False):
        expected_text = auto.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        expected_ids = auto.apply_chat_template(
            MESSAGES, tokenize=True, return_dict=False, add_generation_prompt=add_generation_prompt
        )
        assert render_chat(ours, MESSAGES, add_generation_prompt=add_generation_prompt) == (
            expected_text
        )
        assert encode_chat(ours, MESSAGES, add_generation_prompt=add_generation_prompt) == list(
            expected_ids
        )


def test_the_fixtures_differ_from_a_bare_tokenizer_json(model_dirs: dict[str, Path]):
    """Without these differences the parity tests above would prove nothing."""

    def bare(name: str) -> PreTrainedTokenizerFast:
        return PreTrainedTokenizerFast.from_pretrained(model_dirs[name])

    def auto(name: str) -> PreTrainedTokenizerFast:
        return AutoTokenizer.from_pretrained(model_dirs[name])

    # Qwen2's regex splits digits one by one; its NFC composes "e" + U+0301 into "é".
    for text in ("12345", "cafe\u0301"):
        assert auto("qwen2-over-generic-json").encode(text) != bare(
            "qwen2-over-generic-json"
        ).encode(text)
    # Llama's Metaspace does not prepend "▁" to text that starts with a space; Llama 2's
    # normalizer does.
    assert auto("llama2-legacy").encode(" leading") != bare("llama2-legacy").encode(" leading")
    # The tokenizer class alone would pick LlamaTokenizer; config.json's model_type says otherwise.
    mistral = model_dirs["mistral-declaring-llama"]
    assert LlamaTokenizer.from_pretrained(mistral).encode(" leading") != (
        auto("mistral-declaring-llama").encode(" leading")
    )


def test_loading_keeps_the_process_torch_free(model_dirs: dict[str, Path], tmp_path: Path):
    """AutoTokenizer's import chain pulls in torch (the executor runs it); the class it names
    loads in the scheduler without torch."""
    model_dir = model_dirs["qwen2-over-generic-json"]
    files = executor_files(model_dir)
    class_name = tokenizer_class_name(model_dir)
    assert class_name.endswith(":Qwen2Tokenizer"), class_name
    (tmp_path / "files.json").write_text(json.dumps({k: v.decode() for k, v in files.items()}))
    code = (
        "import json, sys\n"
        "from scheduler_svc.output.tokenizer import load_tokenizer\n"
        f"files = json.load(open({str(tmp_path / 'files.json')!r}))\n"
        f"tok = load_tokenizer({{k: v.encode() for k, v in files.items()}}, {class_name!r})\n"
        "assert type(tok).__name__ == 'Qwen2Tokenizer', type(tok)\n"
        "assert tok.encode('12') == [tok.convert_tokens_to_ids(c) for c in '12']\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize(
    "class_name",
    ["os:system", "transformers:AutoTokenizer", "transformers:NoSuchTokenizer", "nocolon"],
)
def test_only_transformers_fast_tokenizer_classes_are_loaded(
    model_dirs: dict[str, Path], class_name: str
):
    files = executor_files(model_dirs["demo"])
    with pytest.raises(ValueError, match="tokenizer class|fast"):
        load_tokenizer(files, class_name)
