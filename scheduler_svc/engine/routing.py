"""Which executor a new or moved request goes to (`--routing`).

- `kv` (default): the scheduler holds every executor's block manager, so it knows exactly how
  many of a request's leading prompt blocks each executor has in its prefix cache. The cost of
  an executor is the blocks the request would have to prefill there plus the executor's load:
  the blocks its waiting requests still have to prefill and one per running sequence (each adds
  a token to every step). The cheapest wins: a request goes where its prefix is cached unless
  that executor is busier by more than the prefill it saves, the trade Dynamo's KV router and
  llm-d's prefix scorer make. Blocks in use are not load: shared prefix blocks are what a
  request with that prefix would reuse, not add to.
- `least-loaded`: most free blocks, then fewest waiting requests (ignores caches).
- `round-robin`: in turn.

Executors that are unreachable or draining get nothing while another can take the request.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from scheduler_svc.core.block_pool import hash_block_tokens
from scheduler_svc.core.request import Request

if TYPE_CHECKING:
    from scheduler_svc.engine.executors import ExecutorHandle

__all__ = ["ROUTING_POLICIES", "Router", "cached_prefix_blocks"]

ROUTING_POLICIES = ("kv", "least-loaded", "round-robin")


def cached_prefix_blocks(ex: ExecutorHandle, req: Request, hashes: dict[int, list[bytes]]) -> int:
    """Leading full blocks of `req`'s tokens that `ex` holds in its prefix cache.

    `hashes` memoizes the chained block hashes per block size across executors (executors
    with the same block size share one hash list). At most all but the last token counts, as in
    admission: the last token is always computed.
    """
    bm = ex.sched.block_manager
    seq = req.seqs[0]
    if not (bm.enable_prefix_caching and seq.use_prefix_cache):
        return 0
    bs = bm.block_size
    max_blocks = (len(seq.token_ids) - 1) // bs
    chain = hashes.get(bs)
    if chain is None:
        chain = hashes[bs] = []
        tokens = seq.token_ids
        for i in range(max_blocks):
            chain.append(hash_block_tokens(chain[-1] if i else None, tokens[i * bs : (i + 1) * bs]))
    cached = bm.pool.cached
    n = 0
    for h in chain:
        if h not in cached:
            break
        n += 1
    return n


class Router:
    def __init__(self, policy: str = "kv") -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(
                f"unknown routing policy {policy!r}; expected one of {ROUTING_POLICIES}"
            )
        self.policy = policy
        self._turn = itertools.count()
        # Per executor: (step id the load was counted at, that load, blocks routed to it
        # since). Recounted once per step, not once per request.
        self._pending: dict[int, tuple[int, int, int]] = {}

    def choose(self, executors: Sequence[ExecutorHandle], req: Request) -> ExecutorHandle:
        candidates = (
            [ex for ex in executors if ex.healthy and not ex.draining]
            or [ex for ex in executors if ex.healthy]
            or list(executors)
        )
        cost = None
        if len(candidates) == 1:
            chosen = candidates[0]
        elif self.policy == "round-robin":
            chosen = candidates[next(self._turn) % len(candidates)]
        elif self.policy == "least-loaded":
            chosen = max(candidates, key=lambda e: (e.sched.num_free_blocks, -e.sched.num_waiting))
        else:
            hashes: dict[int, list[bytes]] = {}
            cost, i = min((self._cost(ex, req, hashes), i) for i, ex in enumerate(candidates))
            chosen = candidates[i]
        if self.policy == "kv":
            self._note_routed(chosen, req, cost)
        return chosen

    def _cost(self, ex: ExecutorHandle, req: Request, hashes: dict[int, list[bytes]]) -> int:
        bm = ex.sched.block_manager
        blocks = bm.num_blocks_for(len(req.seqs[0].token_ids))
        to_prefill = blocks - cached_prefix_blocks(ex, req, hashes)
        return to_prefill + self._load(ex)

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

    def _note_routed(self, ex: ExecutorHandle, req: Request, cost: int | None) -> None:
        self._load(ex)  # make sure the entry is this step's
        step, base, added = self._pending[id(ex)]
        if cost is None:  # not costed (the only candidate): count all of its blocks
            cost = ex.sched.block_manager.num_blocks_for(len(req.seqs[0].token_ids))
        else:
            cost -= base + added  # its own prefill there
        self._pending[id(ex)] = (step, base, added + cost)

    def forget(self, ex: ExecutorHandle) -> None:
        self._pending.pop(id(ex), None)
