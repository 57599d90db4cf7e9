"""Incremental detokenizer and tokenizer helpers, on tokenizers trained here (offline, < 1 s)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from scheduler_svc.output.detokenizer import IncrementalDetokenizer, token_byte_table
from scheduler_svc.output.tokenizer import (
    encode_chat,
    encode_prompt,
    eos_token_ids,
    load_tokenizer,
    render_chat,
    special_token_ids,
)

SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>"]
WORDS = [
    "the", "cat", "sat", "on", "a", "mat", "and", "said", "hello", "world", "to", "every",
    "café", "naïve", "résumé", "über", "straße", "façade", "déjà", "vu",
    "日本語", "東京", "中文", "한국어", "😀", "🚀", "👍🏽", "🎉",
]  # fmt: skip
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Mixed multi-byte text; every tokenizer here splits some of these characters over tokens.
TEXTS = [
    "café naïve 日本語 😀",
    "Hello world, 東京 🚀🚀 straße!",
    "👍🏽 déjà vu — 한국어 中文",
    "plain ascii text with spaces  and  double spaces",
]


def corpus(num_lines: int = 300) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choices(WORDS, k=rng.randint(3, 12))) for _ in range(num_lines)]


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


@cache
def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2/Llama-3 style: byte-level BPE, few merges so multi-byte characters stay split."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=340,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    return _wrap(tok)


@cache
def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-2/SentencePiece style: "▁" for spaces, byte fallback, decoder strips one leading
    space (the case where decoding a token without context loses its space)."""
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIALS, show_progress=False)
    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    # Trained without CJK and emoji, so those reach the model only as byte-fallback tokens.
    base.train_from_iterator(
        [line.encode("latin-1", "ignore").decode("latin-1") for line in corpus()], trainer
    )
    trained = json.loads(base.to_str())["model"]
    vocab = dict(trained["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    tok.add_special_tokens(SPECIALS)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return _wrap(tok)


TOKENIZERS = {"byte_level": byte_level_tokenizer, "metaspace": metaspace_tokenizer}


def stream(detok: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    deltas = [detok.add([t]) for t in token_ids]
    deltas.append(detok.flush())
    return deltas


def expected_output_text(tok: PreTrainedTokenizerFast, prompt: list[int], output: list[int]) -> str:
    """Text the output adds after the prompt (a Metaspace decoder strips the leading space only
    at the very start of a decode, so the output's first space counts)."""
    skip = True
    return tok.decode(prompt + output, skip_special_tokens=skip)[
        len(tok.decode(prompt, skip_special_tokens=skip)) :
    ]


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode_and_never_has_partial_chars(name: str, text: str):
    tok = TOKENIZERS[name]()
    prompt = tok.encode("the cat", add_special_tokens=False)
    output = tok.encode(" " + text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
    deltas = stream(detok, output)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == " " + text == expected_output_text(tok, prompt, output)
    if name == "byte_level":
        assert "".join(deltas) == tok.decode(output)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_multi_byte_characters_really_are_split_over_tokens(name: str):
    tok = TOKENIZERS[name]()
    ids = tok.encode("日本語 😀 👍🏽", add_special_tokens=False)
    # Precondition of the tests above: some tokens hold only part of a character.
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    full = tok.decode(ids)
    num_held = 0
    text = ""
    for k, t in enumerate(ids, 1):
        text += detok.add([t])
        # Never ahead of the truth, never a partial character, held only while incomplete.
        assert full.startswith(text) and "\ufffd" not in text
        partial = tok.decode(ids[:k])
        if not partial.endswith("\ufffd"):
            assert text == partial
            continue
        num_held += 1
        # ByteFallback turns a whole run of byte tokens into U+FFFDs while any of it is
        # incomplete, so only the byte-level decode shows exactly what is safe to emit.
        if name == "byte_level":
            assert text == partial.rstrip("\ufffd")
    assert num_held > 0


@settings(max_examples=60, deadline=None)
@given(
    st.text(alphabet="ab éü日本😀👍🏽 \n.", min_size=1, max_size=30),
    st.sampled_from(sorted(TOKENIZERS)),
)
def test_property_streaming_matches_decode(text: str, name: str):
    tok = TOKENIZERS[name]()
    prompt = tok.encode("hello", add_special_tokens=False)
    output = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = stream(detok, output)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == expected_output_text(tok, prompt, output)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 339), min_size=1, max_size=20))
def test_property_arbitrary_ids_match_decode_after_flush(ids: list[int]):
    # Random ids include invalid byte sequences: those come out as U+FFFD, like decode does.
    tok = byte_level_tokenizer()
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert "".join(stream(detok, ids)) == tok.decode(ids, skip_special_tokens=False)


def test_byte_table_only_for_byte_level_decoders():
    tok = byte_level_tokenizer()
    table = token_byte_table(tok)
    assert table is not None
    assert table[tok.convert_tokens_to_ids("Ġ")] == b" "
    assert table[tok.eos_token_id] == b"<|eos|>"
    # Byte fallback turns invalid bytes into U+FFFD per byte group, not per maximal subpart:
    # that decoder keeps the window algorithm.
    assert token_byte_table(metaspace_tokenizer()) is None
    assert IncrementalDetokenizer(tok, [])._utf8 is not None  # white-box: fast path taken
    assert IncrementalDetokenizer(metaspace_tokenizer(), [])._utf8 is None


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(0, 345), min_size=1, max_size=24),  # 340..345: past the vocabulary
    st.lists(st.integers(0, 339), max_size=4),
    st.booleans(),
)
def test_property_fast_path_equals_window_algorithm(ids: list[int], prompt: list[int], skip: bool):
    tok = byte_level_tokenizer()
    fast = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    slow = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    slow._utf8 = None  # white-box: force the window algorithm
    if fast._utf8 is None:  # the prompt ends inside a character: both use the window
        return
    # Same text in the end. The fast path may emit sooner: a byte that can never start a valid
    # character is U+FFFD at once, where the window waits for the end of the run.
    assert "".join(stream(fast, ids)) == "".join(stream(slow, ids))


def test_spacing_kept_with_metaspace_decoder():
    tok = metaspace_tokenizer()
    output = tok.encode("the cat sat on a mat", add_special_tokens=False)
    naive = "".join(tok.decode([t]) for t in output)
    assert naive != "the cat sat on a mat"  # per-token decode loses the spaces
    prompt = tok.encode("hello", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    # Continuation text: "▁the" after the prompt keeps its space.
    assert "".join(stream(detok, output)) == " the cat sat on a mat"


def test_several_tokens_per_call_equal_one_at_a_time():
    tok = byte_level_tokenizer()
    output = tok.encode(" ".join(TEXTS), add_special_tokens=False)
    for fast in (True, False):
        one = IncrementalDetokenizer(tok, [])
        many = IncrementalDetokenizer(tok, [])
        if not fast:
            one._utf8 = many._utf8 = None  # white-box: the window algorithm
        text = "".join(stream(one, output))
        assert text == tok.decode(output)
        assert text == (
            many.add(output[:3]) + many.add(output[3:7]) + many.add(output[7:]) + many.flush()
        )


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(skip: bool):
    tok = byte_level_tokenizer()
    eos, bos = tok.convert_tokens_to_ids(["<|eos|>", "<|bos|>"])
    output = [bos, *tok.encode("café", add_special_tokens=False), eos, eos]
    detok = IncrementalDetokenizer(tok, [bos], skip_special_tokens=skip)
    text = "".join(stream(detok, output))
    assert text == ("café" if skip else "<|bos|>café<|eos|><|eos|>")
    assert text == tok.decode(output, skip_special_tokens=skip)


def test_long_run_of_skipped_special_tokens_keeps_window_small():
    tok = byte_level_tokenizer()
    eos = tok.eos_token_id
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add([eos] * 5000) == ""
    assert detok.add(tok.encode(" hi", add_special_tokens=False)) == " hi"
    assert len(detok._ids) < 10  # white-box: no O(n) window


def test_decode_token():
    tok = byte_level_tokenizer()
    detok = IncrementalDetokenizer(tok, [])
    assert detok.decode_token(tok.eos_token_id) == "<|eos|>"
    assert detok.decode_token(tok.convert_tokens_to_ids("Ġ")) == " "
    for t in tok.encode("the cat said hello", add_special_tokens=False):
        assert detok.decode_token(t) == tok.decode([t]) != ""
    first_byte = tok.encode("😀", add_special_tokens=False)[0]
    assert detok.decode_token(first_byte) == "\ufffd"


# --- tokenizer.py -------------------------------------------------------------------------


def saved_files(tok: PreTrainedTokenizerFast, tmp_path: Path) -> dict[str, bytes]:
    tok.save_pretrained(tmp_path)
    return {p.name: p.read_bytes() for p in tmp_path.iterdir()}


def test_load_tokenizer_round_trip(tmp_path: Path):
    tok = byte_level_tokenizer()
    files = saved_files(tok, tmp_path)
    assert "tokenizer.json" in files
    loaded = load_tokenizer(files)
    text = "café 日本語 😀 hello"
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.decode(tok.encode(text)) == text
    assert loaded.eos_token_id == tok.eos_token_id
    assert special_token_ids(loaded) == frozenset(tok.convert_tokens_to_ids(SPECIALS))
    assert eos_token_ids(loaded) == [tok.convert_tokens_to_ids("<|eos|>")]
    assert encode_prompt(loaded, "hello world") == tok.encode("hello world")
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat(loaded, messages) == "<|bos|><|user|>hi\n<|assistant|>"


def test_load_tokenizer_rejects_bad_files(tmp_path: Path):
    files = saved_files(byte_level_tokenizer(), tmp_path)
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer({k: v for k, v in files.items() if k != "tokenizer.json"})
    with pytest.raises(ValueError, match="invalid tokenizer file name"):
        load_tokenizer({**files, "../evil.json": b"{}"})


def test_chat_template_rendering():
    tok = byte_level_tokenizer()
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "café?"},
    ]
    text = render_chat(tok, messages)
    assert text == "<|bos|><|system|>be brief\n<|user|>café?\n<|assistant|>"
    assert render_chat(tok, messages, add_generation_prompt=False).endswith("café?\n")
    ids = encode_chat(tok, messages)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1  # no doubled BOS
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_chat_without_template_is_a_clear_error(tmp_path: Path):
    files = saved_files(byte_level_tokenizer(), tmp_path)
    files.pop("chat_template.jinja", None)
    config = json.loads(files["tokenizer_config.json"])
    config.pop("chat_template", None)
    files["tokenizer_config.json"] = json.dumps(config).encode()
    tok = load_tokenizer(files)
    with pytest.raises(ValueError, match="no chat template"):
        render_chat(tok, [{"role": "user", "content": "hi"}])


def test_scheduler_modules_do_not_import_torch():
    code = (
        "import sys, scheduler_svc.output.tokenizer, scheduler_svc.output.detokenizer, "
        "scheduler_svc.output.processor; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
