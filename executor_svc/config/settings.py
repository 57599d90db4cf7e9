"""The executor's configuration: one typed object, ``ExecutorConfig``, built once by the CLI from
its flags and the environment (``from_args``) and handed to what needs each part.

Its sections are the groups of ``llmserve-executor --help``: a section's fields are the
``argparse`` destinations of its group's flags, so a flag added to a group must be added here
too (``from_args`` would fail on the first start, and tests/unit/test_executor_cli.py checks
it). The process-wide switches the kernels and the runner read (``config.envs``: variables, and
the ``RuntimeFlags`` the command line sets over them) stay in ``envs``; ``runtime`` gives the
flags' part, which rank 0 hands to its tensor-parallel workers.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from executor_svc.config import envs


@dataclass(frozen=True, slots=True)
class ModelSettings:
    model: str  # a checkpoint directory, a GGUF file, or "demo"
    device: str
    dtype: str
    quantization: str | None
    load_format: str
    attention_backend: str
    speculative_model: str | None
    max_model_len: int | None


@dataclass(frozen=True, slots=True)
class CacheSettings:
    block_size: int
    num_device_blocks: int | None  # None: profile free memory
    gpu_memory_utilization: float
    swap_space: float  # GiB of CPU swap pool


@dataclass(frozen=True, slots=True)
class ComputeSettings:
    tensor_parallel_size: int
    deterministic: bool | None  # None: LLMSERVE_DETERMINISTIC (default on)
    enforce_eager: bool
    cpu_threads: int | None
    cpu_cores: str | None  # Linux cpuset notation, checked by the CLI


@dataclass(frozen=True, slots=True)
class ServerSettings:
    host: str
    port: int
    port_file: Path | None
    advertise_address: str | None
    grace: float
    drain_timeout: float
    role: str  # prefill/decode disaggregation: "both", "prefill" or "decode"
    metrics_port: int | None
    log_level: str


@dataclass(frozen=True, slots=True)
class TLSSettings:
    tls_cert: Path | None
    tls_key: Path | None
    tls_ca: Path | None

    def credentials(self) -> tuple[bytes, bytes, bytes | None] | None:
        """(certificate chain, key, client CA or None) as the server takes them, or None."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        ca = self.tls_ca.read_bytes() if self.tls_ca else None
        return self.tls_cert.read_bytes(), self.tls_key.read_bytes(), ca


@dataclass(frozen=True, slots=True)
class RegistrySettings:
    redis_url: str | None
    redis_sentinel: tuple[tuple[str, int], ...] | None
    redis_sentinel_master: str
    # Never a flag (it would show in a process list): $LLMSERVE_REDIS_SENTINEL_PASSWORD.
    redis_sentinel_password: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.redis_url or self.redis_sentinel)


# Section name -> (its dataclass, the --help group's description). A feature's own section is
# declared in its folder (features/flags.py ``feature_sections``: the CLI hands them to
# ``from_args``) and lands in ``ExecutorConfig.features``.
Sections = dict[str, tuple[type, str]]
SECTIONS: Sections = {
    "model": (ModelSettings, "what to serve and how to load it"),
    "cache": (CacheSettings, "the paged KV cache"),
    "compute": (ComputeSettings, "ranks, threads, cores and numerics"),
    "server": (ServerSettings, "the gRPC server, its lifecycle and metrics"),
    "tls": (TLSSettings, "TLS for schedulers' calls (mutual with --tls-ca)"),
    "registry": (RegistrySettings, "registration in Redis, for --discover-executors"),
}


@dataclass(frozen=True, slots=True)
class ExecutorConfig:
    model: ModelSettings
    cache: CacheSettings
    compute: ComputeSettings
    server: ServerSettings
    tls: TLSSettings
    registry: RegistrySettings
    # The sections features declare (by section name), each read by its own feature.
    features: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, feature_sections: Sections | None = None
    ) -> ExecutorConfig:
        """The configuration the parsed flags and this process's environment give;
        ``feature_sections``: the features' own sections (features/flags.py)."""
        extra: dict[str, dict[str, Any]] = {
            "registry": {"redis_sentinel_password": envs.redis_sentinel_password()}
        }

        def build(name: str, section: type) -> Any:
            given = extra.get(name, {})
            values = {f.name: getattr(args, f.name) for f in fields(section) if f.name not in given}
            return section(**values, **given)

        own = {name: build(name, section) for name, (section, _) in SECTIONS.items()}
        features = {name: build(name, s) for name, (s, _) in (feature_sections or {}).items()}
        return cls(**own, features=features)

    @property
    def runtime(self) -> envs.RuntimeFlags:
        """The flags that win over their variables, in this process and its TP workers."""
        return envs.RuntimeFlags(
            load_format=self.model.load_format,
            enforce_eager=True if self.compute.enforce_eager else None,
            deterministic=self.compute.deterministic,
        )


ENVIRONMENT_HELP = """\
environment (flags win where both exist; the table in executor_svc/config/envs.py):
  LLMSERVE_DETERMINISTIC=0       step-invariant numerics off (--no-deterministic)
  LLMSERVE_LOAD_FORMAT           auto or dummy (--load-format sets it for this executor)
  LLMSERVE_ENFORCE_EAGER=1       no CUDA graphs (--enforce-eager)
  LLMSERVE_MAX_GRAPH_BATCH       largest decode batch replayed from a CUDA graph (256)
  LLMSERVE_OVERLAP_STEPS=0       never launch a step before the last one's draws reach the host
  LLMSERVE_CUDA_FUSED=0          plain torch ops instead of the fused Triton elementwise kernels
  LLMSERVE_CUDA_INVARIANT=1      step-invariant CUDA kernels (~0.6x the speed)
  LLMSERVE_CPU_KERNEL=0          never load the compiled CPU kernels
  LLMSERVE_CPU_ISA               force a CPU kernel variant (avx2, avx512, avx512bf16, amx)
  LLMSERVE_KERNEL_DIR, LLMSERVE_KERNEL_LIB, CXX   where kernels are built / a prebuilt one / the compiler
  LLMSERVE_PREPACK=0             plain weight matrices (no packed layout)
  LLMSERVE_CPU_FUSED_DECODER=0   a CPU model's layers one kernel call at a time
  LLMSERVE_QUANT_ACT=int8        int8 activations in the quantized matmuls
  LLMSERVE_AUTO_CPU_DTYPE        what --dtype auto is on a CPU (float32 or bfloat16)
  LLMSERVE_CACHE                 where the demo checkpoint is built (~/.cache/llmserve)
  LLMSERVE_TP_SHM=0, LLMSERVE_TP_PIN=0   CPU tensor parallelism: gloo only / unpinned ranks
  LLMSERVE_REDIS_SENTINEL, LLMSERVE_REDIS_SENTINEL_MASTER   defaults of --redis-sentinel[-master]
  LLMSERVE_REDIS_SENTINEL_PASSWORD   the Sentinels' own password (no flag)
  LLMSERVE_FAILPOINTS            tests' fault injection (executor.export_kv=delay:S)
  OTEL_TRACES_EXPORTER, OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME, OTEL_SDK_DISABLED
                                 OpenTelemetry spans of sampled steps (off unless configured)
"""
