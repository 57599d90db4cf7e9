"""The CPU attention backend: a compiled paged-attention kernel, one call per layer.

``csrc/paged_attention.cpp`` reads K/V in place through the block table for the whole batch
(decodes and prefill chunks together, GQA, any head_dim), where the torch backend gathers each
sequence's context into a padded copy per layer. It has no torch headers: the system C++
compiler builds it into a small shared library at first use (about a second), cached under
``$LLMSERVE_KERNEL_DIR`` (default ``~/.cache/llmserve/kernels``) by a hash of the source, the
flags, the compiler and the CPU's features; it is called through ctypes.

Without a compiler, ``$LLMSERVE_KERNEL_LIB`` may name a library built ahead of time for
x86-64-v3 (AVX2 + FMA; the Docker image carries one): it is used when this CPU has those
features. No library at all, a failed build, or ``LLMSERVE_CPU_KERNEL=0``: ``available()`` is False and
``get_attention_backend("auto", "cpu")`` takes the torch backend. Anything the kernel does not
cover (a dtype other than fp32) goes to the torch ops, which stay the reference in tests.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch

from executor_svc.attention import torch_ops

if TYPE_CHECKING:
    from executor_svc.attention import AttentionMetadata

log = structlog.get_logger(__name__)

# The library: every csrc/*.cpp (paged attention, the sampler's row reductions, elementwise
# ops) in one .so; the cache key covers the headers they include too.
CSRC = Path(__file__).with_name("csrc")
SOURCES = sorted(CSRC.glob("*.cpp"))
# fast-math: the kernels keep every value finite (a running max starts at -1e30, not -inf), which
# fast-math assumes. But not reassociation: the order of every sum is written out in the source
# (vector lanes, then a fixed tree), the same for every row whatever the step looks like, and the
# compiler must not regroup it differently in different inlined copies (step invariance, see
# executor_svc/numerics.py).
FLAGS = [
    "-O3", "-ffast-math", "-fno-associative-math", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
]  # fmt: skip
# A library built ahead of time (no compiler where it runs) targets this level, and is only
# loaded on a CPU with these features.
PORTABLE_MARCH = "-march=x86-64-v3"
PORTABLE_FEATURES = ("avx2", "fma", "bmi2", "f16c")
_lib: ctypes.CDLL | None = None
_tried = False


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def _cache_dir() -> Path:
    env = os.environ.get("LLMSERVE_KERNEL_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "llmserve" / "kernels"


def _prebuilt() -> Path | None:
    """$LLMSERVE_KERNEL_LIB, when it exists and this CPU can run it."""
    path = os.environ.get("LLMSERVE_KERNEL_LIB")
    if not path or not Path(path).is_file():
        return None
    flags = set(_cpu_features().split())
    missing = [f for f in PORTABLE_FEATURES if f not in flags]
    if missing:
        log.info("cpu_kernel.prebuilt_unsupported", missing=missing)
        return None
    return Path(path)


def _build() -> Path | None:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx or not shutil.which(cxx):
        prebuilt = _prebuilt()
        if prebuilt is not None:
            return prebuilt
        log.info("cpu_kernel.no_compiler", hint="the torch attention backend is used instead")
        return None
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    source = b"".join(p.name.encode() + p.read_bytes() for p in sorted(CSRC.glob("*.[ch]*")))
    for flags in ([*FLAGS, "-march=native"], FLAGS):  # -march=native may be refused
        key = hashlib.sha256(
            source + " ".join(flags).encode() + version.stdout.encode() + _cpu_features().encode()
        ).hexdigest()[:16]
        target = _cache_dir() / f"paged_attention-{key}.so"
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        # Built under a temporary name and renamed: concurrent executors never load half a file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        result = subprocess.run(
            [cxx, *flags, *map(str, SOURCES), "-o", tmp],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode == 0:
            os.replace(tmp, target)
            return target
        os.unlink(tmp)
        log.warning("cpu_kernel.build_failed", flags=" ".join(flags), stderr=result.stderr[-2000:])
    return None


def load() -> ctypes.CDLL | None:
    """The kernel library, built on first use; None when it cannot be had (see module doc)."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("LLMSERVE_CPU_KERNEL", "1") == "0":
        return None
    try:
        path = _build()
        if path is None:
            return None
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as err:
        log.warning("cpu_kernel.unavailable", error=str(err))
        return None
    fn = lib.llmserve_paged_attention_f32
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn.argtypes = [p, i64, i64, p, p, p, i64, p, p, i32, i32, i32, i32, i32, ctypes.c_float, p, i32,
                   p, i64, p, i64, p, i32, p, p]  # fmt: skip
    fn.restype = ctypes.c_int
    red = lib.llmserve_argmax_logsumexp_f32
    red.argtypes = [p, i64, i64, i64, p, p, i32]
    red.restype = ctypes.c_int
    act = lib.llmserve_silu_mul_f32
    act.argtypes = [p, i64, i64, i64, p, i32]
    act.restype = ctypes.c_int
    norm = lib.llmserve_add_rms_norm_f32
    norm.argtypes = [p, i64, p, i64, p, i64, i64, ctypes.c_float, p, p, i32]
    norm.restype = ctypes.c_int
    _lib = lib
    return lib


def available() -> bool:
    return load() is not None


def _supported(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    return (
        query.device.type == "cpu"
        and query.dtype == key_cache.dtype == torch.float32
        and key_cache.is_contiguous()
        and load() is not None
    )


def argmax_logsumexp(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per row of fp32 CPU logits [n, vocab]: (argmax int64, logsumexp fp32) in one kernel call
    (~8x faster than torch's argmax plus logsumexp at 64 x 49 152); None when the library is
    not loaded or x is not an fp32 CPU matrix with unit column stride."""
    if not (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() == 2
        and x.shape[1] > 0
        and x.stride(1) == 1
        and load() is not None
    ):
        return None
    n = x.shape[0]
    ids = torch.empty(n, dtype=torch.int64)
    lse = torch.empty(n, dtype=torch.float32)
    rc = _lib.llmserve_argmax_logsumexp_f32(  # type: ignore[union-attr]
        x.data_ptr(), n, x.shape[1], x.stride(0), ids.data_ptr(), lse.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        return None
    return ids, lse


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for fp32 CPU rows [gate | up] ([n, 2 * i] -> [n, i]) in one pass (torch
    takes three: silu, then the product); None when the library cannot take the input."""
    if not (
        gate_up.device.type == "cpu"
        and gate_up.dtype == torch.float32
        and gate_up.dim() == 2
        and gate_up.shape[1] % 2 == 0
        and gate_up.stride(1) == 1
        and load() is not None
    ):
        return None
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=torch.float32)
    rc = _lib.llmserve_silu_mul_f32(  # type: ignore[union-attr]
        gate_up.data_ptr(), rows, inter, gate_up.stride(0), out.data_ptr(), torch.get_num_threads()
    )
    return out if rc == 0 else None


def _rows_ok(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 2 and t.stride(1) == 1


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """RMSNorm of ``x + delta`` (of ``x`` when delta is None) over fp32 CPU rows [n, dim], in one
    pass: returns (x + delta, normed), the sum being x itself when delta is None; None when the
    library cannot take the inputs (then the caller uses torch)."""
    if not (
        _rows_ok(x)
        and (delta is None or (_rows_ok(delta) and delta.shape == x.shape))
        and weight.dtype == torch.float32
        and weight.is_contiguous()
        and weight.shape == (x.shape[1],)
        and load() is not None
    ):
        return None
    rows, dim = x.shape
    out = torch.empty(rows, dim, dtype=torch.float32)
    total = x if delta is None else torch.empty(rows, dim, dtype=torch.float32)
    rc = _lib.llmserve_add_rms_norm_f32(  # type: ignore[union-attr]
        x.data_ptr(), x.stride(0), None if delta is None else delta.data_ptr(),
        0 if delta is None else delta.stride(0), weight.data_ptr(), rows, dim, eps,
        None if delta is None else total.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return (total, out) if rc == 0 else None


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each token's K/V at its slot (-1 = skip); the torch op, one index_copy_ each."""
    torch_ops.write_kv(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Same contract as ``torch_ops.paged_attention``; one kernel call for the whole batch."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert key_cache.shape[3] == head_dim and value_cache.shape == key_cache.shape
    assert query_start_loc.shape == (seq_lens.shape[0] + 1,)
    assert block_tables.shape[0] == seq_lens.shape[0]
    if not _supported(query, key_cache) or not value_cache.is_contiguous():
        return torch_ops.paged_attention(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale
        )
    if query.stride(2) != 1:
        query = query.contiguous()
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32)
    if num_tokens:
        meta = _Meta(block_tables, seq_lens, query_start_loc, None)
        _run(query, key_cache, value_cache, meta, scale, out)
    return out


class _Meta:
    """The batch metadata as the kernel takes it (int32/int64, contiguous) and its pointers."""

    def __init__(self, block_tables, seq_lens, query_start_loc, slot_mapping) -> None:
        self.tables = block_tables.to(torch.int32).contiguous()
        self.seq_lens = seq_lens.to(torch.int32).contiguous()
        self.qsl = query_start_loc.to(torch.int32).contiguous()
        self.slots = None if slot_mapping is None else slot_mapping.to(torch.int64).contiguous()

    @staticmethod
    def of(md: AttentionMetadata) -> _Meta:
        """Made once per forward, by the first layer; the others reuse it."""
        meta = md.scratch.get("cpu.meta")
        if meta is None:
            meta = md.scratch["cpu.meta"] = _Meta(
                md.block_tables, md.seq_lens, md.query_start_loc, md.slot_mapping
            )
        return meta


def _run(query, key_cache, value_cache, meta: _Meta, scale, out, new=None, rope=None) -> None:
    """The kernel call: ``query`` [T, H, D] rows with head_dim contiguous; ``new`` = (key,
    value) [T, KVH, D] written first at meta.slots; ``rope`` = (cos, sin) rotating q and new k."""
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1:3]
    key, value = new if new is not None else (None, None)
    cos, sin = rope if rope is not None else (None, None)
    rc = _lib.llmserve_paged_attention_f32(  # type: ignore[union-attr]
        query.data_ptr(), query.stride(0), query.stride(1),
        key_cache.data_ptr(), value_cache.data_ptr(),
        meta.tables.data_ptr(), meta.tables.stride(0),
        meta.seq_lens.data_ptr(), meta.qsl.data_ptr(), meta.seq_lens.shape[0],
        num_heads, num_kv_heads, head_dim, block_size, scale,
        out.data_ptr(), torch.get_num_threads(),
        None if key is None else key.data_ptr(), 0 if key is None else key.stride(0),
        None if value is None else value.data_ptr(), 0 if value is None else value.stride(0),
        None if key is None else meta.slots.data_ptr(), 0 if key is None else key.shape[0],
        None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"paged attention kernel rejected its arguments (code {rc})")


def _fused(query, key, value, rope, key_cache, value_cache, md, scale) -> torch.Tensor | None:
    """K/V write (rope on q and k when given) and attention in one kernel call; None when the
    kernel does not take these inputs."""
    d = query.shape[2]
    rows_ok = all(t.stride(2) == 1 and t.stride(1) == d for t in (query, key, value))
    if not (
        rows_ok
        and _supported(query, key_cache)
        and key.dtype == value.dtype == torch.float32
        and value_cache.is_contiguous()
        and (rope is None or all(t.dtype == torch.float32 and t.is_contiguous() for t in rope))
    ):
        return None
    out = torch.empty(query.shape, dtype=torch.float32)
    _run(query, key_cache, value_cache, _Meta.of(md), scale, out, (key, value), rope)
    return out


def attend(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """K/V write and attention of one layer in one kernel call (torch's ops for inputs the
    kernel does not take). Whole prompts go through the kernel too: since its chunked two-pass
    softmax it is ~2.2x faster than torch's fused causal SDPA on one thread
    (``benchmarks/bench_cpu_ops.py``)."""
    out = _fused(query, key, value, None, key_cache, value_cache, md, scale)
    if out is None:
        return torch_ops.attend(query, key, value, key_cache, value_cache, md, scale)
    return out


def attend_rope(
    qk: torch.Tensor,  # [num_tokens, num_heads + num_kv_heads, head_dim]: q then k, unrotated
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim / 2]
    sin: torch.Tensor,
    num_heads: int,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
) -> torch.Tensor | None:
    """Rotary embedding (the model's neox rope), K/V write and attention of one layer in one
    kernel call; None when the kernel does not take these inputs (then the caller rotates and
    calls ``attend``)."""
    key = qk[:, num_heads:]
    return _fused(qk[:, :num_heads], key, value, (cos, sin), key_cache, value_cache, md, scale)
