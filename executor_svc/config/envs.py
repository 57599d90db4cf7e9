"""Every environment variable the executor reads, in one place: the only module of the executor
that touches ``os.environ`` (tests/unit/test_config_env.py checks it).

Each is read when asked, not at import: tests set variables after import. Three of them have a
command-line flag too (``--load-format``, ``--enforce-eager``, ``--[no-]deterministic``); the CLI
puts what the flags say into a ``RuntimeFlags`` (``install``), which wins over the variable, and
rank 0 hands the same object to its tensor-parallel workers (``runtime_flags().to_json()`` on
their command line): nothing writes the environment to pass settings on. The one write left is
``use_loopback_for_gloo``: gloo reads its network interface from ``GLOO_SOCKET_IFNAME`` only.

| variable | default | read by |
| --- | --- | --- |
| ``LLMSERVE_DETERMINISTIC`` | on | ``config.numerics``: step-invariant numerics (``0``/``false``/``no``/``off`` turn them off) |
| ``LLMSERVE_CPU_KERNEL`` | on | ``kernels.library``: ``0`` never loads the compiled CPU kernels |
| ``LLMSERVE_KERNEL_DIR`` | ``$XDG_CACHE_HOME/llmserve/kernels`` or ``~/.cache/llmserve/kernels`` | ``kernels.library``: the build cache |
| ``LLMSERVE_KERNEL_LIB`` | unset | ``kernels.library``: a library built ahead of time, used when there is no compiler |
| ``CXX`` | ``g++``, else ``c++`` on PATH | ``kernels.library``: the compiler |
| ``LLMSERVE_CPU_ISA`` | ``auto`` | ``kernels.library``: force a kernel variant (``avx2``, ``avx512``, ``avx512bf16``, ``amx``) |
| ``LLMSERVE_QUANT_ACT`` | ``fp32`` | ``kernels.quant``: ``int8`` quantizes the activations of the Q8_0 / Q4_0 / Q4_1 matmuls to int8 per group of 32 (integer dot products, ``csrc/quant_act8.cpp``): faster, still step-invariant, but no longer within fp32 rounding of the de-quantized reference (drift: docs/benchmarks.md, "int8 activations") |
| ``LLMSERVE_AUTO_CPU_DTYPE`` | unset | ``kernels.cpu_dtype``: ``float32``/``bfloat16`` fixes what ``--dtype auto`` is on a CPU (the test suite sets ``float32``) |
| ``LLMSERVE_PREPACK`` | on | ``kernels.gemm``: ``0`` keeps plain weight matrices |
| ``LLMSERVE_CPU_FUSED_DECODER`` | on | ``models.cpu_decoder``: ``0`` runs a CPU fp32 model's layers from Python, one kernel call at a time, instead of all in one call (``csrc/decoder.cpp``; the same bits either way) |
| ``LLMSERVE_LOAD_FORMAT`` | ``auto`` | ``runner.loader``: ``dummy`` fills the weights with seeded random values instead of reading a checkpoint (benchmarks of model shapes one has no weights for; vLLM's ``--load-format dummy``) |
| ``LLMSERVE_ENFORCE_EAGER`` | off | ``runner.cuda_graphs``: ``1`` never captures CUDA graphs (vLLM's ``--enforce-eager``) |
| ``LLMSERVE_MAX_GRAPH_BATCH`` | ``256`` | ``runner.cuda_graphs``: the largest decode batch replayed from a CUDA graph |
| ``LLMSERVE_OVERLAP_STEPS`` | ``auto`` | ``api.service``: ``1`` launches a step before the host has the previous step's draws (they stay on the device and become its input ids; ``api/step.py`` ``Flight``), ``0`` never; ``auto``: on for a single-process CUDA executor |
| ``LLMSERVE_CUDA_FUSED`` | on | ``models.llama``: ``0`` runs RMSNorm, SiLU-and-multiply and rope as plain torch ops on CUDA instead of the fused Triton kernels (``kernels.triton_elementwise``) |
| ``LLMSERVE_CUDA_INVARIANT`` | off | ``models.llama``, ``attention.triton_ops``, ``kernels.sampling``: ``1`` (with step-invariant numerics) runs CUDA linears through ``kernels.triton_gemm``, the Triton attention with fixed tiles and no context split, and the sampler's argmax/logsumexp through ``kernels.triton_sampling``: step-invariant on CUDA (the invariance test passed on an H200, fp32), at ~0.6x the default's serving throughput (docs/benchmarks.md, "CUDA") |
| ``LLMSERVE_CACHE`` | ``~/.cache/llmserve`` | ``demo.demo_model``: where the demo checkpoint is built |
| ``LLMSERVE_TP_SHM`` | on | ``parallel.group``: ``0`` keeps CPU tensor-parallel collectives on gloo (no shared memory segment) |
| ``LLMSERVE_REDIS_SENTINEL`` | unset | ``cli``: Sentinels (host:port,...) the registry finds its Redis primary through (``--redis-sentinel``) |
| ``LLMSERVE_REDIS_SENTINEL_MASTER`` | ``mymaster`` | ``cli``: the primary's name at the Sentinels |
| ``LLMSERVE_REDIS_SENTINEL_PASSWORD`` | unset | ``cli``: the Sentinels' own password |
| ``LLMSERVE_TP_PIN`` | on | ``parallel.group``: ``0`` leaves CPU tensor-parallel ranks unpinned (else each gets its share of the allowed cores) |
| ``TRITON_INTERPRET`` | off | ``attention.triton_write_kv``: Triton's own switch (its interpreter); here only whether the Triton wrappers accept CPU tensors |
| ``OTEL_*`` | unset | ``api.tracing``: OpenTelemetry traces of sampled steps (``OTEL_TRACES_EXPORTER``, ``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_SERVICE_NAME``, ``OTEL_SDK_DISABLED``; the exporter reads the rest) |
| ``LLMSERVE_FAILPOINTS`` | unset | ``kv_transfer.endpoint``: tests' failpoints, ``name=delay:S;...`` (only ``executor.export_kv=delay:S``: an export holds its stream for S seconds after its first chunk, a window to kill the exporter mid-stream in) |
| ``XDG_CACHE_HOME`` | ``~/.cache`` | ``kernels.library``: under it ``llmserve/kernels`` when ``LLMSERVE_KERNEL_DIR`` is unset |
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True, slots=True)
class RuntimeFlags:
    """What the executor's command line says over the environment, for this process and the
    tensor-parallel workers it starts; None: the variable (or its default) decides."""

    load_format: str | None = None  # --load-format, over LLMSERVE_LOAD_FORMAT
    enforce_eager: bool | None = None  # --enforce-eager, over LLMSERVE_ENFORCE_EAGER
    deterministic: bool | None = None  # --[no-]deterministic, over LLMSERVE_DETERMINISTIC

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RuntimeFlags:
        return cls(**json.loads(text))


_flags = RuntimeFlags()


def install(flags: RuntimeFlags) -> None:
    """Make ``flags`` this process's (the CLI, once, before loading; a TP worker, with rank 0's)."""
    global _flags
    _flags = flags


def runtime_flags() -> RuntimeFlags:
    return _flags


def overlap_steps() -> bool | None:
    """``LLMSERVE_OVERLAP_STEPS``: True (1/true/yes/on), False (0/false/no/off), or None (unset
    or ``auto``: the executor decides by its device)."""
    value = os.environ.get("LLMSERVE_OVERLAP_STEPS", "auto").strip().lower()
    if value in ("", "auto"):
        return None
    return value not in _FALSE


def deterministic() -> bool:
    """``LLMSERVE_DETERMINISTIC``: step-invariant numerics unless 0/false/no/off."""
    if _flags.deterministic is not None:
        return _flags.deterministic
    return os.environ.get("LLMSERVE_DETERMINISTIC", "1").strip().lower() not in _FALSE


def cpu_kernel_enabled() -> bool:
    """``LLMSERVE_CPU_KERNEL``: ``0`` turns the compiled CPU kernels off."""
    return os.environ.get("LLMSERVE_CPU_KERNEL", "1") != "0"


def kernel_dir() -> Path:
    """``LLMSERVE_KERNEL_DIR``: where built kernel libraries are cached."""
    env = os.environ.get("LLMSERVE_KERNEL_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "llmserve" / "kernels"


def kernel_lib() -> str | None:
    """``LLMSERVE_KERNEL_LIB``: a kernel library built ahead of time (None when unset)."""
    return os.environ.get("LLMSERVE_KERNEL_LIB") or None


def cpu_isa() -> str | None:
    """``LLMSERVE_CPU_ISA``: the kernel library variant to load (``kernels.library.VARIANTS``);
    unset or ``auto``: the best one the CPU runs."""
    return os.environ.get("LLMSERVE_CPU_ISA", "").strip().lower() or None


def quant_act() -> str:
    """``LLMSERVE_QUANT_ACT``: the quantized matmuls' activations, ``fp32`` (the default, exact)
    or ``int8``."""
    value = os.environ.get("LLMSERVE_QUANT_ACT", "").strip().lower() or "fp32"
    if value not in ("fp32", "int8"):
        raise ValueError(f"LLMSERVE_QUANT_ACT={value!r}: expected fp32 or int8")
    return value


def auto_cpu_dtype() -> str | None:
    """``LLMSERVE_AUTO_CPU_DTYPE``: what ``--dtype auto`` means on a CPU (``float32`` or
    ``bfloat16``); unset: by the CPU's instruction sets (``kernels.cpu_dtype``)."""
    return os.environ.get("LLMSERVE_AUTO_CPU_DTYPE", "").strip().lower() or None


def cxx() -> str | None:
    """``CXX``: the C++ compiler to build the kernels with (None: look for g++, c++)."""
    return os.environ.get("CXX") or None


def prepack() -> bool:
    """``LLMSERVE_PREPACK``: ``0`` keeps weights as plain matrices (no packed layout)."""
    return os.environ.get("LLMSERVE_PREPACK", "1") != "0"


def cpu_fused_decoder() -> bool:
    """``LLMSERVE_CPU_FUSED_DECODER``: ``0`` keeps the per-layer Python forward on the CPU."""
    return os.environ.get("LLMSERVE_CPU_FUSED_DECODER", "1").strip().lower() not in _FALSE


def cache_dir() -> Path:
    """``LLMSERVE_CACHE``: the root of llmserve's own cache (the demo checkpoint)."""
    return Path(os.environ.get("LLMSERVE_CACHE") or Path.home() / ".cache/llmserve")


def load_format() -> str:
    """``LLMSERVE_LOAD_FORMAT``: ``auto`` (read the checkpoint) or ``dummy`` (random weights)."""
    if _flags.load_format is not None:
        return _flags.load_format
    return os.environ.get("LLMSERVE_LOAD_FORMAT", "auto").strip().lower() or "auto"


def enforce_eager() -> bool:
    """``LLMSERVE_ENFORCE_EAGER``: on (1/true/yes/on) means no CUDA graphs."""
    if _flags.enforce_eager is not None:
        return _flags.enforce_eager
    return os.environ.get("LLMSERVE_ENFORCE_EAGER", "0").strip().lower() not in (*_FALSE, "")


def max_graph_batch() -> int:
    """``LLMSERVE_MAX_GRAPH_BATCH``: the largest decode batch captured as a CUDA graph."""
    return int(os.environ.get("LLMSERVE_MAX_GRAPH_BATCH", "256"))


def cuda_fused() -> bool:
    """``LLMSERVE_CUDA_FUSED``: ``0`` turns the fused Triton elementwise kernels off."""
    return os.environ.get("LLMSERVE_CUDA_FUSED", "1").strip().lower() not in _FALSE


def cuda_invariant() -> bool:
    """``LLMSERVE_CUDA_INVARIANT``: ``1`` runs the step-invariant CUDA kernels (slower)."""
    return os.environ.get("LLMSERVE_CUDA_INVARIANT", "0").strip().lower() not in (*_FALSE, "")


def tp_shm() -> bool:
    """``LLMSERVE_TP_SHM``: ``0`` keeps CPU tensor-parallel collectives on gloo."""
    return os.environ.get("LLMSERVE_TP_SHM", "1").strip().lower() not in _FALSE


def tp_pin() -> bool:
    """``LLMSERVE_TP_PIN``: ``0`` leaves CPU tensor-parallel ranks unpinned."""
    return os.environ.get("LLMSERVE_TP_PIN", "1").strip().lower() not in _FALSE


def redis_sentinel() -> str | None:
    return os.environ.get("LLMSERVE_REDIS_SENTINEL") or None


def redis_sentinel_master() -> str:
    return os.environ.get("LLMSERVE_REDIS_SENTINEL_MASTER") or "mymaster"


def redis_sentinel_password() -> str | None:
    return os.environ.get("LLMSERVE_REDIS_SENTINEL_PASSWORD") or None


def triton_interpret() -> bool:
    """``TRITON_INTERPRET``: Triton runs its kernels in its interpreter (CPU tensors allowed)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def child_environment(pythonpath_first: str) -> dict[str, str]:
    """The environment for a process this one starts (a tensor-parallel worker): this one's,
    with ``pythonpath_first`` ahead on ``PYTHONPATH`` so it imports this same source tree."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath_first, env.get("PYTHONPATH")]))
    return env


def use_loopback_for_gloo() -> None:
    """Every tensor-parallel rank runs on this host: gloo should talk over loopback whatever the
    hostname resolves to. gloo takes its interface from ``GLOO_SOCKET_IFNAME`` alone, so this
    is the one place the executor writes its environment (an explicit setting is kept); the
    workers inherit it through ``child_environment``."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def tracing_exporter() -> str | None:
    """The OpenTelemetry span exporter the standard variables ask for ("otlp", "console"), or
    None: tracing off (see scheduler_svc/envs.py, the same rule)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    named = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if named:
        return None if named == "none" else named.split(",")[0].strip()
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    return "otlp" if endpoint else None


def failpoint_delay(name: str) -> float:
    """``LLMSERVE_FAILPOINTS``: the seconds of ``name=delay:S`` among its ``;``-separated
    entries (0 when absent); the scheduler's failpoints share the variable and names."""
    for entry in os.environ.get("LLMSERVE_FAILPOINTS", "").split(";"):
        key, _, value = entry.partition("=")
        if key.strip() == name and value.startswith("delay:"):
            return float(value.removeprefix("delay:"))
    return 0.0


def tracing_service_name() -> str:
    """`OTEL_SERVICE_NAME`: the service name on this executor's spans."""
    return os.environ.get("OTEL_SERVICE_NAME") or "llmserve-executor"
