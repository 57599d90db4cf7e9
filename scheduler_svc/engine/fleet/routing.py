"""Which executor a new or moved request goes to (`--routing`).

- `kv` (default): the scheduler holds every executor's block manager, so it knows exactly how
  many of a request's leading prompt blocks each executor has in its prefix cache. The cost of
  an executor is the blocks the request would have to prefill there plus the executor's load:
  the blocks its waiting requests still have to prefill and one per running sequence (each adds
  a token to every step). The cheapest wins: a request goes where its prefix is cached unless
  that executor is busier by more than the prefill it saves, the trade Dynamo's KV router and
  llm-d's prefix scorer make. Blocks in use are not load: shared prefix blocks are what a
  request with that prefix would reuse, not add to. A block in the executor's host-memory
  prefix tier (core/host_tier.py) counts as cached: copying it in costs a memcpy of its KV,
  far below computing it.
  A tagged request (core ``Request.tag``: what a feature attaches, an adapter) also costs
  ``ADAPTER_MISS_BLOCKS`` where its tag has not been routed lately (the executor would read
  the adapter from disk first), so requests of one adapter keep to the executors that hold it
  unless those are busier by more than that.
- `least-loaded`: most free blocks, then fewest waiting requests (ignores caches).
- `round-robin`: in turn.

Executors that are unreachable or draining get nothing while another can take the request.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from scheduler_svc.core.block_pool import hash_block_tokens
from scheduler_svc.core.request import Request

if TYPE_CHECKING:
    from scheduler_svc.engine.fleet.executor_handle import ExecutorHandle

__all__ = ["ROUTING_POLICIES", "Router", "cached_prefix_blocks"]

ROUTING_POLICIES = ("kv", "least-loaded", "round-robin")


def _chain(req: Request, bs: int, hashes: dict[int, list[bytes]]) -> list[bytes]:
    """Chained hashes of `req`'s leading full blocks of `bs` tokens, all but the last token
    (which is always computed), memoized per block size in `hashes`."""
    chain = hashes.get(bs)
    if chain is None:
        chain = hashes[bs] = []
        tokens = req.seqs[0].token_ids
        root = req.cache_root  # as the block manager's chain: per namespace
        for i in range((len(tokens) - 1) // bs):
            chain.append(hash_block_tokens(chain[-1] if i else root, tokens[i * bs : (i + 1) * bs]))
    return chain


def cached_prefix_blocks(
    ex: ExecutorHandle,
    req: Request,
    hashes: dict[int, list[bytes]],
    soon: dict[bytes, int] | None = None,
) -> int:
    """Leading full blocks of `req`'s tokens that `ex` holds in its prefix cache (on the device
    or in its host tier), or (with `soon`: hash -> step id) will hold once requests already
    routed there are prefilled.

    `hashes` memoizes the hash chains across executors (see _chain).
    """
    bm = ex.sched.block_manager
    if not (bm.enable_prefix_caching and req.seqs[0].use_prefix_cache):
        return 0
    holds = bm.holds_prefix_block
    oldest = ex.step_id - _SOON_STEPS
    n = 0
    for h in _chain(req, bm.block_size, hashes):
        if not holds(h) and (soon is None or soon.get(h, oldest - 1) < oldest):
            break
        n += 1
    return n


# A block routed to an executor counts as cached there (before it is computed) for this many
# of its steps; by then it is in its prefix cache, or the request went elsewhere.
_SOON_STEPS = 64
# What a tagged request adds to the cost of an executor its adapter was not routed to within the
# last ADAPTER_STEPS of its steps (in blocks of load, like a prefill).
ADAPTER_MISS_BLOCKS = 8
ADAPTER_STEPS = 4096


class Router:
    def __init__(self, policy: str = "kv", prefill_weight: float = 1.0) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(
                f"unknown routing policy {policy!r}; expected one of {ROUTING_POLICIES}"
            )
        self.policy = policy
        # How much a block to prefill weighs against a block of load (kv): above 1, requests
        # keep to the executor caching their prefix longer before load spreads them.
        self.prefill_weight = prefill_weight
        self._turn = itertools.count()
        # Per executor: (step id the load was counted at, that load, blocks routed to it
        # since). Recounted once per step, not once per request.
        self._pending: dict[int, tuple[int, int, int]] = {}
        # Per executor: hashes of prompt blocks routed there -> step id then. A burst of
        # requests with a new prefix follows the first one instead of being spread before the
        # prefix is in any cache.
        self._soon: dict[int, dict[bytes, int]] = {}
        # Per executor: tag (an adapter) -> step id it was last routed there at.
        self._adapters: dict[int, dict[Hashable, int]] = {}

    def choose(self, executors: Sequence[ExecutorHandle], req: Request) -> ExecutorHandle:
        candidates = (
            [ex for ex in executors if ex.healthy and not ex.draining]
            or [ex for ex in executors if ex.healthy]
            or list(executors)
        )
        hashes: dict[int, list[bytes]] = {}  # one hash chain per block size, for every use
        if len(candidates) == 1:
            chosen = candidates[0]
        elif self.policy == "round-robin":
            chosen = candidates[next(self._turn) % len(candidates)]
        elif self.policy == "least-loaded":
            chosen = max(candidates, key=lambda e: (e.sched.num_free_blocks, -e.sched.num_waiting))
        else:
            _, i = min((self._cost(ex, req, hashes), i) for i, ex in enumerate(candidates))
            chosen = candidates[i]
        if self.policy == "kv":
            self._note_routed(chosen, req, hashes)
            self._remember(chosen, req, hashes)
        if req.tag is not None:
            self._adapters.setdefault(id(chosen), {})[req.tag] = chosen.step_id
        return chosen

    def holds_adapter(self, ex: ExecutorHandle, req: Request) -> bool:
        step = self._adapters.get(id(ex), {}).get(req.tag) if req.tag is not None else None
        return step is not None and step >= ex.step_id - ADAPTER_STEPS

    def _remember(self, ex: ExecutorHandle, req: Request, hashes: dict[int, list[bytes]]) -> None:
        bm = ex.sched.block_manager
        if not (bm.enable_prefix_caching and req.seqs[0].use_prefix_cache):
            return
        soon = self._soon.setdefault(id(ex), {})
        for h in _chain(req, bm.block_size, hashes):
            soon[h] = ex.step_id
        if len(soon) > 1 << 16:  # drop what has expired
            oldest = ex.step_id - _SOON_STEPS
            self._soon[id(ex)] = {h: s for h, s in soon.items() if s >= oldest}

    def _cost(self, ex: ExecutorHandle, req: Request, hashes: dict[int, list[bytes]]) -> float:
        miss = req.tag is not None and not self.holds_adapter(ex, req)
        prefill = self._to_prefill(ex, req, hashes) + (ADAPTER_MISS_BLOCKS if miss else 0)
        return self.prefill_weight * prefill + self._load(ex)

    def _to_prefill(self, ex: ExecutorHandle, req: Request, hashes: dict[int, list[bytes]]) -> int:
        """Blocks of `req` that `ex` would compute: all but those cached or soon cached."""
        blocks = ex.sched.block_manager.num_blocks_for(len(req.seqs[0].token_ids))
        return blocks - cached_prefix_blocks(ex, req, hashes, self._soon.get(id(ex)))

    def _load(self, ex: ExecutorHandle) -> int:
        """Blocks left to prefill for its waiting requests plus its running sequences; counted
        from its core once per step, plus what was routed to it since."""
        step, base, added = self._pending.get(id(ex), (-1, 0, 0))
        if step != ex.step_id:
            sched = ex.sched
            bm = sched.block_manager
            base = sched.num_running_seqs
            for r in sched.waiting_requests():
                seq = r.seqs[0]
                cached = len(bm.find_cached_prefix(seq, len(seq.token_ids) - 1))
                base += bm.num_blocks_for(len(seq.token_ids)) - cached
            added = 0
            self._pending[id(ex)] = (ex.step_id, base, added)
        return base + added

    def _note_routed(
        self, ex: ExecutorHandle, req: Request, hashes: dict[int, list[bytes]]
    ) -> None:
        """Add the request's prefill there to its load."""
        self._load(ex)  # make sure the entry is this step's
        step, base, added = self._pending[id(ex)]
        self._pending[id(ex)] = (step, base, added + self._to_prefill(ex, req, hashes))

    def forget(self, ex: ExecutorHandle) -> None:
        self._pending.pop(id(ex), None)
        self._soon.pop(id(ex), None)
        self._adapters.pop(id(ex), None)
