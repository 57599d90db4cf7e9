"""The one compiled CPU kernel library: every ``csrc/*.cpp`` built into one shared object.

The kernels take raw pointers and sizes and include no torch headers, so the system C++
compiler builds them at first use (a few seconds) into a plain shared library, cached under
``$LLMSERVE_KERNEL_DIR`` (default ``~/.cache/llmserve/kernels``) by a hash of the sources and
headers, the flags, the compiler and the CPU's features; Python calls it through ctypes. Why this
and not ``torch.utils.cpp_extension`` or a build at install time: docs/internals.md, "The
kernels' build".

Kernels per instruction set: the same sources are built in variants (``VARIANTS``: amx,
avx512bf16, avx512, avx2, best first), each its own cached library, and ``load()`` takes the best
one this CPU runs (``cpu_kernel.variant`` in the log, ``variant()`` for GetServerInfo). The amx
variant needs the Linux kernel's leave to use tile registers (``llmserve_amx_init``, asked once
per process); refused, ``load()`` warns (``cpu_kernel.amx_refused``) and takes avx512bf16.
``$LLMSERVE_CPU_ISA`` forces one (tests run the avx2 variant on an AVX-512 machine that way); a
variant the CPU lacks is refused with a warning and the best one is used.

Without a compiler, ``$LLMSERVE_KERNEL_LIB`` may name a library built ahead of time for
x86-64-v3 (AVX2 + FMA), used as the avx2 variant when this CPU has those features, or a folder
holding ``<variant>.so`` files (the best one this CPU runs is loaded). No library at all, a
failed build, or ``LLMSERVE_CPU_KERNEL=0``: ``load()`` is None and every caller keeps its torch
path (attention backend ``torch``, torch's matmuls and reductions).

A new kernel is a ``csrc/*.cpp`` file exporting ``extern "C"`` functions, a line for each in
``_SIGNATURES``, and a thin wrapper module that checks shapes, dtypes and strides before the call
(``gemm``, ``gemm_bf16``, ``sampling``, ``elementwise``; attention's is ``attention/cpu_ops.py``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
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
_AVX512 = (*PORTABLE_FEATURES, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
_AVX512BF16 = (*_AVX512, "avx512_bf16", "avx512_vnni")
# name -> (compiler flags, /proc/cpuinfo flags it needs), best first. amx: the bf16 GEMM on AMX
# tiles (TDPBF16PS, csrc/gemm_bf16_amx.h), every row count; every other kernel as in avx512bf16.
VARIANTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "amx": (
        ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16"),
        (*_AVX512BF16, "amx_tile", "amx_bf16"),
    ),
    "avx512bf16": (
        ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
        _AVX512BF16,
    ),
    "avx512": (("-march=x86-64-v4",), _AVX512),
    "avx2": ((PORTABLE_MARCH,), PORTABLE_FEATURES),
}

# MXCSR's flush-to-zero (bit 15) and denormals-are-zero (bit 6).
FTZ_DAZ = 0x8040
_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_PAGED_ATTENTION_ARGS = [_p, _i64, _i64, _p, _p, _p, _i64, _p, _p, _i32, _i32, _i32, _i32, _i32,
                         _f32, _p, _i32, _p, _i64, _p, _i64, _p, _i32, _p, _p]  # fmt: skip
# Every exported function: (argument types, result type). All return 0 on success.
_SIGNATURES: dict[str, tuple[list, type]] = {
    # csrc/elementwise.cpp: the calling thread's MXCSR (load() and the tests)
    "llmserve_get_mxcsr": ([], ctypes.c_uint),
    "llmserve_set_mxcsr": ([ctypes.c_uint], ctypes.c_int),
    # csrc/paged_attention.cpp (attention/cpu_ops.py)
    "llmserve_paged_attention_f32": (_PAGED_ATTENTION_ARGS, ctypes.c_int),
    # csrc/paged_attention_bf16kv.cpp: the same arguments, the caches bf16
    "llmserve_paged_attention_bf16kv": (_PAGED_ATTENTION_ARGS, ctypes.c_int),
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
    # csrc/gemm_bf16.cpp (gemm_bf16.py): x, M, K, ldx, w, N, bias, y_f32, y_bf16, ldy, threads
    "llmserve_gemm_bf16": ([_p, _i64, _i64, _i64, _p, _i64, _p, _p, _p, _i64, _i32], ctypes.c_int),
    "llmserve_gemm_bf16_nr": ([], ctypes.c_int),
    "llmserve_gemm_bf16_path": ([], ctypes.c_char_p),
    "llmserve_gemm_bf16_k2_align": ([], ctypes.c_int),
    # 0, or the errno of the kernel's refusal of AMX tile state (-1: not an amx build)
    "llmserve_amx_init": ([], ctypes.c_int),
    # what (0: rows from which tiles are taken, 1: prefetch distance), value (< 0: query)
    "llmserve_gemm_bf16_amx_set": ([_i32, _i64], _i64),
    # csrc/elementwise_bf16.cpp (elementwise.py), the fp32 functions' arguments on bf16 rows
    "llmserve_silu_mul_bf16": ([_p, _i64, _i64, _i64, _p, _i32], ctypes.c_int),
    "llmserve_add_rms_norm_bf16": (
        [_p, _i64, _p, _i64, _p, _i64, _i64, _f32, _p, _p, _i32],
        ctypes.c_int,
    ),
    # csrc/elementwise.cpp (elementwise.py): src, rows, cols, ld, elem_bytes, ids, n, out,
    # num_threads
    "llmserve_gather_cols": ([_p, _i64, _i64, _i64, _i32, _p, _i64, _p, _i32], ctypes.c_int),
    # csrc/lowrank_rows.cpp (y[rows] += (x[rows] @ A) @ B per column shard; its wrapper lives
    # with the feature that applies it): x, ldx, k, rows, num_rows, a, ra, r, num_shards,
    # shard_start, shard_size, b_ptrs, y, ldy, num_threads
    "llmserve_lowrank_rows_f32": (
        [_p, _i64, _i64, _p, _i64, _p, _i64, _i64, _i64, _p, _p, _p, _p, _i64, _i32],
        ctypes.c_int,
    ),
    # csrc/quant_gemm.cpp (quant.py): type, x, M, K, ldx, w, N, row_bytes, bias, y, ldy, threads
    "llmserve_quant_gemm_f32": (
        [_i32, _p, _i64, _i64, _i64, _p, _i64, _i64, _p, _p, _i64, _i32],
        ctypes.c_int,
    ),
    # type, w, N, K, row_bytes, rows, num, out, ldo
    "llmserve_quant_dequant_f32": (
        [_i32, _p, _i64, _i64, _i64, _p, _i64, _p, _i64],
        ctypes.c_int,
    ),
    # csrc/quant_split.cpp (quant.py): Q8_0 / Q4_0 / Q4_1 in the split layout; the gemm's and
    # the dequant's arguments as above (the gemm's type or'ed with quant.ACT_INT8: int8
    # activations, csrc/quant_act8.cpp); relayout: type, src, N, K, row_bytes, dst, to_split
    "llmserve_quant_gemm_split_f32": (
        [_i32, _p, _i64, _i64, _i64, _p, _i64, _i64, _p, _p, _i64, _i32],
        ctypes.c_int,
    ),
    "llmserve_quant_dequant_split_f32": (
        [_i32, _p, _i64, _i64, _i64, _p, _i64, _p, _i64],
        ctypes.c_int,
    ),
    "llmserve_quant_relayout": ([_i32, _p, _i64, _i64, _i64, _p, _i32], ctypes.c_int),
    # csrc/shm_collective.cpp (parallel/shm.py): base, rank, world, slot bytes, ...
    # csrc/decoder.cpp (models/cpu_decoder.py): model, layers, x, T, cos, sin, block tables,
    # their stride, seq_lens, query_start_loc, num_seqs, slots, out, num_threads
    "llmserve_decoder_f32": (
        [_p, _p, _p, _i64, _p, _p, _p, _i64, _p, _p, _i32, _p, _p, _i32],
        ctypes.c_int,
    ),
    # csrc/decoder_bf16.cpp: the same arguments, x / cos / sin / out bf16
    "llmserve_decoder_bf16": (
        [_p, _p, _p, _i64, _p, _p, _p, _i64, _p, _p, _i32, _p, _p, _i32],
        ctypes.c_int,
    ),
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
_variant = ""  # the loaded library's variant ("" while none is loaded)
_tried = False


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def supported_variants() -> list[str]:
    """The variants this CPU can run, best first."""
    flags = set(_cpu_features().split())
    return [name for name, (_, need) in VARIANTS.items() if set(need) <= flags]


def _pick() -> tuple[str | None, bool]:
    """(the variant to load, whether ``$LLMSERVE_CPU_ISA`` forced it); None: the CPU runs none."""
    runnable = supported_variants()
    forced = envs.cpu_isa()
    if forced and forced != "auto":
        if forced in runnable:
            return forced, True
        log.warning(
            "cpu_kernel.variant_refused",
            requested=forced,
            runnable=runnable,
            hint=f"known variants: {', '.join(VARIANTS)}",
        )
    return (runnable[0] if runnable else None), False


def _prebuilt(name: str) -> Path | None:
    """$LLMSERVE_KERNEL_LIB's library for this variant, when there is one."""
    path = envs.kernel_lib()
    if not path:
        return None
    if Path(path).is_dir():
        candidate = Path(path) / f"{name}.so"
        return candidate if candidate.is_file() else None
    # A single file is the x86-64-v3 build.
    return Path(path) if name == "avx2" and Path(path).is_file() else None


def _build(name: str) -> tuple[Path | None, str]:
    """(the library's path, its variant): ``name`` built here, or without a compiler the best
    prebuilt variant not above it."""
    cxx = envs.cxx() or shutil.which("g++") or shutil.which("c++")
    if not cxx or not shutil.which(cxx):
        runnable = supported_variants()
        for candidate in runnable[runnable.index(name) :]:
            prebuilt = _prebuilt(candidate)
            if prebuilt is not None:
                return prebuilt, candidate
        log.info("cpu_kernel.no_compiler", hint="the torch attention backend is used instead")
        return None, name
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None, name
    source = b"".join(p.name.encode() + p.read_bytes() for p in sorted(CSRC.glob("*.[ch]*")))
    flags = [*FLAGS, *VARIANTS[name][0]]
    key = hashlib.sha256(source + " ".join(flags).encode() + version.stdout.encode()).hexdigest()
    target = envs.kernel_dir() / f"kernels-{name}-{key[:16]}.so"
    if target.exists():
        return target, name
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: concurrent executors never load half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    error = _compile_and_link(cxx, flags, tmp)
    if error is None:
        os.replace(tmp, target)
        return target, name
    os.unlink(tmp)
    log.warning("cpu_kernel.build_failed", flags=" ".join(flags), stderr=error[-2000:])
    return None, name


def _compile_and_link(cxx: str, flags: list[str], out: str) -> str | None:
    """Every source compiled to its own object file, as many at once as this process has cores
    (the build is ~30 s of one core per variant), then linked into ``out``; None, or the
    compiler's messages when a step failed. The same objects as one ``g++ *.cpp`` call: each
    source is its own translation unit either way."""
    compile_flags = [f for f in flags if f != "-shared"]
    with tempfile.TemporaryDirectory(prefix="llmserve-kernels-") as objdir:
        objects = [str(Path(objdir) / f"{src.stem}.o") for src in SOURCES]

        def compile_one(src: Path, obj: str) -> subprocess.CompletedProcess:
            command = [cxx, *compile_flags, "-c", str(src), "-o", obj]
            return subprocess.run(command, capture_output=True, text=True, timeout=300)

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        workers = max(1, min(len(SOURCES), cores or 1))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(compile_one, SOURCES, objects))
        failed = [r.stderr for r in results if r.returncode != 0]
        if failed:
            return "\n".join(failed)
        link = subprocess.run(
            [cxx, *flags, *objects, "-o", out], capture_output=True, text=True, timeout=300
        )
        return None if link.returncode == 0 else link.stderr


def _bind(lib: ctypes.CDLL) -> None:
    for name, (argtypes, restype) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    for name, (argtypes, restype) in _OPTIONAL_SIGNATURES.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype


def _open(name: str) -> tuple[ctypes.CDLL | None, str]:
    """(the library of variant ``name``, built if need be, bound; its variant), or (None, name)."""
    try:
        path, name = _build(name)
        if path is None:
            return None, name
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as err:
        log.warning("cpu_kernel.unavailable", error=str(err))
        return None, name
    _bind(lib)
    return lib, name


def load() -> ctypes.CDLL | None:
    """The kernel library of this CPU's variant, built on first use; None when it cannot be had
    (see module doc)."""
    global _lib, _tried, _variant
    if _tried:
        return _lib
    _tried = True
    if not envs.cpu_kernel_enabled():
        return None
    name, forced = _pick()
    if name is None:
        log.info("cpu_kernel.no_variant", hint="this CPU lacks AVX2/FMA: torch paths are used")
        return None
    lib, name = _open(name)
    if lib is not None and name == "amx":
        rc = lib.llmserve_amx_init() if hasattr(lib, "llmserve_amx_init") else -1
        if rc != 0:
            log.warning(
                "cpu_kernel.amx_refused",
                error=os.strerror(rc) if rc > 0 else "no llmserve_amx_init",
                hint="the kernel would not give this process AMX tile state "
                "(arch_prctl ARCH_REQ_XCOMP_PERM): the avx512bf16 variant is used",
            )
            lib, name = _open("avx512bf16")
    if lib is None:
        return None
    # The -ffast-math build's constructor turned FTZ/DAZ on in this thread only: off again, so
    # torch's ops round denormals alike in every thread (the kernels set their own mode).
    lib.llmserve_set_mxcsr(lib.llmserve_get_mxcsr() & ~FTZ_DAZ)
    _lib, _variant = lib, name
    log.info("cpu_kernel.variant", variant=name, forced=forced, runnable=supported_variants())
    return lib


def variant() -> str:
    """The loaded library's instruction-set variant (``VARIANTS``), "" when none is loaded."""
    load()
    return _variant


def reset() -> None:
    """Forget the loaded library, so that the next ``load()`` picks again (tests switch variants
    with ``$LLMSERVE_CPU_ISA``); the wrappers hold no library of their own."""
    global _lib, _tried, _variant
    _lib, _tried, _variant = None, False, ""


def available() -> bool:
    return load() is not None
