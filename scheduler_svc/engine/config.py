"""What the engine is configured with, and the records it exchanges with the API layer: what a
Generate call hands it, and what GetServerInfo reports."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.state.connect import RedisTarget

__all__ = [
    "MAX_REQUEST_ID_LEN",
    "AbortOutcome",
    "EngineConfig",
    "ExecutorInfo",
    "GenerateInput",
    "ServerInfo",
    "owner_of",
    "public_id",
    "scoped_id",
]

MAX_REQUEST_ID_LEN = 256
# Between an owner and the id its client chose. Not printable, so no public id contains it.
OWNER_SEP = "\x1f"


def scoped_id(owner: str, public_id: str) -> str:
    """The engine's (and Redis's) id of `public_id` created under key `owner` ("" = no keys):
    the same client-chosen id under two keys is two requests, and one key cannot name
    another's."""
    return f"{owner}{OWNER_SEP}{public_id}" if owner else public_id


def owner_of(req_id: str) -> str:
    """The key name a request belongs to ("" without keys)."""
    owner, sep, _ = req_id.rpartition(OWNER_SEP)
    return owner if sep else ""


def public_id(req_id: str) -> str:
    """The id the client chose (or was given), without its owner."""
    return req_id.rpartition(OWNER_SEP)[2]


@dataclass(slots=True)
class EngineConfig:
    executor_addresses: list[str]
    # The Redis holding request state; with redis_sentinels only its credentials, db and TLS
    # count, and the primary is whichever the Sentinels name (state/connect.py).
    redis_url: str
    redis_sentinels: tuple[tuple[str, int], ...] = ()
    redis_sentinel_master: str = "mymaster"
    redis_sentinel_password: str | None = None
    # Replicas that must hold a step's writes before its tokens, finishes and aborts, or a new
    # leader's epoch, are released (WAIT, state/persister.py); 0: no wait. Fewer in time: held,
    # or released anyway with redis_degrade_unreplicated.
    redis_min_replicas: int = 0
    redis_replica_timeout_ms: int = 500
    redis_degrade_unreplicated: bool = False
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_waiting: int = 4096
    # Per API key (only with keys on): unfinished requests, and prompt tokens of its requests
    # not yet started; None = no limit. Past them: RESOURCE_EXHAUSTED.
    max_requests_per_key: int | None = None
    max_queued_tokens_per_key: int | None = None
    policy: str = "fcfs"
    preemption_mode: str = "recompute"
    enable_prefix_caching: bool = True
    watermark: float = 0.01
    max_logprobs: int = 20
    finished_ttl_s: float = 3600.0
    # How long an abort of an id not known yet waits in Redis for its Generate (engine/aborts.py).
    abort_ahead_ttl_s: float = 60.0
    # Deadline of every request that gives none shorter, in seconds from arrival; None = off
    # (features/deadlines).
    request_timeout_s: float | None = None
    max_backlog_steps: int = 1024
    step_timeout_s: float = 120.0
    # Plan and send the next decode step while the executor runs the current one (see
    # core/ahead.py): the executor never waits for the scheduler between decode steps.
    async_scheduling: bool = True
    # An executor unreachable this long hands its requests to the live ones (recomputed there).
    executor_failover_s: float = 10.0
    # A draining executor's running requests move with their KV cache to executors taking new
    # work (engine/faults/migration.py) instead of finishing there or being recomputed.
    migrate_on_drain: bool = True
    # How the moved KV travels: "auto" (shared memory between executors with loopback
    # addresses, else "push" when both executors take PushKV, else "grpc"), "grpc" (relayed
    # through the scheduler), "shm" (one host only) or "push" (source to destination directly).
    migrate_transport: str = "auto"
    # Payload bytes per gRPC chunk of moved KV (ExportKVRequest.chunk_bytes); 0: the executor's
    # default (2 MiB).
    migrate_chunk_bytes: int = 0
    # The longest one batch of moved KV may take (ExportKV and ImportKV); past it, recompute.
    migrate_timeout_s: float = 30.0
    # Also serve executors that register themselves in Redis (llmserve-executor --redis-url),
    # checked every discovery_interval_s; with no executor_addresses, wait for the first one.
    discover_executors: bool = False
    # Where new requests go: "kv" (prefix-cache aware), "least-loaded" or "round-robin".
    routing: str = "kv"
    routing_prefill_weight: float = 1.0
    discovery_interval_s: float = 2.0
    # How often health probes Redis (a write) and idle executors (Describe).
    health_interval_s: float = 0.5
    # Caps below what the executor reports (tests use them to force preemption).
    num_device_blocks: int | None = None
    num_cpu_blocks: int | None = None
    max_model_len: int | None = None
    # Of each executor's CPU blocks, those kept for the host-memory prefix tier
    # (core/host_tier.py; capped at what it has); swap keeps the rest. 0: no tier.
    host_cache_blocks: int = 0
    # TLS to the executors: (CA that signed their certificates, our client certificate chain,
    # its key), PEM; None = plaintext. With a certificate, executors that require client
    # certificates (mutual TLS) let us in.
    executor_tls: tuple[bytes, bytes | None, bytes | None] | None = None
    # The name executors' certificates are checked against instead of the dialled host.
    executor_tls_server_name: str | None = None
    # Several schedulers on one Redis: serve only while holding the leader lease, stand by
    # otherwise (scheduler_svc/state/leader.py); the lease expires lease_ttl_s after the last
    # renewal.
    leader_election: bool = False
    lease_ttl_s: float = 2.0
    # The optional features' sections, by feature name: each declared in its folder's flags.py
    # and filled from its flags (features/flags.py); a feature whose section is absent takes
    # its defaults.
    features: dict[str, Any] = field(default_factory=dict)

    @property
    def redis_target(self) -> RedisTarget:
        return RedisTarget(
            url=self.redis_url,
            sentinels=self.redis_sentinels,
            master=self.redis_sentinel_master,
            sentinel_password=self.redis_sentinel_password,
        )


class AbortOutcome(enum.Enum):
    """What an Abort did (AbortResponse's `aborted` and `pending`)."""

    ABORTED = "aborted"  # it was active and has ended as aborted
    NOT_ACTIVE = "not_active"  # it had finished already (or was ended by an earlier abort)
    PENDING = "pending"  # no request had this id: one created soon with it ends aborted


@dataclass(slots=True)
class GenerateInput:
    """A Generate call converted from protobuf; exactly one of the prompt fields is set."""

    req_id: str
    params: SamplingParams
    text: str | None = None
    token_ids: list[int] | None = None
    chat: list[dict[str, str]] | None = None
    infill: tuple[str, str] | None = None  # (prefix, suffix): fill in the middle
    add_generation_prompt: bool = True
    priority: int = 0
    owner: str = ""  # the API key's name when keys are on: ids are scoped to it (scoped_id)
    # The features' fields of the call, by feature name (each feature's from_request hook).
    features: dict[str, Any] = field(default_factory=dict)
    # Seconds from arrival it may take: its own timeout and its call's remaining gRPC deadline
    # (each checked, None = not given); the engine applies the earliest (features/deadlines).
    timeouts: tuple[float | None, ...] = ()
    trace_parent: str = ""  # the caller's W3C traceparent (scheduler_svc/tracing.py); "" none


@dataclass(slots=True)
class ExecutorInfo:
    """One executor as GetServerInfo reports it."""

    address: str
    instance_id: str
    num_device_blocks: int  # what this scheduler uses (at most what the executor reported)
    num_free_blocks: int
    num_cpu_blocks: int
    healthy: bool
    prefix_cache_queries: int = 0  # prompt tokens looked up in its prefix cache
    prefix_cache_hits: int = 0  # of which found there
    draining: bool = False
    prefix_cache_host_hits: int = 0  # of the hits, those found in its host tier
    num_host_cache_blocks: int = 0  # its host prefix tier's CPU blocks (core/host_tier.py)
    dtype: str = ""  # its weights' and KV cache's dtype, as it described itself
    cpu_kernel_isa: str = ""  # its CPU kernel library's instruction-set variant ("" = none)
    role: str = "both"  # prefill/decode disaggregation (executor --role)
    num_prefill_tokens: int = 0  # prompt tokens it was sent to compute since connected


@dataclass(slots=True)
class ServerInfo:
    """The model, the limits and the load, summed over executors (GetServerInfo)."""

    model: str
    max_model_len: int
    block_size: int
    num_waiting: int
    num_running: int
    num_swapped: int
    kv_cache_usage: float  # fraction of device blocks in use, over all executors
    executors: list[ExecutorInfo]
    max_logprobs: int
    vocab_size: int
    policy: str
    preemption_mode: str
    num_preemptions: int
    prefix_cache_hit_rate: float
    routing: str = "kv"
    # Every model llmserve loads is a decoder LLM: it generates; features add the other tasks
    # it serves (their server_info hook).
    tasks: list[str] = field(default_factory=lambda: ["generate"])
    hidden_size: int = 0  # the width of the model's final hidden state (Describe)
    # GetServerInfoResponse's fields the features fill (their server_info hook), by the proto's
    # field name, as plain values (a message as a dict); absent: the proto's default.
    features: dict[str, Any] = field(default_factory=dict)
