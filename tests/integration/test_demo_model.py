"""The offline demo checkpoint: loadable by transformers, deterministic, varied, UTF-8 safe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from executor_svc.demo import demo_model
from executor_svc.demo.demo_model import build_demo_model, ensure_demo_model

REPO_ROOT = Path(__file__).resolve().parents[2]

MULTI_BYTE_TEXTS = [
    "Café, naïve façade — crème brûlée à Zürich.",
    "Dvořák in Łódź; smörgåsbord in Göteborg, Straße № 5.",
    "東京と北京: 日本語、中文、안녕하세요, Привет мир, Γειά σου κόσμε.",
    "Emoji 😀🚀🎉 👩‍💻 🏳️‍🌈 🇯🇵 and unseen ones 🦄🪐 and a rare 龘 character.",
    "  leading spaces, tabs\tand\nnew lines\n\n 1,234.5 ≤ ∞ ± 0.01 «quoted» “curly” ’s",
    "",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("tiny-seed0"), size="tiny", seed=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def model(tiny_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


def greedy(model: torch.nn.Module, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """Plain argmax decoding with full forwards: no generate() defaults (EOS, min length) involved."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids) :]


def test_checkpoint_files_and_config(tiny_dir: Path, model: torch.nn.Module, tokenizer) -> None:
    names = {p.name for p in tiny_dir.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= names
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    expected_shape = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 512,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }
    assert {k: config[k] for k in expected_shape} == expected_shape
    assert type(model).__name__ == "LlamaForCausalLM"

    # Every id the model can emit is a real token of the tokenizer.
    assert len(tokenizer) == config["vocab_size"]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in demo_model.SPECIAL_TOKENS}
    assert tokenizer.bos_token_id == ids["<|begin_of_text|>"] == config["bos_token_id"]
    assert tokenizer.eos_token_id == ids["<|end_of_text|>"]
    eos = [ids["<|end_of_text|>"], ids["<|eot_id|>"]]
    assert GenerationConfig.from_pretrained(tiny_dir).eos_token_id == eos == config["eos_token_id"]
    assert tokenizer.pad_token_id == ids["<|pad|>"]

    with safe_open(tiny_dir / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    assert "lm_head.weight" in keys
    assert "model.layers.1.self_attn.k_proj.weight" in keys


def test_same_seed_is_byte_identical_across_processes_and_other_seed_differs(
    tiny_dir: Path, tmp_path: Path
) -> None:
    # A second build in a fresh interpreter (different hash seeds), through the CLI.
    again = tmp_path / "again"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "HF_HUB_OFFLINE": "1"}
    subprocess.run(
        [sys.executable, "-m", "executor_svc.demo.demo_model", str(again), "--size", "tiny"],
        cwd=REPO_ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    other = build_demo_model(tmp_path / "seed1", size="tiny", seed=1)
    for name in ("model.safetensors", "tokenizer.json"):
        original = (tiny_dir / name).read_bytes()
        assert (again / name).read_bytes() == original, name
        assert (other / name).read_bytes() != original, name


def test_greedy_generation_varies(model: torch.nn.Module, tokenizer) -> None:
    for prompt in ["The quiet river", "Yesterday, Kalomi ran across the bridge", "東京 🚀"]:
        out = greedy(model, tokenizer(prompt).input_ids, 20)
        assert len(out) == 20
        # Random small weights would lock onto one token; these must keep moving.
        assert len(set(out)) >= 8, (prompt, out)


def test_tokenizer_round_trips_multi_byte_text(tokenizer) -> None:
    for text in MULTI_BYTE_TEXTS:
        ids = tokenizer(text).input_ids
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert tokenizer.decode(ids[1:]) == text


def test_some_tokens_split_a_character(tokenizer) -> None:
    # Byte-level BPE leaves rare characters as single bytes: decoding such a token alone gives
    # U+FFFD, the case the scheduler's incremental detokenizer must hold back.
    ids = tokenizer("🦄 龘", add_special_tokens=False).input_ids
    pieces = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), pieces
    assert "".join(pieces) != "🦄 龘"
    assert tokenizer.decode(ids) == "🦄 龘"


def test_chat_template_renders(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  Where is the café? 🙂\n"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhere is the café? 🙂<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    rendered = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = rendered["input_ids"] if not isinstance(rendered, list) else rendered
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids) == text
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert no_prompt.endswith("🙂<|eot_id|>")


def test_overrides_reach_config_and_weights(tmp_path: Path) -> None:
    out = build_demo_model(tmp_path, size="tiny", seed=3, tie_word_embeddings=True, head_dim=8)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["head_dim"] == 8
    with safe_open(out / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
        assert list(f.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape()) == [32, 64]
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    with pytest.raises(ValueError, match="unknown demo model size"):
        build_demo_model(tmp_path / "bad", size="huge")


def test_demo_size_shape(tmp_path: Path) -> None:
    out = build_demo_model(tmp_path, size="demo")
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in demo_model.SIZES["demo"]} == demo_model.SIZES["demo"]
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == config["vocab_size"] == 4096
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert len(set(greedy(hf, tok("The engine").input_ids, 20))) >= 8


def test_ensure_demo_model_builds_once_and_is_safe_concurrently(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path))
    with ThreadPoolExecutor(max_workers=2) as pool:
        paths = list(pool.map(lambda _: ensure_demo_model(size="tiny", seed=7), range(2)))
    target = tmp_path / "demo-tiny-7"
    assert paths == [target, target]
    # Only the winner's directory remains; the loser's temporary build is gone.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-tiny-7"]
    AutoTokenizer.from_pretrained(target)

    weights = target / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert ensure_demo_model(size="tiny", seed=7) == target
    assert weights.stat().st_mtime_ns == mtime  # cached: not rebuilt

    # A build left by an older generator version is replaced.
    marker = target / demo_model.MARKER_FILE
    marker.write_text(json.dumps({"version": -1}))
    assert ensure_demo_model(cache_dir=tmp_path, size="tiny", seed=7) == target
    assert json.loads(marker.read_text())["version"] == demo_model.DEMO_FORMAT_VERSION
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-tiny-7"]
