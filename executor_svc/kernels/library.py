"""The one compiled CPU kernel library: every ``csrc/*.cpp`` built into one shared object.

The kernels take raw pointers and sizes and include no torch headers, so the system C++
compiler builds them at first use (a few seconds) into a plain shared library, cached under
``$LLMSERVE_KERNEL_DIR`` (default ``~/.cache/llmserve/kernels``) by a hash of the sources and
headers, the flags, the compiler and the CPU's features; Python calls it through ctypes. Why this
and not ``torch.utils.cpp_extension`` or a build at install time: docs/internals.md, "The
kernels' build".

Without a compiler, ``$LLMSERVE_KERNEL_LIB`` may name a library built ahead of time for
x86-64-v3 (AVX2 + FMA; the Docker image carries one): it is used when this CPU has those
features. No library at all, a failed build, or ``LLMSERVE_CPU_KERNEL=0``: ``load()`` is None and
every caller keeps its torch path (attention backend ``torch``, torch's matmuls and reductions).

A new kernel is a ``csrc/*.cpp`` file exporting ``extern "C"`` functions, a line for each in
``_SIGNATURES``, and a thin wrapper module that checks shapes, dtypes and strides before the call
(``gemm``, ``sampling``, ``elementwise``; attention's is ``attention/cpu_ops.py``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import structlog

from executor_svc.config import envs

log = structlog.get_logger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = sorted(CSRC.glob("*.cpp"))
# fast-math: the kernels keep every value finite (a running max starts at -1e30, not -inf), which
# fast-math assumes. But not reassociation: the order of every sum is written out in the source
# (vector lanes, then a fixed tree), the same for every row whatever the step looks like, and the
# compiler must not regroup it differently in different inlined copies (step invariance, see
# executor_svc/config/numerics.py). The Dockerfile's kernel stage uses these flags too (a test
# keeps them equal).
FLAGS = [
    "-O3", "-ffast-math", "-fno-associative-math", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
]  # fmt: skip
# A library built ahead of time (no compiler where it runs) targets this level, and is only
# loaded on a CPU with these features.
PORTABLE_MARCH = "-march=x86-64-v3"
PORTABLE_FEATURES = ("avx2", "fma", "bmi2", "f16c")

_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_PAGED_ATTENTION_ARGS = [_p, _i64, _i64, _p, _p, _p, _i64, _p, _p, _i32, _i32, _i32, _i32, _i32,
                         _f32, _p, _i32, _p, _i64, _p, _i64, _p, _i32, _p, _p]  # fmt: skip
# Every exported function: (argument types, result type). All return 0 on success.
_SIGNATURES: dict[str, tuple[list, type]] = {
    # csrc/paged_attention.cpp (attention/cpu_ops.py)
    "llmserve_paged_attention_f32": (_PAGED_ATTENTION_ARGS, ctypes.c_int),
    # csrc/sampling.cpp (sampling.py)
    "llmserve_argmax_logsumexp_f32": ([_p, _i64, _i64, _i64, _p, _p, _i32], ctypes.c_int),
    # csrc/elementwise.cpp (elementwise.py)
    "llmserve_silu_mul_f32": ([_p, _i64, _i64, _i64, _p, _i32], ctypes.c_int),
    "llmserve_add_rms_norm_f32": (
        [_p, _i64, _p, _i64, _p, _i64, _i64, _f32, _p, _p, _i32],
        ctypes.c_int,
    ),
}
# Functions a library built ahead of time from older sources may lack; their wrapper checks.
_OPTIONAL_SIGNATURES: dict[str, tuple[list, type]] = {
    # csrc/gemm.cpp (gemm.py): x, M, K, ldx, w, N, ldw, bias, y, ldy, num_threads
    "llmserve_gemm_f32": ([_p, _i64, _i64, _i64, _p, _i64, _i64, _p, _p, _i64, _i32], ctypes.c_int),
    "llmserve_gemm_nr": ([], ctypes.c_int),
    # csrc/shm_collective.cpp (parallel/shm.py): base, rank, world, slot bytes, ...
    "llmserve_shm_size": ([_i32, _i64], _i64),
    "llmserve_shm_register": ([_p, _i32, _i32, _i64], ctypes.c_int),
    "llmserve_shm_all_reduce": (
        [_p, _i32, _i32, _i64, _p, _i64, _i32, ctypes.c_double, _p],
        ctypes.c_int,
    ),
    "llmserve_shm_all_gather": (
        [_p, _i32, _i32, _i64, _p, _i64, _i64, _p, ctypes.c_double, _p],
        ctypes.c_int,
    ),
    "llmserve_shm_broadcast": ([_p, _i32, _i32, _i64, _p, _i64, ctypes.c_double, _p], ctypes.c_int),
}

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


def _prebuilt() -> Path | None:
    """$LLMSERVE_KERNEL_LIB, when it exists and this CPU can run it."""
    path = envs.kernel_lib()
    if not path or not Path(path).is_file():
        return None
    flags = set(_cpu_features().split())
    missing = [f for f in PORTABLE_FEATURES if f not in flags]
    if missing:
        log.info("cpu_kernel.prebuilt_unsupported", missing=missing)
        return None
    return Path(path)


def _build() -> Path | None:
    cxx = envs.cxx() or shutil.which("g++") or shutil.which("c++")
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
        target = envs.kernel_dir() / f"paged_attention-{key}.so"
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


def _bind(lib: ctypes.CDLL) -> None:
    for name, (argtypes, restype) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    for name, (argtypes, restype) in _OPTIONAL_SIGNATURES.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype


def load() -> ctypes.CDLL | None:
    """The kernel library, built on first use; None when it cannot be had (see module doc)."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if not envs.cpu_kernel_enabled():
        return None
    try:
        path = _build()
        if path is None:
            return None
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as err:
        log.warning("cpu_kernel.unavailable", error=str(err))
        return None
    _bind(lib)
    _lib = lib
    return lib


def available() -> bool:
    return load() is not None
