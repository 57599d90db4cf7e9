"""Request and sequence state owned by the scheduler core (plain data, no policy)."""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from scheduler_svc.core.sampling_params import SamplingParams

_SEED_MASK = (1 << 63) - 1


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request and of each of its sequences.

    Ordered so that every finished state is above SWAPPED: `is_finished` is one comparison.
    """

    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6
    FINISHED_DEADLINE = 7  # its deadline passed while it ran (features/deadlines)

    @staticmethod
    def is_finished(status: int) -> bool:
        return status > RequestStatus.SWAPPED

    def finish_reason(self) -> FinishReason | None:
        """The client-facing reason of a finished state, None while unfinished."""
        return _FINISH_REASONS.get(self)


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    DEADLINE = "deadline"


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    RequestStatus.FINISHED_DEADLINE: FinishReason.DEADLINE,
}


def seq_id_of(req_id: str, index: int) -> str:
    """The id of sequence `index` of request `req_id` (what the executor knows it by)."""
    return f"{req_id}/{index}"


def req_id_of(seq_id: str) -> str:
    """The request a sequence id belongs to (request ids may themselves contain "/")."""
    return seq_id.rpartition("/")[0]


def sequence_seed(request_seed: int | None, index: int) -> int | None:
    """Seed of sequence `index`: the request seed itself for index 0, a fixed mix otherwise.

    The mix is a splitmix64 finaliser, so sibling sequences draw unrelated noise while the whole
    request stays reproducible from its one seed (and from nothing else, e.g. not the batch).
    """
    if request_seed is None or index == 0:
        return request_seed
    z = (request_seed + index * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _SEED_MASK


@dataclass(slots=True, eq=False)
class Sequence:
    """One generated continuation of a request (n > 1 gives several)."""

    seq_id: str  # seq_id_of(req_id, index), unique among live sequences
    req_id: str
    index: int
    token_ids: list[int]  # prompt followed by outputs; appended in place as tokens arrive
    num_prompt_tokens: int
    seed: int | None  # per-sequence seed (see sequence_seed); None = unseeded
    status: RequestStatus = RequestStatus.WAITING
    # Leading tokens whose KV is in this sequence's device blocks. Reset to 0 by recompute.
    num_computed_tokens: int = 0
    stop_reason: int | str | None = None  # stop token id or stop string that ended it
    # Device block ids in logical order. Written only by the block manager; append-only except
    # for copy-on-write replacement of a shared block.
    block_table: list[int] = field(default_factory=list)
    # Slots [num_computed_tokens, exclusive_until) sit in blocks only this sequence holds: a
    # decode there needs no call to the block manager (which alone sets this; 0 = ask it).
    exclusive_until: int = 0
    # CPU block ids while swapped out (empty otherwise).
    cpu_block_table: list[int] = field(default_factory=list)
    # Chained prefix-cache hashes of the first len(block_hashes) full blocks of token_ids. They
    # depend only on the tokens, so they survive preemption and are never computed twice.
    block_hashes: list[bytes] = field(default_factory=list)
    # Leading blocks already offered to the prefix cache (full and computed). Only blocks past
    # this count are hashed/registered when num_computed_tokens moves on.
    num_cached_blocks: int = 0
    # The executor holds state for seq_id (it was sent as a NewSequence and not dropped since):
    # decides between sending it in full or as a difference, and whether a drop must be sent.
    sent: bool = False
    # False for requests that want prompt logprobs: a prefix-cache hit would skip positions.
    use_prefix_cache: bool = True
    # max_tokens is 0: the executor samples nothing for it; it ends once its prompt is computed.
    prompt_only: bool = False
    # Parent hash of its first block (its request's cache_root): prefix-cache hits never
    # cross roots. None: the shared root.
    cache_root: bytes | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.SWAPPED


@dataclass(slots=True, eq=False)
class Request:
    """A client request: one prompt, n sequences sampled from it.

    A fresh request with n > 1 starts as sequence 0 alone; the scheduler forks the other n - 1
    once the prompt (but its last token) is computed, so the prompt's KV is computed once and
    shared. Output tokens produced before a restart can be passed as `output_token_ids` (one list
    per sequence): the request then starts with all n sequences, each recomputing its prompt plus
    outputs, and the outputs still count as output (penalties, max_tokens, seeding position).
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0  # larger is served first under the "priority" policy
    arrival_time: float = 0.0
    output_token_ids: list[list[int]] | None = None  # resume: outputs so far per sequence
    seqs: list[Sequence] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    error: str | None = None  # why it finished with FINISHED_ERROR
    # False while sequences 1..n-1 still have to be forked off sequence 0.
    forked: bool = True
    # Queue order under the scheduler's policy; set by the scheduler on add_request.
    sort_key: tuple = ()
    # What a feature attaches to the request (its admit hook, through Request.of): opaque to
    # the core, which hands it to the step limit (core/step_budget.py) and with each new
    # sequence to the step message's hooks (NewSeqData.tag). None: nothing attached.
    tag: Hashable | None = None
    # The root of its sequences' prefix-cache hash chains, set with the tag by the same
    # feature (a namespace like vLLM's cache salt: requests whose KV differs from the first
    # token on never share blocks). None: the shared root.
    cache_root: bytes | None = None
    # Its plain decode steps may use the step message's packed decode lane (which carries no
    # top logprobs, so only requests that ask for none).
    decode_lane: bool = field(init=False, default=True)
    # False: preempted by recompute, never by swap (the executor keeps state of it outside its
    # KV blocks that a swapped-in sequence would not get back).
    swappable: bool = field(init=False, default=True)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.req_id!r} has an empty prompt")
        self.decode_lane = self.sampling_params.logprobs is None
        n = self.sampling_params.n
        outputs = self.output_token_ids
        if outputs is not None and len(outputs) != n:
            raise ValueError(
                f"request {self.req_id!r}: output_token_ids has {len(outputs)} lists, n is {n}"
            )
        if outputs is None or not any(outputs):
            self.forked = n == 1
            self.seqs = [self._make_seq(0, [])]
        else:
            self.forked = True
            self.seqs = [self._make_seq(i, out) for i, out in enumerate(outputs)]

    @classmethod
    def of(cls, handle: Any, output_token_ids: list[list[int]] | None = None) -> Request:
        """The core's side of an engine request (anything with its ``req_id``,
        ``prompt_token_ids``, ``params``, ``priority``, ``arrival_time`` and ``core_fields``:
        the engine's ``RequestHandle``, whose ``core_fields`` its features' admit hooks set,
        e.g. ``tag`` and ``cache_root``); ``output_token_ids``: what a resumed one
        recomputes."""
        return cls(
            handle.req_id,
            handle.prompt_token_ids,
            handle.params,
            priority=handle.priority,
            arrival_time=handle.arrival_time,
            output_token_ids=output_token_ids,
            **handle.core_fields,
        )

    def _make_seq(self, index: int, outputs: list[int]) -> Sequence:
        return Sequence(
            seq_id=seq_id_of(self.req_id, index),
            req_id=self.req_id,
            index=index,
            token_ids=[*self.prompt_token_ids, *outputs],
            num_prompt_tokens=len(self.prompt_token_ids),
            seed=sequence_seed(self.sampling_params.seed, index),
            use_prefix_cache=self.sampling_params.prompt_logprobs is None,
            prompt_only=self.sampling_params.max_tokens == 0,
            cache_root=self.cache_root,
        )

    def fork(self) -> list[Sequence]:
        """Create sequences 1..n-1 as copies of sequence 0 (tokens, progress, hashes)."""
        parent = self.seqs[0]
        children = []
        for i in range(1, self.sampling_params.n):
            child = self._make_seq(i, [])
            child.token_ids = list(parent.token_ids)
            child.num_computed_tokens = parent.num_computed_tokens
            child.block_hashes = list(parent.block_hashes)
            child.num_cached_blocks = parent.num_cached_blocks
            child.status = parent.status
            children.append(child)
        self.seqs.extend(children)
        self.forked = True
        return children

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.SWAPPED

    @property
    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if s.status <= RequestStatus.SWAPPED]

    @property
    def num_seqs_when_running(self) -> int:
        """Sequences this request occupies in the batch (n before the fork has happened)."""
        if not self.forked:
            return self.sampling_params.n
        return sum(1 for s in self.seqs if s.status <= RequestStatus.SWAPPED)
