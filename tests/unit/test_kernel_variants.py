"""Kernels per instruction set: every library variant this CPU runs against the torch reference,
the dispatch, and ``$LLMSERVE_CPU_ISA``.

Each variant is the same sources built with other ``-march`` flags (kernels/library.py); they run
here one after the other by forcing ``$LLMSERVE_CPU_ISA`` and reloading the library. Variants
the CPU lacks skip.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from executor_svc.attention import cpu_ops
from executor_svc.kernels import elementwise, gemm, gemm_bf16, library, sampling
from tests.unit.test_torch_attention import dense_reference, make_batch

RUNNABLE = library.supported_variants()
needs_kernel = pytest.mark.skipif(not library.available(), reason="no C++ compiler here")


@needs_kernel
@pytest.mark.parametrize("name", list(library.VARIANTS))
def test_each_variant_matches_the_torch_reference(use_variant, name):
    use_variant(name)
    g = torch.Generator().manual_seed(1)
    # fp32 GEMM, packed and plain.
    x, w, b = (
        torch.randn(11, 200, generator=g),
        torch.randn(200, 100, generator=g),
        torch.randn(100),
    )
    ref = x @ w + b
    torch.testing.assert_close(gemm.PanelWeight.pack(w).linear(x, b), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gemm.matmul(x, w, b), ref, atol=1e-4, rtol=1e-4)
    # bf16 GEMM (fp32 accumulation of bf16 products).
    xb, wb = x.bfloat16(), w.bfloat16()
    got = gemm_bf16.pack(wb).linear(xb.float(), b)
    torch.testing.assert_close(got, xb.float() @ wb.float() + b, atol=1e-4, rtol=1e-4)
    # Paged attention (decodes and prefill chunks, GQA).
    query, kc, vc, bt, sl, qsl, dense = make_batch([1, 7, 1], [30, 7, 140], num_heads=6,
                                                   num_kv_heads=2, head_dim=64)  # fmt: skip
    out = cpu_ops.paged_attention(query, kc, vc, bt, sl, qsl, 0.125)
    torch.testing.assert_close(out, dense_reference(query, qsl, dense, 0.125), atol=2e-5, rtol=1e-4)
    # Fused elementwise and the sampler's reduction.
    gate_up = torch.randn(5, 2 * 40, generator=g)
    torch.testing.assert_close(
        elementwise.silu_mul(gate_up),
        F.silu(gate_up[:, :40]) * gate_up[:, 40:],
        atol=1e-6,
        rtol=1e-5,
    )
    h, d, nw = torch.randn(5, 96, generator=g), torch.randn(5, 96, generator=g), torch.rand(96)
    total, normed = elementwise.add_rms_norm(h, d, nw, 1e-6)
    torch.testing.assert_close(total, h + d)
    torch.testing.assert_close(normed, F.rms_norm(h + d, (96,), nw, 1e-6), atol=1e-5, rtol=1e-5)
    logits = torch.randn(4, 1000, generator=g)
    ids, lse = sampling.argmax_logsumexp(logits)
    assert torch.equal(ids, logits.argmax(-1))
    torch.testing.assert_close(lse, logits.logsumexp(-1))


@needs_kernel
def test_the_best_variant_is_picked_and_a_missing_one_is_refused(use_variant, monkeypatch):
    monkeypatch.delenv("LLMSERVE_CPU_ISA", raising=False)  # a run may force one (issue 41)
    library.reset()
    assert library.variant() == RUNNABLE[0]
    flags = set(library._cpu_features().split())
    expected = "avx512bf16" if {"avx512_bf16", "avx512bw"} <= flags else RUNNABLE[0]
    if expected == "avx512bf16" and {"amx_tile", "amx_bf16"} <= flags:
        expected = "amx"
    assert RUNNABLE[0] == expected
    monkeypatch.setenv("LLMSERVE_CPU_ISA", "no-such-isa")
    library.reset()
    assert library.variant() == RUNNABLE[0]  # refused with a warning, the best one is used


@needs_kernel
def test_variants_give_the_same_bf16_bits(use_variant):
    """The bf16 GEMM's chain is fixed by the module, not by the instruction set: vdpbf16ps (one
    row, avx512bf16) and the widening FMAs (every other tile, every other variant) agree. The amx
    variant's tiles round their own way (csrc/gemm_bf16_amx.h): only its rows alone and in a
    batch must agree."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(19, 320, generator=g).bfloat16()
    w = (torch.randn(320, 150, generator=g) * 0.05).bfloat16()
    results = {}
    for name in RUNNABLE:
        use_variant(name)
        packed = gemm_bf16.pack(w)
        batch = packed.linear(x, None)
        alone = torch.cat([packed.linear(x[i : i + 1], None) for i in range(x.shape[0])])
        assert torch.equal(batch, alone), name
        results[name] = batch
    results.pop("amx", None)
    first = next(iter(results.values()))
    assert all(torch.equal(first, r) for r in results.values()), list(results)


@needs_kernel
def test_variants_give_the_same_fp32_gemm_bits(use_variant):
    """The fp32 GEMM's tiles differ per instruction set (zmm tiles for AVX-512, smaller ymm
    micro-tiles for AVX2) but each element's chain does not: every row count (each remainder
    tile, the one-row path), packed or plain, with a partial last panel, gives the same bits."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(21, 328, generator=g)
    w, b = torch.randn(328, 250, generator=g), torch.randn(250, generator=g)
    results = {}
    for name in RUNNABLE:
        use_variant(name)
        packed = gemm.PanelWeight.pack(w)
        outs = [packed.linear(x, b), gemm.matmul(x, w, b), packed.linear(x[:7], None)]
        outs += [packed.linear(x[i : i + 1], b) for i in range(x.shape[0])]
        assert torch.equal(outs[0], torch.cat(outs[3:])), name
        assert torch.equal(outs[0], outs[1]), name
        results[name] = outs
    first = next(iter(results.values()))
    for name, outs in results.items():
        assert all(torch.equal(a, o) for a, o in zip(first, outs, strict=True)), name


@needs_kernel
def test_a_folder_of_prebuilt_variants_serves_without_a_compiler(tmp_path):
    """The Docker image's layout: $LLMSERVE_KERNEL_LIB a folder of <variant>.so files, no
    compiler. With only the avx2 one there, a CPU that would take a better one falls back to it."""
    import os
    import shutil
    import subprocess
    import sys

    if "avx2" not in RUNNABLE:
        pytest.skip("needs an x86-64-v3 CPU")
    built, name = library._build("avx2")
    assert built is not None and name == "avx2"
    shutil.copy(built, tmp_path / "avx2.so")
    code = (
        "from executor_svc.kernels import gemm_bf16, library\n"
        "assert library.variant() == 'avx2', library.variant()\n"
        "assert gemm_bf16.isa_path() == 'avx2'\n"
        "print('folder ok')\n"
    )
    env = dict(
        os.environ, PATH=str(tmp_path), CXX="", LLMSERVE_KERNEL_DIR=str(tmp_path / "cache"),
        LLMSERVE_KERNEL_LIB=str(tmp_path),
    )  # fmt: skip
    env.pop("LLMSERVE_CPU_ISA", None)
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "folder ok" in result.stdout


@needs_kernel
@pytest.mark.parametrize("name", list(library.VARIANTS))
def test_bf16_kv_cache_attention_matches_the_reference(use_variant, name):
    """The kernel's bf16-K/V build against the dense reference over the same (bf16) cache."""
    use_variant(name)
    query, kc, vc, bt, sl, qsl, dense = make_batch(
        [1, 9, 1], [70, 9, 150], num_heads=6, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16
    )
    query = query.float()
    out = cpu_ops.paged_attention(query, kc, vc, bt, sl, qsl, 0.125)
    assert out.dtype == torch.float32
    dense = [tuple(t.float() for t in d) for d in dense]
    torch.testing.assert_close(out, dense_reference(query, qsl, dense, 0.125), atol=2e-5, rtol=1e-4)


def _attention_cases(kv_dtype: torch.dtype) -> list[tuple]:
    """Decodes and prefill chunks whose key counts end mid-vector, every vectorised head_dim,
    block sizes 16 and 32, and a batch whose sequences share leading blocks (a group)."""
    cases = []
    for head_dim, block_size in ((32, 16), (48, 32), (64, 16), (80, 16), (96, 32), (128, 16)):
        cases.append(
            make_batch(
                [1, 13, 1, 40],
                [37, 13, 300, 170],
                num_heads=6,
                num_kv_heads=2,
                head_dim=head_dim,
                block_size=block_size,
                dtype=kv_dtype,
            )  # fmt: skip
        )
    query, kc, vc, bt, sl, qsl, dense = make_batch(
        [1, 1, 5, 3], [300, 290, 310, 270], num_heads=9, num_kv_heads=3, head_dim=64,
        dtype=kv_dtype,
    )  # fmt: skip
    bt[1:, :12] = bt[0, :12]  # 192 shared keys: a shared-prefix group
    cases.append((query, kc, vc, bt, sl, qsl, dense))
    return cases


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32-kv", "bf16-kv"])
def test_variants_give_the_same_attention_bits(use_variant, kv_dtype):
    """The AVX2 build's attention (8-lane scores, softmax and weighted sums) reduces in the
    AVX-512 build's order: every variant gives the same bits, fp32 or bf16 K/V."""
    cases = _attention_cases(kv_dtype)
    results = {}
    for name in RUNNABLE:
        use_variant(name)
        results[name] = [
            cpu_ops.paged_attention(q.float(), kc, vc, bt, sl, qsl, 0.125)
            for q, kc, vc, bt, sl, qsl, _ in cases
        ]
    first = next(iter(results.values()))
    for name, outs in results.items():
        assert all(torch.equal(a, o) for a, o in zip(first, outs, strict=True)), name


@needs_kernel
def test_variants_give_the_same_sampler_and_elementwise_bits(use_variant):
    """argmax + logsumexp, silu * mul and add + rms_norm (fp32 and bf16 rows): the AVX2 build's
    8-lane halves give the AVX-512 build's bits, whole vectors and scalar tails alike (widths
    that are multiples of 16, of 8 only, and neither)."""
    g = torch.Generator().manual_seed(4)
    logits = [torch.randn(5, n, generator=g) * 4 for n in (49152, 1000, 1003, 24)]
    logits[0][2, 7000] = logits[0][2, 40000] = 100.0  # a tie: the first index wins
    gate_up = [torch.randn(6, 2 * n, generator=g) for n in (1536, 40, 43, 24)]
    rows = [
        (torch.randn(6, n, generator=g), torch.randn(6, n, generator=g), torch.rand(n, generator=g))
        for n in (576, 96, 100, 8)
    ]
    results = {}
    for name in RUNNABLE:
        use_variant(name)
        out: list[torch.Tensor] = []
        for x in logits:
            out += list(sampling.argmax_logsumexp(x))
        for dtype in (torch.float32, torch.bfloat16):
            out += [elementwise.silu_mul(x.to(dtype)) for x in gate_up]
            for h, d, w in rows:
                out += list(elementwise.add_rms_norm(h.to(dtype), d.to(dtype), w.to(dtype), 1e-6))
                out += list(elementwise.add_rms_norm(h.to(dtype), None, w.to(dtype), 1e-6))[1:]
        assert all(isinstance(t, torch.Tensor) for t in out)
        results[name] = out
    first = next(iter(results.values()))
    for name, outs in results.items():
        assert all(torch.equal(a, o) for a, o in zip(first, outs, strict=True)), name
