"""Prefix-cache waits at admission: a waiting request whose next uncached prompt block is being
computed by a running request waits a step, and then hits the cache instead of computing the
same block twice."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler_svc.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from scheduler_svc.core.block_manager import BlockManager

__all__ = ["prefix_blocks_in_flight", "uncomputed_prompt_hashes", "waits_for_prefix"]


def uncomputed_prompt_hashes(bm: BlockManager, req: Request) -> list[bytes]:
    """Hashes of the full prompt blocks `req` has still to compute (to be cached)."""
    seq = req.seqs[0]
    if not seq.use_prefix_cache or seq.num_computed_tokens >= seq.num_prompt_tokens:
        return []
    num_full = seq.num_prompt_tokens // bm.block_size
    bm.ensure_hashes(seq, num_full)
    return seq.block_hashes[seq.num_computed_tokens // bm.block_size : num_full]


def prefix_blocks_in_flight(bm: BlockManager, running: list[Request]) -> set[bytes]:
    """The prompt blocks the running requests are computing now."""
    inflight: set[bytes] = set()
    for req in running:
        if req.status == RequestStatus.RUNNING:
            inflight.update(uncomputed_prompt_hashes(bm, req))
    return inflight


def waits_for_prefix(bm: BlockManager, req: Request, inflight: set[bytes]) -> bool:
    """Whether `req`'s first uncached prompt block is one of `inflight`."""
    if not inflight:
        return False
    seq = req.seqs[0]
    if not seq.use_prefix_cache:
        return False
    hits = len(bm.find_cached_prefix(seq, len(seq.token_ids) - 1))
    max_blocks = (len(seq.token_ids) - 1) // bm.block_size
    if hits >= max_blocks:
        return False
    bm.ensure_hashes(seq, hits + 1)
    return seq.block_hashes[hits] in inflight
