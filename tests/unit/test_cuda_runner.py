"""The model runner on CUDA (Triton attention, cuBLAS matmuls, CUDA graphs for decode) against
Hugging Face transformers on the same GPU, in fp32, bf16 and fp16. Skipped without a GPU.

The measured differences are printed (``pytest -s``) so a GPU run records them; the bounds
asserted are the ones docs/benchmarks.md ("CUDA") reports with the run that set them.
"""

from __future__ import annotations

import pytest
import torch

from executor_svc.runner.model_runner import ModelRunner, ScheduledSequence
from tests.support.model_factory import load_hf_model, make_tiny_checkpoint
from tests.unit.test_model_equivalence import BLOCK_SIZE, GreedyDriver, make_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Wider than the CPU tests' tiny models: Triton's tl.dot needs tiles of 16 and up, and head_dim
# 64 with 4 query heads per KV head is the shape class of real models.
SHAPE = {
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "num_hidden_layers": 3,
    "vocab_size": 1024,
}


def _model(tmp_path, arch: str, seed: int):
    return make_tiny_checkpoint(tmp_path / f"{arch}-{seed}", arch, seed=seed, **SHAPE)


def _runner(model_dir, dtype: str, **kwargs) -> ModelRunner:
    return ModelRunner(
        model_dir,
        device="cuda",
        dtype=dtype,
        attention_backend="triton",
        block_size=BLOCK_SIZE,
        num_device_blocks=kwargs.pop("num_device_blocks", 128),
        swap_space_gib=0.01,
        **kwargs,
    )


def _prefill_logits(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    seqs, block = [], 0
    for i, p in enumerate(prompts):
        n = -(-len(p) // BLOCK_SIZE)
        seqs.append(
            ScheduledSequence(str(i), p, len(p), list(range(block, block + n)), 0, len(p), None)
        )
        block += n
    with torch.inference_mode():
        batch = runner.prepare_inputs(seqs)
        hidden = runner.model(
            batch.input_ids, batch.positions, runner.kv_cache.layers, batch.attn_metadata
        )
        return runner.model.compute_logits(hidden).float()


def _hf_logits(model, prompts: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        rows = [model(torch.tensor([p], device="cuda")).logits[0].float() for p in prompts]
    return torch.cat(rows)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_prefill_logits_follow_hf_on_cuda(tmp_path, arch, dtype):
    model_dir = _model(tmp_path, arch, seed=1)
    prompts = make_prompts([3, 17, 40, 1, 64, 9], seed=2, vocab=SHAPE["vocab_size"])
    got = _prefill_logits(_runner(model_dir, dtype), prompts)
    hf = load_hf_model(model_dir).to("cuda")
    want32 = _hf_logits(hf, prompts)
    want_same = _hf_logits(hf.to(DTYPES[dtype]), prompts)
    diff32 = (got - want32).abs().max().item()
    diff_same = (got - want_same).abs().max().item()
    agree = (got.argmax(-1) == want32.argmax(-1)).float().mean().item()
    print(
        f"\n[cuda {arch} {dtype}] max|ours-HF fp32|={diff32:.3g} "
        f"max|ours-HF {dtype}|={diff_same:.3g} argmax agreement with HF fp32={agree:.3f}"
    )
    if dtype == "float32":
        torch.testing.assert_close(got, want32, atol=1e-3, rtol=1e-4)
    else:
        # Half precision: ours differs from HF fp32 no more than HF's own half model does
        # (plus a margin for rounding in another order).
        hf_half_vs_32 = (want_same - want32).abs().max().item()
        assert diff32 <= 2 * hf_half_vs_32 + 0.05, (diff32, hf_half_vs_32)
        assert agree >= 0.9


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_decode_matches_hf_generate_on_cuda(tmp_path, arch):
    """Chunked prefill, decodes (replayed from CUDA graphs), swap out/in and block copies on
    the GPU: the same tokens as HF generate (fp32)."""
    model_dir = _model(tmp_path, arch, seed=3)
    prompts = make_prompts([40, 9, 17, 1, 24], seed=4, vocab=SHAPE["vocab_size"])
    num_new = 24
    runner = _runner(model_dir, "float32", num_device_blocks=64)
    assert runner.graphs is not None, "CUDA graphs were not captured"
    d = GreedyDriver(runner, prompts)
    d.step({0: 16, 1: 9, 2: 17, 3: 1, 4: 24})
    d.step({0: 16, 1: 1, 2: 1, 3: 1, 4: 1})
    d.step({0: 8, 1: 1, 2: 1, 3: 1, 4: 1})
    cpu_blocks = list(range(len(d.tables[1])))
    d.step({i: 1 for i in (0, 2, 3, 4)}, swap_out=list(zip(d.tables[1], cpu_blocks, strict=True)))
    old = d.tables[1]
    d.scribble(old)
    d.free = d.free + old
    d.tables[1] = d.alloc(len(old))[::-1]
    d.step({i: 1 for i in range(5)}, swap_in=list(zip(cpu_blocks, d.tables[1], strict=True)))
    while any(len(d.tokens[i]) - len(prompts[i]) < num_new for i in range(5)):
        d.decode_all([i for i in range(5) if len(d.tokens[i]) - len(prompts[i]) < num_new])
    hf = load_hf_model(model_dir).to("cuda")
    for i, p in enumerate(prompts):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([p], device="cuda"),
                attention_mask=torch.ones(1, len(p), dtype=torch.long, device="cuda"),
                do_sample=False,
                max_new_tokens=num_new,
                pad_token_id=0,
            )[0, len(p) :].tolist()
        assert d.tokens[i][len(p) : len(p) + len(out)] == out, f"prompt {i}"


def _decode_tokens(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Prefill every prompt in one step, then ``steps`` greedy decode steps of all of them;
    the tokens each decode step picked."""
    d = GreedyDriver(runner, prompts)
    d.step({i: len(p) for i, p in enumerate(prompts)})
    out = []
    for _ in range(steps):
        seqs_before = [list(t) for t in d.tokens]
        d.decode_all(list(range(len(prompts))))
        out.append(torch.tensor([t[-1] for t in d.tokens]))
        assert all(len(t) == len(b) + 1 for t, b in zip(d.tokens, seqs_before, strict=True))
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 3, 8, 13, 40])
def test_graph_replay_equals_eager(tmp_path, monkeypatch, dtype, batch):
    """The same greedy tokens from graph replay (padded to the next captured size) as from
    eager decode steps of exactly the batch."""
    model_dir = _model(tmp_path, "llama", seed=5)
    prompts = make_prompts([5 + 7 * (i % 6) for i in range(batch)], seed=6, vocab=1024)
    graphed = _runner(model_dir, dtype, num_device_blocks=512)
    assert graphed.graphs is not None
    got = _decode_tokens(graphed, prompts, steps=12)
    monkeypatch.setenv("LLMSERVE_ENFORCE_EAGER", "1")
    eager = _runner(model_dir, dtype, num_device_blocks=512)
    assert eager.graphs is None
    want = _decode_tokens(eager, prompts, steps=12)
    same = sum(bool(torch.equal(a, b)) for a, b in zip(got, want, strict=True))
    print(f"\n[graphs {dtype} batch {batch}] steps with equal tokens: {same}/{len(got)}")
    assert same == len(got)
