"""The CPU kernels' floating-point mode (MXCSR) is theirs, not the calling thread's.

Loading the kernel library (built with -ffast-math) used to leave flush-to-zero and
denormals-are-zero on in the loading thread alone. Kernels that did not set a mode themselves
(attention, norms, SiLU, sampling, LoRA) then rounded denormals one way offline (the main
thread loaded the library) and another in a served executor (its gRPC threads were started
before the load), and took denormal assists there: 25 % slower prefill steps
(docs/benchmarks.md, "The calling thread's MXCSR"). Now each kernel thread sets its mode
(csrc/simd.h FlushMode) and the loader clears what the library's constructor set.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable

import pytest
import torch

from executor_svc.attention import cpu_ops
from executor_svc.kernels import elementwise, library

needs_kernel = pytest.mark.skipif(not library.available(), reason="no C++ compiler here")

IEEE, FLUSH = 0x1F80, 0x9FC0  # round to nearest, exceptions masked; the second with FTZ + DAZ
TINY_BITS = 0x000AE398  # ~1e-39, a denormal float32: a kernel under FTZ/DAZ reads it as 0


def tiny(*shape: int) -> torch.Tensor:
    """Denormals made from their bits (a conversion in a thread with FTZ on would give 0)."""
    return torch.full(shape, TINY_BITS, dtype=torch.int32).view(torch.float32)


def in_thread_with_mode(csr: int, fn: Callable[[], object]) -> tuple[torch.Tensor, ...]:
    """fn()'s tensors, run in a new thread whose MXCSR is csr (the mode is per thread)."""
    lib, out = library.load(), {}

    def body() -> None:
        lib.llmserve_set_mxcsr(csr)
        assert lib.llmserve_get_mxcsr() & 0xFFC0 == csr & 0xFFC0  # the sticky flags aside
        r = fn()  # copied: a kernel may hand back a buffer it reuses on the next call
        out["r"] = tuple(x.clone() for x in (r if isinstance(r, tuple) else (r,)))

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out["r"]


@pytest.fixture(autouse=True)
def one_thread():
    """The kernels run in the calling thread alone (with more, OpenMP's workers, whose mode is
    their own, would take the rows; each sets the same mode as the caller, see simd.h)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Compared as integers: a float comparison in a thread with DAZ on reads a denormal as 0."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def same_in_both_modes(fn: Callable[[], object]) -> tuple[torch.Tensor, ...]:
    a, b = in_thread_with_mode(IEEE, fn), in_thread_with_mode(FLUSH, fn)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(bits(x), bits(y)), "the result depends on the calling thread's MXCSR"
    return a


@needs_kernel
def test_attention_ignores_the_thread_mode():
    """Denormals in V: the weighted sums are (near) those denormals, whose rounding is
    the mode's. Before the fix, the IEEE thread kept them and the flushing one returned 0."""
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(8, 16, 3, 64, generator=g)
    vc = tiny(8, 16, 3, 64)
    vc[0, 0] = 1.0  # one ordinary value: normal outputs beside the denormal ones
    q = torch.randn(3, 9, 64, generator=g)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    seq_lens = torch.tensor([40, 64], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 3], dtype=torch.int32)
    (out,) = same_in_both_modes(
        lambda: cpu_ops.paged_attention(q, kc, vc, table, seq_lens, qsl, 0.125)
    )
    assert (bits(out[1:]) == 0).any(), "no denormal flushed: the case does not test the mode"


@needs_kernel
def test_norm_and_activation_ignore_the_thread_mode():
    x = tiny(4, 64)
    x[:, 0] = torch.tensor([1.0, 2.0, 3.0, 4.0])  # rms 0.25-1: tiny / rms stays denormal
    w = torch.ones(64)
    total, normed = same_in_both_modes(lambda: elementwise.add_rms_norm(x, x, w, 1e-6))
    assert (bits(normed[:, 1:]) == 0).all() and (bits(total[:, 1:]) == 0).all()
    gate_up = tiny(4, 128)
    gate_up[:, 64:] = 1.0
    (act,) = same_in_both_modes(lambda: elementwise.silu_mul(gate_up))
    assert (bits(act) == 0).all()  # silu(tiny) * 1, flushed


@needs_kernel
def test_loading_leaves_no_flush_mode_behind():
    """In a fresh process: after the load, the loading thread's FTZ/DAZ bits are those of a
    thread started before it (the library's fast-math constructor set them)."""
    code = (
        "import threading\n"
        "ev, seen = threading.Event(), {}\n"
        "def early():\n"
        "    ev.wait(); seen['early'] = lib.llmserve_get_mxcsr()\n"
        "t = threading.Thread(target=early); t.start()\n"
        "from executor_svc.kernels import library\n"
        "lib = library.load(); ev.set(); t.join()\n"
        "print(lib.llmserve_get_mxcsr() & library.FTZ_DAZ, seen['early'] & library.FTZ_DAZ)\n"
    )
    out = (
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
        )
        .stdout.splitlines()[-1]
        .split()
    )  # after the library's log line
    assert out == ["0", "0"], out
