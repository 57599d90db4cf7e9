"""GetServerInfo's answer: the model, the limits and the load, summed over the executors (the
optional features add their fields: scheduler_svc/features, ``server_info``)."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler_svc.engine.config import EngineConfig, ExecutorInfo, ServerInfo
from scheduler_svc.engine.fleet.executor_handle import ExecutorHandle
from scheduler_svc.engine.model import ModelInfo

__all__ = ["server_info"]


def server_info(
    executors: Sequence[ExecutorHandle], config: EngineConfig, model: ModelInfo
) -> ServerInfo:
    d = executors[0].describe
    cores = [ex.sched for ex in executors]
    stats = [c.get_stats() for c in cores]
    hits = sum(st.prefix_cache_hits for st in stats)
    queries = sum(st.prefix_cache_queries for st in stats)
    total = sum(c.num_device_blocks for c in cores)
    free = sum(c.num_free_blocks for c in cores)
    return ServerInfo(
        model=d.model_name,
        max_model_len=model.max_model_len,
        block_size=d.block_size,
        num_waiting=sum(c.num_waiting for c in cores),
        num_running=sum(c.num_running for c in cores),
        num_swapped=sum(c.num_swapped for c in cores),
        kv_cache_usage=1.0 - free / total if total else 0.0,
        executors=[_executor_info(ex) for ex in executors],
        routing=config.routing,
        max_logprobs=config.max_logprobs,
        vocab_size=model.vocab_size,
        policy=config.policy,
        preemption_mode=config.preemption_mode,
        num_preemptions=sum(c.num_preemptions for c in cores),
        prefix_cache_hit_rate=hits / queries if queries else 0.0,
        hidden_size=d.hidden_size,
    )


def _executor_info(ex: ExecutorHandle) -> ExecutorInfo:
    return ExecutorInfo(
        address=ex.address,
        instance_id=ex.describe.instance_id,
        num_device_blocks=ex.sched.num_device_blocks,
        num_free_blocks=ex.sched.num_free_blocks,
        num_cpu_blocks=ex.describe.num_cpu_blocks,
        healthy=ex.healthy,
        prefix_cache_queries=ex.sched.block_manager.prefix_cache_queries,
        prefix_cache_hits=ex.sched.block_manager.prefix_cache_hits,
        prefix_cache_host_hits=ex.sched.block_manager.prefix_cache_host_hits,
        num_host_cache_blocks=ex.sched.config.num_host_cache_blocks,
        draining=ex.draining,
        dtype=ex.describe.dtype,
        cpu_kernel_isa=ex.describe.cpu_kernel_isa,
        role=ex.role,
        num_prefill_tokens=ex.num_prefill_tokens,
    )
