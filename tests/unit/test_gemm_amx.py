"""The amx kernel variant's bf16 GEMM (csrc/gemm_bf16_amx.h): every row count on AMX tiles, a
row's bits the same alone and in any batch and thread count (step invariance), within rounding of
the avx512bf16 variant (TDPBF16PS does not round as vdpbf16ps: the bits are its own,
docs/benchmarks.md "AMX"), and close to fp64.

The tile tests need a CPU with AMX-BF16 (``amx_tile`` and ``amx_bf16`` in /proc/cpuinfo) and
skip elsewhere (CI has none); the device script benchmarks/device_amx.sh runs them on an AMX
Xeon. The layout test runs wherever the avx512bf16 variant runs: the amx build's packed layout
(32-column panels, K padded to whole tiles) through its vdpbf16ps and FMA paths.
"""

from __future__ import annotations

import pytest
import torch

from executor_svc.kernels import gemm_bf16, library

FLAGS = set(library._cpu_features().split())
HAS_AMX = {"amx_tile", "amx_bf16"} <= FLAGS
needs_amx = pytest.mark.skipif(
    not HAS_AMX, reason="this CPU has no AMX-BF16 (amx_tile, amx_bf16 not in /proc/cpuinfo)"
)
ROWS = (1, 2, 7, 16, 17, 64, 100)
# (K, N): K odd, K not a multiple of a tile's 32 (rows copied), K a multiple (rows read in
# place), N not a multiple of a panel, several panels.
SHAPES = [(33, 20), (130, 50), (576, 960), (1537, 97), (64, 32)]
ALL_ROWS, NO_ROWS = 0, 1 << 62  # llmserve_gemm_bf16_amx_set(0, ...): tiles for every / no call


def _data(m: int, k: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(k, n, generator=g) * 0.05).bfloat16()
    return x, w, torch.randn(n, generator=g)


def _load(name: str, monkeypatch) -> None:
    monkeypatch.setenv("LLMSERVE_CPU_ISA", name)
    library.reset()
    assert library.variant() == name, (name, library.variant())


def _tiles_from(rows: int) -> int:
    """Take the tiles from ``rows`` rows on; the previous setting."""
    return library.load().llmserve_gemm_bf16_amx_set(0, max(rows, 1))


@pytest.fixture
def variants(monkeypatch):
    """Load a variant by name for the test, the default one after it."""
    yield lambda name: _load(name, monkeypatch)
    monkeypatch.delenv("LLMSERVE_CPU_ISA", raising=False)
    library.reset()


def _outputs(w, x, bias, rows=ROWS, out_dtype=torch.float32):
    packed = gemm_bf16.pack(w)
    xs = x if out_dtype == torch.bfloat16 else x.float()
    return {m: packed.linear(xs[:m], bias) for m in rows}


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    bad = a != b
    return f"{int(bad.sum())} of {a.numel()} differ, max |diff| {(a - b).abs().max().item():.3g}"


@needs_amx
def test_amx_is_picked_and_has_its_tile_state(variants):
    library.reset()
    assert library.variant() == "amx"
    assert gemm_bf16.isa_path() == "amx"
    assert library.load().llmserve_amx_init() == 0


@needs_amx
@pytest.mark.parametrize("k,n", SHAPES)
def test_tiles_are_within_rounding_of_vdpbf16ps(variants, k, n):
    """Every row count on the tiles against the avx512bf16 variant (vdpbf16ps for one row, the
    widening FMAs for more): fp32 accumulations of the same products in another rounding, so
    close but not bitwise (the share of equal elements is printed)."""
    x, w, bias = _data(max(ROWS), k, n, seed=k)
    variants("avx512bf16")
    want, want_bf16 = _outputs(w, x, bias), _outputs(w, x, None, out_dtype=torch.bfloat16)
    variants("amx")
    got, got_bf16 = _outputs(w, x, bias), _outputs(w, x, None, out_dtype=torch.bfloat16)
    for m in ROWS:
        torch.testing.assert_close(got[m], want[m], atol=1e-5 * k**0.5, rtol=1e-5)
        torch.testing.assert_close(got_bf16[m], want_bf16[m], atol=1e-2, rtol=8e-3)  # 1 ulp
    same = (got[max(ROWS)] == want[max(ROWS)]).float().mean().item()
    print(f"k={k} n={n}: {same:.3f} of fp32 outputs equal to vdpbf16ps's")


@needs_amx
@pytest.mark.parametrize("k,n", SHAPES)
def test_tiles_follow_fp64(variants, k, n):
    variants("amx")
    x, w, bias = _data(max(ROWS), k, n, seed=k + 1)
    ref = x.double() @ w.double() + bias.double()
    for m, got in _outputs(w, x, bias).items():
        torch.testing.assert_close(got.double(), ref[:m], atol=2e-5 * k**0.5, rtol=1e-5)


@needs_amx
@pytest.mark.parametrize("k", [300, 320])  # rows copied, rows read in place
@pytest.mark.parametrize("from_rows", [ALL_ROWS, NO_ROWS])
def test_a_row_has_the_same_bits_in_any_batch_and_thread_count(variants, from_rows, k):
    """The tiles for every call (the default) or for none (the vector paths on the amx layout):
    a row gives the same bits alone and in any batch, with 1 or 4 threads, its tensor strided
    or not."""
    variants("amx")
    x, w, bias = _data(133, k, 230, seed=3)
    packed = gemm_bf16.pack(w)
    before, threads = _tiles_from(from_rows), torch.get_num_threads()
    try:
        alone = torch.cat([packed.linear(x[i : i + 1], bias) for i in range(x.shape[0])])
        for t in (1, 4):
            torch.set_num_threads(t)
            for rows in (*ROWS, 133):
                got = packed.linear(x[:rows], bias)
                assert torch.equal(got, alone[:rows]), (t, rows, _diff(got, alone[:rows]))
            assert torch.equal(packed.linear(x[::2], bias), alone[::2])
    finally:
        _tiles_from(before)
        torch.set_num_threads(threads)


@needs_amx
def test_a_refused_tile_state_falls_back_to_avx512bf16(variants, monkeypatch):
    """As load() behaves when the Linux kernel refuses arch_prctl(ARCH_REQ_XCOMP_PERM)."""
    assert library._open("amx")[1] == "amx"
    monkeypatch.setattr(library, "_open", _refusing(library._open))
    library.reset()
    assert library.variant() == "avx512bf16"


def _refusing(open_fn):
    class Refusing:
        def __init__(self, lib):
            self._lib = lib

        def __getattr__(self, attr):
            return getattr(self._lib, attr)

        def llmserve_amx_init(self):
            return 1  # EPERM

    def opener(name):
        lib, got = open_fn(name)
        return (Refusing(lib), got) if got == "amx" else (lib, got)

    return opener


def test_the_amx_layout_through_the_vector_paths(variants):
    """The amx build's layout (K padded to whole tiles with -0, 32-column panels) through its
    vdpbf16ps and FMA paths, the tiles off: the avx512bf16 bits. Runs wherever the avx512bf16
    variant does (no AMX needed)."""
    if "avx512bf16" not in library.supported_variants():
        pytest.skip("this CPU cannot run the avx512bf16 variant")
    x, w, bias = _data(max(ROWS), 1537, 97, seed=9)
    variants("avx512bf16")
    want = _outputs(w, x, bias)
    lib, name = library._open("amx")
    if lib is None or name != "amx":
        pytest.skip("the compiler cannot build the amx variant")
    before = lib.llmserve_gemm_bf16_amx_set(0, NO_ROWS)
    library.reset()
    library._lib, library._tried, library._variant = lib, True, "amx"
    try:
        assert gemm_bf16.isa_path() == "amx"
        packed = gemm_bf16.pack(w)
        assert packed.panels.shape == (4, 784, 32, 2)  # 769 pairs -> 49 tiles of 16
        assert packed.panels[0, 769:].view(torch.int16).eq(-32768).all()  # bf16 -0
        got = _outputs(w, x, bias)
    finally:
        lib.llmserve_gemm_bf16_amx_set(0, before)
        library.reset()
    for m in ROWS:
        assert torch.equal(got[m], want[m]), f"{m} rows: {_diff(got[m], want[m])}"


@needs_amx
@pytest.mark.parametrize("from_rows", [ALL_ROWS, NO_ROWS])
def test_bf16_model_positions_invariant_with_every_split_of_the_paths(
    variants, tmp_path, from_rows
):
    """test_step_invariance's plans on a bf16 model, amx loaded, the tiles taking every step (the
    default; tests/unit/test_bf16_model.py runs its own cases so on an AMX CPU) or none."""
    import random

    from executor_svc.config import numerics
    from executor_svc.runner.model_runner import ModelRunner
    from tests.unit import test_step_invariance as inv

    variants("amx")
    before, deterministic = _tiles_from(from_rows), numerics.deterministic()
    numerics.set_deterministic(True)
    try:
        rng = random.Random(5)
        runner = ModelRunner(
            inv._model(tmp_path, *inv.CASES[0], seed=5), device="cpu", dtype="bfloat16",
            block_size=inv.BLOCK_SIZE, num_device_blocks=1024, swap_space_gib=0.05,
        )  # fmt: skip
        seqs, shared = inv._workload(rng, runner.info.vocab_size, num_short=6, long=True)
        bad = inv._check(runner, seqs, shared, rng)
        assert not bad, f"{len(bad)} differences, first: {bad[:5]}"
    finally:
        _tiles_from(before)
        numerics.set_deterministic(deterministic)
