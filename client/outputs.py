"""Results as the client hands them out, shaped like vLLM's offline API (`RequestOutput`,
`CompletionOutput`), plus the small records for streams, request state and server info."""

from __future__ import annotations

import enum
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from protos import scheduler_pb2 as pb

# Wire enum -> the strings vLLM uses (None = not finished).
_FINISH_REASONS: dict[int, str | None] = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_ERROR: "error",
    pb.FINISH_REASON_DEADLINE: "deadline",
}
_STATUSES: dict[int, str] = {
    pb.REQUEST_STATUS_UNSPECIFIED: "unspecified",
    pb.REQUEST_STATUS_WAITING: "waiting",
    pb.REQUEST_STATUS_RUNNING: "running",
    pb.REQUEST_STATUS_SWAPPED: "swapped",
    pb.REQUEST_STATUS_FINISHED: "finished",
}


def finish_reason_str(value: int) -> str | None:
    return _FINISH_REASONS.get(value, "error")


class AbortOutcome(enum.Enum):
    """What `abort()` did. Truthy only for ABORTED, so code that read the old bool return
    (`if client.abort(rid):`) keeps its meaning."""

    ABORTED = "aborted"  # the request was active and is now aborted
    # No request had this id (under the caller's key): a Generate with it within the server's
    # abort lifetime (60 s by default) ends at once as aborted.
    PENDING = "pending"
    FINISHED = "finished"  # it had finished already; nothing changed

    def __bool__(self) -> bool:
        return self is AbortOutcome.ABORTED

    @classmethod
    def from_proto(cls, resp: pb.AbortResponse) -> AbortOutcome:
        if resp.aborted:
            return cls.ABORTED
        return cls.PENDING if resp.pending else cls.FINISHED


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely; None for the sampled token when not in the top
    decoded_token: str | None = None


@dataclass(slots=True)
class StreamDelta:
    """One `GenerateResponse`: what one sequence produced since its previous delta."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    token_offset: int  # position of token_ids[0] in the sequence's output
    # One dict per token in token_ids: token id -> Logprob (sampled token and top alternatives).
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: str | None
    num_prompt_tokens: int
    error: str | None
    # On a sequence's first delta when the request asked for prompt_logprobs: as vLLM's
    # RequestOutput.prompt_logprobs, None for the first prompt token, then one dict per token.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def from_proto(cls, msg: pb.GenerateResponse) -> StreamDelta:
        logprobs = _logprob_dicts(msg.logprobs) if len(msg.logprobs) else None
        prompt_logprobs = None
        if len(msg.prompt_logprobs):
            prompt_logprobs = [None, *_logprob_dicts(msg.prompt_logprobs)]
        return cls(
            request_id=msg.request_id,
            index=msg.index,
            text=msg.text,
            token_ids=list(msg.token_ids),
            token_offset=msg.token_offset,
            logprobs=logprobs,
            finish_reason=finish_reason_str(msg.finish_reason),
            stop_reason=msg.stop_reason or None,
            num_prompt_tokens=msg.num_prompt_tokens,
            error=msg.error or None,
            prompt_logprobs=prompt_logprobs,
        )


def _logprob_dicts(entries: Any) -> list[dict[int, Logprob]]:
    out = []
    for entry in entries:
        by_id = {
            alt.token_id: Logprob(alt.logprob, rank, alt.text)
            for rank, alt in enumerate(entry.top, start=1)
        }
        # The chosen token may lie outside the top-n; vLLM still reports it.
        by_id.setdefault(entry.token_id, Logprob(entry.logprob))
        out.append(by_id)
    return out


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", "error", "deadline" or None
    stop_reason: str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, delta: StreamDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
                self.cumulative_logprob = 0.0
            for tok, by_id in zip(delta.token_ids, delta.logprobs, strict=False):
                self.logprobs.append(by_id)
                self.cumulative_logprob += by_id[tok].logprob if tok in by_id else 0.0
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (seconds since the epoch) as seen by this client."""

    arrival_time: float  # when the client sent the request
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None  # the text prompt; None for token-id and chat prompts
    prompt_token_ids: list[int] | None  # known to the client only for token-id prompts
    num_prompt_tokens: int
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # server message when a sequence finished with "error"
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then per token.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @classmethod
    def start(cls, request_id: str, prompt: Any, n: int) -> RequestOutput:
        return cls(
            request_id=request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=list(prompt) if _is_token_ids(prompt) else None,
            num_prompt_tokens=0,
            outputs=[CompletionOutput(index=i) for i in range(n)],
            finished=False,
            metrics=RequestMetrics(arrival_time=time.time()),
        )

    def add(self, delta: StreamDelta) -> None:
        """Fold one stream delta in and keep the metrics current."""
        now = time.time()
        if delta.request_id:
            self.request_id = delta.request_id
        self.num_prompt_tokens = delta.num_prompt_tokens or self.num_prompt_tokens
        while delta.index >= len(self.outputs):  # the server knows n better than we do
            self.outputs.append(CompletionOutput(index=len(self.outputs)))
        self.outputs[delta.index].append(delta)
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.token_ids:
            if self.metrics.first_token_time is None:
                self.metrics.first_token_time = now
            self.metrics.last_token_time = now
        if delta.error:
            self.error = delta.error
        if all(o.finished for o in self.outputs):
            self.finished = True
            self.metrics.finished_time = now

    @property
    def num_output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class RequestState:
    """`GetRequest`: status and output so far of a running or finished request."""

    request_id: str
    status: str  # "waiting", "running", "swapped" or "finished"
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    arrival_time: float
    error: str | None
    priority: int

    @property
    def finished(self) -> bool:
        return self.status == "finished"

    @classmethod
    def from_proto(cls, msg: pb.GetRequestResponse) -> RequestState:
        outputs = [
            CompletionOutput(
                index=s.index,
                text=s.text,
                token_ids=list(s.token_ids),
                finish_reason=finish_reason_str(s.finish_reason),
                stop_reason=s.stop_reason or None,
            )
            for s in msg.sequences
        ]
        return cls(
            request_id=msg.request_id,
            status=_STATUSES.get(msg.status, "unspecified"),
            prompt_token_ids=list(msg.prompt_token_ids),
            outputs=outputs,
            arrival_time=msg.arrival_time,
            error=msg.error or None,
            priority=msg.priority,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class ExecutorInfo:
    address: str
    instance_id: str
    num_device_blocks: int
    num_free_blocks: int
    num_cpu_blocks: int
    healthy: bool
    prefix_cache_queries: int = 0  # prompt tokens looked up in its prefix cache
    prefix_cache_hits: int = 0  # of which found there
    prefix_cache_host_hits: int = 0  # of the hits, those found in its host-memory tier
    draining: bool = False
    dtype: str = ""  # its compute dtype ("float32", "bfloat16", ...)
    cpu_kernel_isa: str = ""  # its CPU kernel variant ("avx512bf16", "avx512", "avx2"; "" = none)


@dataclass(frozen=True, slots=True)
class LoraAdapterInfo:
    """A loaded LoRA adapter: the name requests select it by, its PEFT directory, its rank."""

    name: str
    path: str
    rank: int


@dataclass(slots=True)
class ServerInfo:
    model: str
    version: str
    max_model_len: int
    block_size: int
    vocab_size: int
    max_logprobs: int
    policy: str
    preemption_mode: str
    num_waiting: int
    num_running: int
    num_swapped: int
    kv_cache_usage: float
    executors: list[ExecutorInfo]
    routing: str = ""
    tasks: list[str] = field(default_factory=list)  # what the model serves (proto: tasks)
    hidden_size: int = 0  # an embedding's length without `dimensions`
    # Speculative decoding: accepted / proposed tokens so far, and k (0: off).
    spec_decode_acceptance_rate: float = 0.0
    num_speculative_tokens: int = 0
    lora_adapters: list[LoraAdapterInfo] = field(default_factory=list)
    max_loras: int = 0  # distinct adapters per step; 0: the server serves no LoRA

    @classmethod
    def from_proto(cls, msg: pb.GetServerInfoResponse) -> ServerInfo:
        return cls(
            model=msg.model,
            version=msg.version,
            max_model_len=msg.max_model_len,
            block_size=msg.block_size,
            vocab_size=msg.vocab_size,
            max_logprobs=msg.max_logprobs,
            policy=msg.policy,
            preemption_mode=msg.preemption_mode,
            num_waiting=msg.num_waiting,
            num_running=msg.num_running,
            num_swapped=msg.num_swapped,
            kv_cache_usage=msg.kv_cache_usage,
            executors=[
                ExecutorInfo(
                    address=e.address,
                    instance_id=e.instance_id,
                    num_device_blocks=e.num_device_blocks,
                    num_free_blocks=e.num_free_blocks,
                    num_cpu_blocks=e.num_cpu_blocks,
                    healthy=e.healthy,
                    prefix_cache_queries=e.prefix_cache_queries,
                    prefix_cache_hits=e.prefix_cache_hits,
                    prefix_cache_host_hits=e.prefix_cache_host_hits,
                    draining=e.draining,
                    dtype=e.dtype,
                    cpu_kernel_isa=e.cpu_kernel_isa,
                )
                for e in msg.executors
            ],
            routing=msg.routing,
            tasks=list(msg.tasks),
            spec_decode_acceptance_rate=msg.spec_decode_acceptance_rate,
            num_speculative_tokens=msg.num_speculative_tokens,
            lora_adapters=[LoraAdapterInfo(a.name, a.path, a.rank) for a in msg.lora_adapters],
            max_loras=msg.max_loras,
            hidden_size=msg.hidden_size,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _is_token_ids(prompt: Any) -> bool:
    return isinstance(prompt, list | tuple) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    )
