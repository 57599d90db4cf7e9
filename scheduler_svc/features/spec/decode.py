"""Speculative decoding in the scheduler: the n-gram (prompt lookup) proposer and acceptance,
as the scheduling core's lookahead (core/lookahead.py: ``SpecDecoder``; the feature's
``scheduling`` hook gives each core one).

A speculating sequence is scheduled as its decode token plus k proposed tokens (extra query
positions, with KV slots for all of them); the executor returns the target's draw at each of
the 1 + k positions (executor_svc/features/spec/verify.py). Proposal i is accepted while it
equals the draw at the position before it, and the draws up to and including the first
mismatch are the step's tokens. Each draw is the token the non-speculative path samples at that
position (same logits rows, same output history, the same (seed, position) noise), so the output
is token for token the same; speculation only changes how many tokens a step yields. Rejected
positions' slots are given back (``BlockManager.truncate``); proposals never leave the core:
only accepted tokens reach the output processor, Redis and clients.

Not speculated (decoded one token a step as before): constrained requests (their mask depends on
the token before), requests with n > 1, requests that opt out, a step without room for the extra
slots (the plain decode path, and its preemption, takes over), sequences sent in full this step.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

from scheduler_svc.core.scheduler_output import CachedSeqData

if TYPE_CHECKING:
    from scheduler_svc.core.block_manager import BlockManager
    from scheduler_svc.core.lookahead import LookaheadFactory
    from scheduler_svc.core.request import Request, Sequence
    from scheduler_svc.core.scheduler_output import SchedulerOutput

__all__ = [
    "SpecDecoder",
    "SpecStats",
    "SpeculativeConfig",
    "accept",
    "draft_executor_error",
    "lookahead",
    "propose_ngram",
    "take_draft_proposals",
]

_METHODS = ("ngram", "draft_model")
# A sequence whose proposals keep failing pauses proposing. A proposal rejected outright costs
# the verified rows' compute (~0.3 of a decode step at k = 4 on a CPU), an accepted one saves a
# step or more, so a sequence keeps proposing on every step while at least _MIN_HIT_RATE of its
# verifications (counted with a prior of one hit in two) accepted something: text that copies
# its input in runs between paraphrases does (measured: pausing after each miss halved the
# speedup there). Below that rate a miss pauses it 1 step, then 4, 16, up to _MAX_BACKOFF (any
# accepted proposal ends the pause): a sequence whose every proposal fails verifies 7 times in
# its first 128 steps and then once every 65, ~1.5 % of the steps' cost.
_MAX_BACKOFF = 64
_BACKOFF_GROWTH = 4
_MIN_HIT_RATE = 0.25


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """``--speculative-config``, in vLLM's spirit."""

    method: str = "ngram"  # or "draft_model": the executor's draft proposes
    model: str = ""  # draft_model: the draft checkpoint the executors load (--speculative-model)
    num_speculative_tokens: int = 4  # k: proposals verified per step at most
    prompt_lookup_min: int = 1  # shortest suffix n-gram matched
    prompt_lookup_max: int = 4  # longest suffix n-gram matched (tried first)
    # No proposals in a step that runs more requests than this (vLLM's name): on a CPU every
    # extra query row costs compute (the LM head alone is vocab x hidden per row), so beyond a
    # few sequences the verified rows cost more than the steps they save. 0: no limit.
    disable_by_batch_size: int = 2

    def __post_init__(self) -> None:
        if self.method not in _METHODS:
            raise ValueError(f"speculative method must be one of {_METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError("num_speculative_tokens must be in [1, 64]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.disable_by_batch_size < 0:
            raise ValueError("disable_by_batch_size must be >= 0")
        if (self.method == "draft_model") != bool(self.model):
            raise ValueError('"model" (the draft checkpoint) goes with method "draft_model" only')

    @property
    def uses_draft(self) -> bool:
        """Proposals come from the executor's draft model, not from the scheduler."""
        return self.method == "draft_model"

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse the flag's JSON object; ValueError naming what is wrong."""
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(obj) - known)
        if unknown:
            raise ValueError(
                f"--speculative-config: unknown keys {unknown}; known: {sorted(known)}"
            )
        return cls(**obj)


def lookahead(config: SpeculativeConfig | None) -> LookaheadFactory | None:
    """Each core's lookahead for ``config`` (SchedulerConfig.lookahead; None: off)."""
    return partial(SpecDecoder, config) if config is not None else None


def propose_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix n-gram
    (n_max down to n_min) of `tokens`; [] when none recurs."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = tokens[size - n :]
        last = suffix[-1]
        # Latest earlier copy first: e is the last index of a candidate copy, below size - 1.
        for e in range(size - 2, n - 2, -1):
            if tokens[e] == last and tokens[e - n + 1 : e + 1] == suffix:
                return tokens[e + 1 : e + 1 + k]
    return []


def draft_executor_error(
    config: SpeculativeConfig | None, draft_model_name: str, draft_vocab_size: int, vocab_size: int
) -> str | None:
    """Why an executor (as its Describe reports it) cannot serve ``config`` (None: it can)."""
    if config is None or not config.uses_draft:
        return None
    if not draft_model_name:
        return (
            f"--speculative-config asks for draft_model {config.model!r} but the executor has "
            "no draft model loaded (start it with --speculative-model PATH)"
        )
    if draft_vocab_size != vocab_size:
        return (
            f"the executor's draft model {draft_model_name!r} has a vocabulary of "
            f"{draft_vocab_size} tokens, the target {vocab_size}: a draft needs the same tokenizer"
        )
    return None


def take_draft_proposals(out: SchedulerOutput, proposals: dict[str, list[int]]) -> None:
    """The executor's draft proposals of a step's drafting sequences (seq_id -> tokens, as
    the reply brings them) into ``out.spec_token_ids``, before update_from_output verifies
    them; ValueError when one is missing or of another length than scheduled."""
    for c in out.cached_seqs:
        if c.num_draft_tokens:
            got = proposals.get(c.seq_id, [])
            if len(got) != c.num_draft_tokens:
                raise ValueError(
                    f"the executor returned {len(got)} draft proposals for {c.seq_id!r}, "
                    f"{c.num_draft_tokens} were scheduled"
                )
            out.spec_token_ids[c.seq_id] = got


def accept(proposed: list[int], drawn: list[int]) -> int:
    """Leading proposals equal to the draws before them (drawn[i] is the target's token at
    proposal i's position); the tokens kept are drawn[: accepted + 1]."""
    n = 0
    for p, d in zip(proposed, drawn, strict=False):
        if p != d:
            break
        n += 1
    return n


@dataclass(slots=True)
class SpecStats:
    """Counters under vLLM's spec_decode metric names (cumulative)."""

    num_drafts: int = 0  # verifying steps of a sequence
    num_draft_tokens: int = 0  # tokens proposed
    num_accepted_tokens: int = 0  # proposals accepted
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: proposal i accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass(slots=True)
class _Backoff:
    skip: int = 0  # steps left without proposing
    pause: int = 0  # length of the last pause
    verifies: int = 0  # the sequence's verifying steps
    hits: int = 0  # those that accepted at least one proposal


class SpecDecoder:
    """One executor core's proposer, acceptance and counters: its lookahead
    (core/lookahead.py ``Lookahead``)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._backoff: dict[str, _Backoff] = {}
        # (known tokens, at most k) -> proposals: the seam a draft-model proposer plugs into
        # (tests plug in an oracle to force acceptance patterns).
        self.proposer: Callable[[list[int], int], list[int]] = self._ngram

    def active(self, num_running: int) -> bool:
        """Whether a step running this many requests speculates at all."""
        limit = self.config.disable_by_batch_size
        return not limit or num_running <= limit

    def eligible(self, req: Request) -> bool:
        p = req.sampling_params
        return p.n == 1 and not p.step_by_step and not p.disable_speculation

    def schedule(
        self,
        bm: BlockManager,
        req: Request,
        seq: Sequence,
        budget: int,
        max_model_len: int,
        out: SchedulerOutput,
    ) -> int:
        """A decode with proposals verified after it, when the proposer has some and the blocks for
        their slots are free; returns how many (0: decode plainly)."""
        if self.config.uses_draft:  # the executor's draft proposes; its tokens come back
            proposed, k = [], self.room(req, seq, max_model_len, budget)
        else:
            proposed = self.propose(req, seq, max_model_len, budget)
            k = len(proposed)
        if k <= 0:
            return 0
        growth = bm.grow(seq, 1 + k, out.blocks_to_copy)
        if growth is None:
            return 0
        new_ids, replaced = growth
        sid = seq.seq_id
        out.cached_seqs.append(
            CachedSeqData(
                sid,
                new_ids,
                [replaced] if replaced else [],
                1 + k,
                seq.num_computed_tokens,
                proposed,
            )
        )
        if not proposed:
            out.cached_seqs[-1].num_draft_tokens = k
        out.spec_token_ids[sid] = proposed
        out.num_scheduled_tokens[sid] = 1 + k
        out.scheduled.append((seq, 1 + k))
        return k

    def propose(self, req: Request, seq: Sequence, max_len: int, budget: int) -> list[int]:
        """Proposals for seq's next step (a decode), bounded by max_tokens (the last token of
        the output is never proposed), max_model_len and the step's token budget."""
        room = self.room(req, seq, max_len, budget)
        return self.proposer(seq.token_ids, room) if room > 0 else []

    def room(self, req: Request, seq: Sequence, max_len: int, budget: int) -> int:
        """How many tokens seq may have proposed for its next step (0: none)."""
        if not self.eligible(req):
            return 0
        b = self._backoff.get(seq.seq_id)
        if b is not None and b.skip > 0:
            b.skip -= 1
            return 0
        tokens = seq.token_ids
        return min(
            self.config.num_speculative_tokens,
            req.sampling_params.max_tokens - seq.num_output_tokens - 1,
            max_len - len(tokens) - 1,  # the accepted run never passes max_model_len
            budget - 1,
        )

    def _ngram(self, tokens: list[int], k: int) -> list[int]:
        c = self.config
        return propose_ngram(tokens, k, c.prompt_lookup_min, c.prompt_lookup_max)

    def verified(
        self, seq: Sequence, proposed: list[int], drawn: list[int], bm: BlockManager
    ) -> int:
        """Apply a verifying step's draws to seq (called after its computed count advanced by
        1 + len(proposed)): keep the accepted run, give back the rest. Returns the count of
        accepted proposals."""
        a = accept(proposed, drawn)
        k = len(proposed)
        seq.num_computed_tokens -= k - a
        seq.token_ids.extend(drawn[: a + 1])
        bm.truncate(seq, len(seq.token_ids))
        st = self.stats
        st.num_drafts += 1
        st.num_draft_tokens += k
        st.num_accepted_tokens += a
        for i in range(a):
            st.accepted_per_pos[i] += 1
        self._adapt(seq.seq_id, a)
        return a

    def _adapt(self, seq_id: str, accepted: int) -> None:
        b = self._backoff.get(seq_id)
        if b is None:
            if len(self._backoff) > 4096:  # ended sequences' entries: forget them all
                self._backoff.clear()
            b = self._backoff[seq_id] = _Backoff()
        b.verifies += 1
        if accepted:
            b.hits += 1
            b.pause = 0
        elif (b.hits + 1) / (b.verifies + 2) < _MIN_HIT_RATE:
            b.pause = min(max(1, _BACKOFF_GROWTH * b.pause), _MAX_BACKOFF)
            b.skip = b.pause
