"""Property test: a position's logits and sampled token do not depend on how it was batched.

For random small Llama/Qwen shapes and random token lists, every position computed
(a) one token a step, alone — the reference —
(b) in one whole prefill,
(c) in a chunked prefill split at every boundary (a short sequence) and at random cuts,
(d) in random batches of 1 ... 64 co-runners, prefill chunks and decodes mixed,
(e) after its blocks were swapped out and back in (to other blocks),
(f) after its blocks were dropped and it was recomputed from position 0,
(h) on prefix-cache hits (its first blocks are another sequence's, co-running; with a shared
    prefix past one softmax chunk the CPU kernel's shared-prefix groups take it)
must give bitwise the same logits (``torch.equal``), and the same sampled token and logprob,
greedy or seeded, sampled among all the step's rows. With the CPU attention kernel and with the
torch backend; four architectures (Llama GQA, Qwen2 with biases, Qwen3 with q/k norm, a tied
embedding), head_dim 16 (the kernel's generic path) to 64, vocabularies that are not multiples
of a vector.

(g), steps planned ahead, changes which steps a sequence's decodes land in, never what a step
computes: it is (d) here, and end to end tests/integration/test_async_scheduling.py and
tests/integration/test_invariance_chaos.py compare served outputs with and without it.

Mutation check: an order-dependent matmul (K summed in two halves when a step has more than one
row) is caught.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from executor_svc.attention import cpu_ops
from executor_svc.config import numerics
from executor_svc.models import llama
from executor_svc.runner.model_runner import ModelRunner
from executor_svc.runner.sampler import SamplingParams
from tests.support.invariance import (
    Seq,
    mismatches,
    one_token_steps,
    random_batches,
    run_plan,
    split_at,
    whole_prefills,
)
from tests.support.model_factory import make_tiny_checkpoint

BLOCK_SIZE = 4
LONG = 144  # past the CPU kernel's 128-key softmax chunk
SHARED_BLOCKS = 34  # 136 shared tokens: a group of more than one chunk
VOCABS = (500, 509, 512)

# (arch, tied, head_dim, num_heads, num_kv_heads): GQA, biases, q/k norm, tied embedding; the
# head_dim 16 case takes the kernel's generic (non-vectorised) path.
CASES = [
    ("llama", False, 32, 4, 2),
    ("qwen2", False, 64, 4, 4),
    ("qwen3", False, 32, 6, 2),
    ("llama", True, 16, 4, 1),
]


def _model(tmp_path, arch: str, tied: bool, head_dim: int, heads: int, kv_heads: int, seed: int):
    rng = random.Random(seed)
    return make_tiny_checkpoint(
        tmp_path / f"{arch}-{seed}",
        arch,
        seed=seed,
        tie_word_embeddings=tied,
        hidden_size=rng.choice((64, 96, 128)),
        intermediate_size=rng.choice((96, 160, 256)),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=rng.choice(VOCABS),
        initializer_range=0.2,
    )


def _params(rng: random.Random) -> SamplingParams:
    kind = rng.randrange(4)
    if kind == 0:
        return SamplingParams()  # greedy
    return SamplingParams(
        temperature=rng.choice((0.5, 0.8, 1.0, 1.3)),
        top_k=rng.choice((0, 5, 40)) if kind == 2 else 0,
        top_p=rng.choice((0.7, 0.95)) if kind == 3 else 1.0,
        min_p=rng.choice((0.0, 0.05)),
        seed=rng.randrange(1 << 30),
    )


def _workload(rng: random.Random, vocab: int, num_short: int, long: bool) -> tuple[list, dict]:
    seqs = []
    shared: dict[str, tuple[str, int]] = {}
    if long:
        base = [rng.randrange(vocab) for _ in range(LONG)]
        seqs.append(Seq("long0", base, LONG - 8, _params(rng)))
        for i in (1, 2):
            n = SHARED_BLOCKS * BLOCK_SIZE
            tail = [rng.randrange(vocab) for _ in range(rng.randint(3, 10))]
            seqs.append(Seq(f"long{i}", base[:n] + tail, n + 1, _params(rng)))
            shared[f"long{i}"] = ("long0", SHARED_BLOCKS)
    for i in range(num_short):
        n = rng.randint(2, 24)
        tokens = [rng.randrange(vocab) for _ in range(n)]
        seqs.append(Seq(f"s{i}", tokens, rng.randint(1, n), _params(rng)))
    return seqs, shared


def _runner(
    model_dir, backend: str, device: str = "cpu", quantization: str | None = None
) -> ModelRunner:
    return ModelRunner(
        model_dir,
        device=device,
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_device_blocks=1024,
        swap_space_gib=0.05,
        attention_backend=backend,
        quantization=quantization,
    )


def _check(runner: ModelRunner, seqs: list[Seq], shared: dict, rng: random.Random) -> list[str]:
    """Every plan against the one-token reference; the list of differences (empty = pass)."""
    ref = run_plan(runner, seqs, one_token_steps)
    plans = {
        "whole prefill": whole_prefills,
        "random cuts": split_at(sorted(rng.sample(range(1, LONG), 12))),
        "batches": random_batches(rng),
        "batches, swap and recompute": random_batches(rng, p_swap=0.15, p_recompute=0.1),
        "batches, prefix hits": random_batches(rng, shared=shared),
    }
    bad = []
    for name, schedule in plans.items():
        bad += [f"{name}: {m}" for m in mismatches(ref, run_plan(runner, seqs, schedule))]
    # Every chunk boundary of one short sequence, two chunks each.
    short = next(s for s in seqs if s.seq_id.startswith("s") and len(s.tokens) > 6)
    for cut in range(1, len(short.tokens)):
        got = run_plan(runner, [short], split_at([cut]))
        bad += [f"split at {cut}: {m}" for m in mismatches(ref, got)]
    return bad


needs_kernel = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler for the kernels")


@pytest.fixture(autouse=True)
def _deterministic():
    before = numerics.deterministic()
    numerics.set_deterministic(True)
    yield
    numerics.set_deterministic(before)


@needs_kernel
@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}{'-tied' if c[1] else ''}" for c in CASES])
def test_positions_invariant_to_grouping(tmp_path, case, backend):
    seed = zlib.crc32(repr((case, backend)).encode()) % 1000  # stable across runs
    rng = random.Random(seed)
    model_dir = _model(tmp_path, *case, seed=seed)
    runner = _runner(model_dir, backend)
    assert runner.backend.name == backend
    seqs, shared = _workload(rng, runner.info.vocab_size, num_short=6, long=True)
    bad = _check(runner, seqs, shared, rng)
    assert not bad, f"{len(bad)} differences, first: {bad[:5]}"


@needs_kernel
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_batches_up_to_64(tmp_path, backend):
    """64 short sequences: batches of every size up to 64, prefills and decodes mixed."""
    rng = random.Random(7)
    runner = _runner(_model(tmp_path, *CASES[0], seed=7), backend)
    seqs, _ = _workload(rng, runner.info.vocab_size, num_short=64, long=False)
    ref = run_plan(runner, seqs, one_token_steps)
    for schedule in (whole_prefills, random_batches(rng, p_swap=0.1, p_recompute=0.05)):
        bad = mismatches(ref, run_plan(runner, seqs, schedule))
        assert not bad, f"{len(bad)} differences, first: {bad[:5]}"


@needs_kernel
@pytest.mark.parametrize("quantization", ["int8", "int4", "int4-act8"])
def test_quantized_weights_invariant_to_grouping(tmp_path, monkeypatch, quantization):
    """Weights kept as GGUF blocks (kernels/quant.py, the GGUF path's kernels): the same
    property, for a GQA Llama and a Qwen2 with biases (every input size a multiple of 32);
    ``-act8``: with the opt-in int8 activations (LLMSERVE_QUANT_ACT=int8)."""
    if quantization.endswith("-act8"):
        monkeypatch.setenv("LLMSERVE_QUANT_ACT", "int8")
        quantization = quantization.removesuffix("-act8")
    for i, case in enumerate((CASES[0], CASES[1])):
        seed = 31 + i
        rng = random.Random(seed)
        runner = _runner(_model(tmp_path, *case, seed=seed), "cpu", quantization=quantization)
        assert runner.model.layers[0].mlp.down_proj.packed is not None
        seqs, shared = _workload(rng, runner.info.vocab_size, num_short=6, long=True)
        bad = _check(runner, seqs, shared, rng)
        assert not bad, f"{case}: {len(bad)} differences, first: {bad[:5]}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}{'-tied' if c[1] else ''}" for c in CASES])
def test_positions_invariant_to_grouping_triton_cuda(tmp_path, monkeypatch, case):
    """The same property on the Triton backend (fp32 on CUDA) with the step-invariant CUDA
    kernels (LLMSERVE_CUDA_INVARIANT=1: Triton GEMMs tiled by the weight's shape, attention
    with one tile height and no context split, the sampler's row reductions in a fixed order);
    passed on an H200. Under the default CUDA numerics (cuBLAS) logits differ by ~1e-5 between
    groupings (docs/benchmarks.md, "CUDA")."""
    monkeypatch.setenv("LLMSERVE_CUDA_INVARIANT", "1")
    seed = 11
    rng = random.Random(seed)
    runner = _runner(_model(tmp_path, *case, seed=seed), "triton", device="cuda")
    seqs, shared = _workload(rng, runner.info.vocab_size, num_short=6, long=True)
    bad = _check(runner, seqs, shared, rng)
    assert not bad, f"{len(bad)} differences, first: {bad[:5]}"


# -- mutation checks: the property must catch an order that follows the step's shape ---------


def _order_dependent_matmul(x, w_io, bias=None):
    """x @ w with K summed in two halves when the step has more than one row."""
    x, w = x.float(), w_io.float()
    if x.shape[0] == 1:
        y = x @ w
    else:
        k = x.shape[1] // 2
        y = x[:, :k] @ w[:k] + x[:, k:] @ w[k:]
    return y if bias is None else y + bias


@needs_kernel
def test_catches_an_order_dependent_matmul(tmp_path, monkeypatch):
    rng = random.Random(3)
    model_dir = _model(tmp_path, *CASES[0], seed=3)
    monkeypatch.setenv("LLMSERVE_PREPACK", "0")
    # The mutation replaces Linear.forward, which the one-call CPU decoder does not call.
    monkeypatch.setenv("LLMSERVE_CPU_FUSED_DECODER", "0")
    numerics.set_deterministic(False)  # plain [in, out] weights for the mutated matmul
    runner = _runner(model_dir, "cpu")
    monkeypatch.setattr(llama, "matmul_io", _order_dependent_matmul)  # the lm_head
    monkeypatch.setattr(
        llama.Linear, "forward", lambda self, x: _order_dependent_matmul(x, self.weight, self.bias)
    )
    numerics.set_deterministic(True)
    seqs, shared = _workload(rng, runner.info.vocab_size, num_short=4, long=False)
    bad = mismatches(
        run_plan(runner, seqs, one_token_steps), run_plan(runner, seqs, whole_prefills)
    )
    assert bad, "an order-dependent matmul went unnoticed"
