"""Configuration of one executor's scheduler core."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.core.lookahead import LookaheadFactory
from scheduler_svc.core.request import Request, Sequence
from scheduler_svc.core.step_budget import StepLimitFactory


@dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget per step (prefill chunks + decodes)
    max_num_seqs: int = 256  # cap on running sequences
    block_size: int = 16
    num_device_blocks: int = 1024
    num_cpu_blocks: int = 0  # swap pool; 0 makes swap preemption fall back to recompute
    # Of the CPU blocks, those given to the host prefix tier (core/host_tier.py); swap keeps the
    # rest. 0: no tier.
    num_host_cache_blocks: int = 0
    max_model_len: int = 2048
    policy: str = "fcfs"  # "fcfs" | "priority" (larger priority first, then arrival)
    preemption_mode: str = "recompute"  # "recompute" | "swap"
    enable_prefix_caching: bool = True
    watermark: float = 0.01  # fraction of device blocks kept free from admissions
    max_waiting: int = 1024  # add_request raises QueueFull beyond this many waiting requests
    long_prefill_token_threshold: int | None = None  # max prefill tokens per sequence per step
    # A feature's decodes with lookahead positions (core/lookahead.py), built once per core;
    # None: every decode computes one position.
    lookahead: LookaheadFactory | None = None
    # A feature's admission constraint per step (core/step_budget.py), built once per core;
    # None: none (features/base.py, `scheduling`, sets it from the executor's Describe).
    step_limit: StepLimitFactory | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_device_blocks < 1 or self.num_cpu_blocks < 0:
            raise ValueError("num_device_blocks must be >= 1 and num_cpu_blocks >= 0")
        if not 0 <= self.num_host_cache_blocks <= self.num_cpu_blocks:
            raise ValueError("num_host_cache_blocks must be in [0, num_cpu_blocks]")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Otherwise the decodes of a full batch could not all run in one step.
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}"
            )
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 1:
            raise ValueError("long_prefill_token_threshold must be None or >= 1")

    def never_fits_reason(self, req: Request, live: list[Sequence]) -> str | None:
        """Why req can never run within these limits (None if it can), for FINISHED_ERROR.

        Counts what the first token of every live sequence plus one more slot needs in an
        otherwise empty cache; the scheduler also ends a request that fails to fit once
        nothing else holds a block, so this is the early, common-case check.
        """
        cfg = self
        if not live:
            return None
        n = req.num_seqs_when_running
        if n > cfg.max_num_seqs:
            return f"n={n} sequences exceed max_num_seqs={cfg.max_num_seqs}"
        longest = max(len(s.token_ids) for s in live)
        if longest + 1 > cfg.max_model_len:
            return (
                f"{longest} tokens + 1 to generate exceed the maximum model length "
                f"{cfg.max_model_len}"
            )
        bs = cfg.block_size
        p = req.num_prompt_tokens
        if not req.forked:
            # The prompt but its last token is shared; every sequence owns the rest.
            shared = (p - 1) // bs
            need = shared + n * (-(-(p + 1) // bs) - shared)
        else:
            # Lower bound: full prompt blocks shared through the prefix cache.
            shared = p // bs if cfg.enable_prefix_caching else 0
            need = shared + sum(-(-(len(s.token_ids) + 1) // bs) - shared for s in live)
        if need > cfg.num_device_blocks:
            return (
                f"needs {need} KV cache blocks of {bs} tokens (prompt of {p} tokens + 1, n={n}) "
                f"but the executor has {cfg.num_device_blocks}"
            )
        return None
