"""The quantized matmul kernels (kernels/quant.py over csrc/quant_gemm.cpp): every supported
GGUF type de-quantizes bit for bit like the ``gguf`` package's numpy reference; the matmul
equals de-quantize-then-matmul within fp32 rounding for odd shapes; a row's result does not
depend on the other rows of the call or on the thread count (step invariance); the load-time
quantizer (``--quantization``) writes blocks the ``gguf`` package reads back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor_svc.kernels import quant
from executor_svc.models import quant_linear

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not quant.available(), reason="no C++ compiler for the kernels")

BLOCK_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]
# Byte offsets of each type's fp16 scale fields inside a block (random bytes there could be
# inf / NaN; everything else may be any byte).
_SCALES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}


def random_blocks(type_name: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """[rows, row_bytes] uint8: random quants and scales, every byte pattern of the quants."""
    rng = np.random.default_rng(seed)
    tid = quant.TYPE_IDS[type_name]
    _, block, nbytes = quant.TYPES[tid]
    raw = rng.integers(0, 256, size=(rows, k // block, nbytes), dtype=np.uint8)
    for off in _SCALES[type_name]:
        scale = (rng.standard_normal((rows, k // block, 1)) * 0.02).astype(np.float16)
        raw[..., off : off + 2] = scale.view(np.uint8)
    return raw.reshape(rows, -1)


def reference(type_name: str, raw: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_block_types_dequantize_like_gguf(type_name: str) -> None:
    k = 512
    raw = random_blocks(type_name, 13, k)
    got = quant.dequantize(quant.TYPE_IDS[type_name], torch.from_numpy(raw), k).numpy()
    want = reference(type_name, raw)
    assert got.shape == want.shape == (13, k)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_quantized_real_values_dequantize_like_gguf(type_name: str) -> None:
    """Blocks made by gguf's own quantizer from real-valued weights (not random bytes)."""
    w = np.random.default_rng(1).standard_normal((9, 96)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    got = quant.dequantize(quant.TYPE_IDS[type_name], torch.from_numpy(raw), 96).numpy()
    assert np.array_equal(got, reference(type_name, raw))


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
def test_float_types_dequantize_like_gguf(type_name: str) -> None:
    w = np.random.default_rng(2).standard_normal((5, 40)).astype(np.float32)
    if type_name == "F32":
        raw, want = w.view(np.uint8), w
    elif type_name == "F16":
        raw, want = w.astype(np.float16).view(np.uint8), w.astype(np.float16).astype(np.float32)
    else:
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.BF16).view(np.uint8)
        want = reference("BF16", raw)
    got = quant.dequantize(quant.TYPE_IDS[type_name], torch.from_numpy(raw.copy()), 40).numpy()
    assert np.array_equal(got, want)


def test_dequantize_selected_rows() -> None:
    raw = torch.from_numpy(random_blocks("Q4_1", 11, 64))
    full = quant.dequantize(quant.TYPE_IDS["Q4_1"], raw, 64)
    rows = torch.tensor([10, 0, 3, 3])
    assert torch.equal(quant.dequantize(quant.TYPE_IDS["Q4_1"], raw, 64, rows), full[rows])


def _shapes(type_name: str) -> list[tuple[int, int]]:
    ks = (256, 768) if type_name.endswith("_K") else (32, 96, 608)
    return [(n, k) for n in (1, 7, 61) for k in ks]


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_matmul_equals_dequantize_then_matmul(type_name: str) -> None:
    tid = quant.TYPE_IDS[type_name]
    for i, (n, k) in enumerate(_shapes(type_name)):
        raw = random_blocks(type_name, n, k, seed=i)
        weight = quant.QuantWeight(torch.from_numpy(raw), tid, k)
        w = torch.from_numpy(reference(type_name, raw)).double()
        bias = torch.randn(n)
        for m in (1, 3, 9, 17):
            x = torch.randn(m, k)
            want = x.double() @ w.T + bias.double()
            got = weight.linear(x, bias)
            # fp32 rounding of a k-term sum plus the bias: relative to the sum of |terms|.
            scale = x.double().abs() @ w.abs().T + bias.double().abs()
            assert ((got.double() - want).abs() / scale).max() < 1e-5, (n, k, m)


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_row_result_independent_of_batch_and_threads(type_name: str) -> None:
    tid = quant.TYPE_IDS[type_name]
    k = 512
    weight = quant.QuantWeight(torch.from_numpy(random_blocks(type_name, 37, k)), tid, k)
    x = torch.randn(21, k)
    alone = torch.cat([weight.linear(x[i : i + 1], None) for i in range(21)])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(weight.linear(x, None), alone)
            assert torch.equal(weight.linear(x[5:14], None), alone[5:14])
    finally:
        torch.set_num_threads(threads)


def test_non_contiguous_activations() -> None:
    tid = quant.TYPE_IDS["Q8_0"]
    weight = quant.QuantWeight(torch.from_numpy(random_blocks("Q8_0", 5, 64)), tid, 64)
    wide = torch.randn(4, 100)
    x = wide[:, 10:74]
    assert torch.equal(weight.linear(x, None), weight.linear(x.contiguous(), None))


def test_rejects_partial_blocks() -> None:
    with pytest.raises(ValueError, match="not whole Q4_K blocks"):
        quant.row_bytes(quant.TYPE_IDS["Q4_K"], 128)


@pytest.mark.parametrize("scheme,type_name", [("int8", "Q8_0"), ("int4", "Q4_1")])
def test_load_time_quantizer_writes_gguf_blocks(scheme: str, type_name: str) -> None:
    """``--quantization``'s blocks read back by gguf; error within half a quantization step."""
    w = torch.randn(24, 96)
    blocks = quant_linear.quantize(w, quant_linear.SCHEMES[scheme])
    back = torch.from_numpy(reference(type_name, blocks.numpy()))
    g = w.reshape(24, 3, 32)
    if scheme == "int8":
        step = g.abs().amax(-1, keepdim=True) / 127
    else:
        step = (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 15
    err = (back.reshape(24, 3, 32) - g).abs()
    assert (err <= step * 0.5 * 1.01 + 1e-3 * step).all()


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
def test_many_rows_span_several_row_blocks(type_name: str) -> None:
    """Past the kernel's L2 row block (256 KiB of x): rows in later blocks and in the tail
    give the same bits as alone."""
    tid, k = quant.TYPE_IDS[type_name], 1536
    weight = quant.QuantWeight(torch.from_numpy(random_blocks(type_name, 9, k)), tid, k)
    x = torch.randn(181, k)  # blocks of 40 rows at k = 1536: 4 whole blocks and a tail
    y = weight.linear(x, None)
    for i in (0, 39, 40, 47, 120, 175, 180):
        assert torch.equal(y[i : i + 1], weight.linear(x[i : i + 1], None)), i
