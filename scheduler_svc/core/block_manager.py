"""Block manager for one executor: block tables, ref counts, copy-on-write, prefix cache, swap,
and the host-memory prefix tier beneath the prefix cache (core/host_tier.py).

Sequences own their `block_table` field; only this module changes it. A block shared by several
tables (a fork, or a prefix-cache hit) carries one reference per table entry. Tables grow at the
end only; the one exception is copy-on-write, which replaces the entry a sequence is about to
write into when someone else still reads it. Full, computed blocks are never written again, so
they can be shared freely; only a partly filled block needs copy-on-write.
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduler_svc.core.block_pool import Block, BlockPool, hash_block_tokens
from scheduler_svc.core.host_tier import HostHit, HostTier
from scheduler_svc.core.request import Sequence


class BlockManager:
    def __init__(
        self,
        *,
        block_size: int,
        num_device_blocks: int,
        num_cpu_blocks: int = 0,
        watermark: float = 0.0,
        enable_prefix_caching: bool = True,
        num_host_cache_blocks: int = 0,
    ) -> None:
        if not 0 <= num_host_cache_blocks <= num_cpu_blocks:
            raise ValueError(
                f"the host prefix tier's {num_host_cache_blocks} blocks must come out of the "
                f"{num_cpu_blocks} CPU blocks"
            )
        self.block_size = block_size
        self.num_device_blocks = num_device_blocks
        # The CPU pool's top num_host_cache_blocks ids are the host tier's; swap has the rest.
        self.num_cpu_blocks = num_cpu_blocks - num_host_cache_blocks
        # Free blocks kept back from admitting new work, so running decodes do not hit the wall
        # (and preempt) right after an admission.
        self.watermark_blocks = int(watermark * num_device_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_device_blocks)
        self.host_tier: HostTier | None = None
        if enable_prefix_caching and num_host_cache_blocks:
            self.host_tier = HostTier(self.num_cpu_blocks, num_host_cache_blocks)
            self.pool.on_evict = self.host_tier.on_evict
        self._cpu_ref = [0] * num_cpu_blocks
        self._cpu_free: list[int] = []
        # Every sequence holding a device or CPU table, for check_invariants and reset.
        self._holders: dict[str, Sequence] = {}
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of which found (their computation was skipped)
        self.prefix_cache_host_hits = 0  # of which found in the host tier (copied in)
        self.reset()

    # ------------------------------------------------------------------ counts

    @property
    def num_free_blocks(self) -> int:
        """Device blocks not in use (cached-but-free blocks count: they are evictable)."""
        return self.pool.num_free

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._cpu_free)

    @property
    def usage(self) -> float:
        """Fraction of device blocks in use."""
        return 1.0 - self.pool.num_free / self.num_device_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ admission

    def find_cached_prefix(self, seq: Sequence, max_tokens: int) -> list[Block | HostHit]:
        """Blocks already holding a leading run of seq's tokens, at most `max_tokens` of them:
        device blocks, or host-tier entries where the device no longer has the content.

        The caller bounds max_tokens below the tokens it must compute, so at least one token is
        computed and there is a logit to sample from.
        """
        if not (self.enable_prefix_caching and seq.use_prefix_cache):
            return []
        bs = self.block_size
        max_blocks = max_tokens // bs
        self.ensure_hashes(seq, max_blocks)
        hits: list[Block | HostHit] = []
        cached = self.pool.cached
        tier = self.host_tier
        for h in seq.block_hashes[:max_blocks]:
            block = cached.get(h)
            if block is None:
                host = tier.lookup(h) if tier is not None else None
                if host is None:
                    break
                hits.append(HostHit(h, host))
            else:
                hits.append(block)
        return hits

    def holds_prefix_block(self, block_hash: bytes) -> bool:
        """Whether a prefix lookup would hit `block_hash` (on the device or in the host tier)."""
        if block_hash in self.pool.cached:
            return True
        return self.host_tier is not None and self.host_tier.lookup(block_hash) is not None

    def plan_admission(self, seqs: list[Sequence]) -> tuple[list[list[Block | HostHit]], int]:
        """Prefix-cache hits of each sequence (for allocate_group) and the free blocks that
        admitting them all takes: fresh blocks (host-tier hits included: they are copied into
        one), plus hit blocks that sit in the free list now.

        Each hit stops short of the last token, so at least one token is computed and there is
        a logit to sample from.
        """
        hits = []
        need = 0
        free_hits: set[int] = set()
        for seq in seqs:
            seq_hits = self.find_cached_prefix(seq, len(seq.token_ids) - 1)
            hits.append(seq_hits)
            on_device = [b for b in seq_hits if isinstance(b, Block)]
            need += self.num_blocks_for(len(seq.token_ids)) - len(on_device)
            free_hits.update(b.block_id for b in on_device if b.ref_cnt == 0)
        return hits, need + len(free_hits)

    def ensure_hashes(self, seq: Sequence, num_blocks: int) -> None:
        """Extend seq.block_hashes to its first `num_blocks` full blocks (never re-hashes)."""
        hashes = seq.block_hashes
        bs = self.block_size
        tokens = seq.token_ids
        for i in range(len(hashes), min(num_blocks, len(tokens) // bs)):
            parent = hashes[-1] if i else seq.cache_root
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs]))

    def allocate(self, seq: Sequence, hits: list[Block | HostHit], num_tokens: int) -> None:
        """Give seq a table for its first `num_tokens` tokens: the hit blocks, then fresh ones.

        Sets num_computed_tokens to what the hits cover. Caller checked that enough blocks are
        free (hit blocks that are currently free count against that).
        """
        self.allocate_group([seq], [hits], [num_tokens])

    def allocate_group(
        self, seqs: list[Sequence], hits: list[list[Block | HostHit]], num_tokens: list[int]
    ) -> None:
        """allocate() for several sequences looked up together (one request's sequences).

        Every hit is taken before any fresh block: a fresh block comes off the front of the
        free list and may evict cached content that a sibling's lookup has just found (a
        host-tier hit is pinned there until its own fresh block is filled by a copy-in).
        """
        pool = self.pool
        num_host = 0
        for seq, seq_hits in zip(seqs, hits, strict=True):
            assert not seq.block_table, f"{seq.seq_id} already has blocks"
            for block in seq_hits:
                if isinstance(block, HostHit):
                    self.host_tier.pin(block)
                    seq.block_table.append(-1)  # filled below
                    num_host += 1
                else:
                    pool.touch(block)
                    seq.block_table.append(block.block_id)
        if num_host:
            self._load_host_hits(seqs, hits)
        for seq, seq_hits, n in zip(seqs, hits, num_tokens, strict=True):
            seq.exclusive_until = 0  # the first grow() vouches for it
            table = seq.block_table
            for _ in range(self.num_blocks_for(n) - len(seq_hits)):
                table.append(pool.allocate().block_id)
            seq.num_computed_tokens = len(seq_hits) * self.block_size
            seq.num_cached_blocks = len(seq_hits)
            self._holders[seq.seq_id] = seq
            if self.enable_prefix_caching:
                self.prefix_cache_queries += len(seq.token_ids)
                self.prefix_cache_hits += seq.num_computed_tokens
        self.prefix_cache_host_hits += num_host * self.block_size

    def _load_host_hits(self, seqs: list[Sequence], hits: list[list[Block | HostHit]]) -> None:
        """Fresh device blocks for the host-tier hits, each filled by a copy-in this step and
        findable on the device at once (the swap-in runs before the step's forward)."""
        pool = self.pool
        tier = self.host_tier
        loaded: dict[bytes, Block] = {}  # siblings hitting the same entry share one copy
        for seq, seq_hits in zip(seqs, hits, strict=True):
            for i, hit in enumerate(seq_hits):
                if not isinstance(hit, HostHit):
                    continue
                block = loaded.get(hit.block_hash)
                if block is None:
                    block = loaded[hit.block_hash] = pool.allocate()
                    tier.load(hit, block.block_id)
                    pool.register(block, hit.block_hash)
                else:
                    pool.touch(block)
                seq.block_table[i] = block.block_id

    def take_host_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The host tier's (device, cpu) swap-outs and (cpu, device) swap-ins of the step being
        planned; whoever builds a step's message appends them to its swap lists."""
        if self.host_tier is None:
            return [], []
        return self.host_tier.take_transfers()

    def fork(self, parent: Sequence, children: Iterable[Sequence]) -> None:
        """Children share every block of the parent (one more reference each)."""
        blocks = self.pool.blocks
        parent.exclusive_until = 0  # its blocks are shared now
        for child in children:
            child.exclusive_until = 0
            child.block_table = list(parent.block_table)
            for bid in child.block_table:
                self.pool.touch(blocks[bid])
            self._holders[child.seq_id] = child

    # ------------------------------------------------------------------ growth

    def num_blocks_to_compute(
        self, seqs: Iterable[Sequence], num_tokens: int = 1, *, on_cpu: bool = False
    ) -> int:
        """Fresh device blocks needed so each seq can compute its next `num_tokens` tokens.

        Counts appended blocks plus copy-on-write copies, simulating the reference drops that
        earlier copies cause (the last holder of a shared block writes in place). With on_cpu,
        reads the CPU tables of swapped seqs (what they will need right after swap-in).
        """
        bs = self.block_size
        blocks = self.pool.blocks
        cpu_ref = self._cpu_ref
        need = 0
        dropped: dict[int, int] = {}
        for seq in seqs:
            nc = seq.num_computed_tokens
            table = seq.cpu_block_table if on_cpu else seq.block_table
            idx = nc // bs
            if idx < len(table):
                bid = table[idx]
                ref = cpu_ref[bid] if on_cpu else blocks[bid].ref_cnt
                if ref > 1 and ref - dropped.get(bid, 0) > 1:
                    need += 1
                    dropped[bid] = dropped.get(bid, 0) + 1
            extra = -(-(nc + num_tokens) // bs) - len(table)
            if extra > 0:
                need += extra
        return need

    def grow(
        self, seq: Sequence, num_tokens: int, copies: list[tuple[int, int]]
    ) -> tuple[list[int], tuple[int, int] | None] | None:
        """Make seq's next `num_tokens` slots writable by seq alone: the one call through which
        any path (decode, prefill chunk, fork) gets room.

        A shared block seq is about to write into is replaced by a copy (copy-on-write; the
        copy is appended to `copies` when earlier tokens of it are computed), then fresh blocks
        are appended. Returns (appended block ids, (logical index, new block id) of a replaced
        block or None), or None with nothing changed when the free blocks do not suffice.
        Afterwards `seq.exclusive_until` says how far seq may write without asking again.
        """
        bs = self.block_size
        pool = self.pool
        table = seq.block_table
        nc = seq.num_computed_tokens
        idx = nc // bs
        old_len = len(table)
        shared = idx < old_len and pool.blocks[table[idx]].ref_cnt > 1
        extra = -(-(nc + num_tokens) // bs) - old_len
        if shared + max(extra, 0) > pool.num_free:
            return None
        replaced = None
        if shared:
            old = pool.blocks[table[idx]]
            new = pool.allocate()
            if nc % bs:
                # Earlier tokens of this block are computed: the copy must carry them.
                copies.append((old.block_id, new.block_id))
            table[idx] = new.block_id
            pool.release(old)
            replaced = (idx, new.block_id)
        new_ids: list[int] = []
        for _ in range(extra):
            bid = pool.allocate().block_id
            table.append(bid)
            new_ids.append(bid)
        # Block idx is seq's own now, and so is everything appended; blocks that were already
        # past idx are not vouched for here (the next grow() checks them).
        seq.exclusive_until = (len(table) if old_len <= idx + 1 else idx + 1) * bs
        return new_ids, replaced

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register seq's newly full and computed blocks in the prefix cache."""
        num_full = seq.num_computed_tokens // self.block_size
        start = seq.num_cached_blocks
        if num_full <= start or not self.enable_prefix_caching:
            return
        self.ensure_hashes(seq, num_full)
        blocks = self.pool.blocks
        table = seq.block_table
        for i in range(start, num_full):
            self.pool.register(blocks[table[i]], seq.block_hashes[i])
        seq.num_cached_blocks = num_full

    # ------------------------------------------------------------------ release

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back seq's blocks past those its first `num_tokens` tokens need (slots of
        extra query positions whose tokens a step did not keep). Only blocks no token of seq is
        computed in go: they are neither cached nor shared (grow() made them seq's own), so they
        return to the free list."""
        keep = self.num_blocks_for(num_tokens)
        table = seq.block_table
        if keep >= len(table):
            return
        assert keep * self.block_size >= seq.num_computed_tokens, "truncating computed slots"
        blocks = self.pool.blocks
        for bid in reversed(table[keep:]):
            self.pool.release(blocks[bid])
        del table[keep:]
        seq.exclusive_until = min(seq.exclusive_until, keep * self.block_size)

    def free(self, seq: Sequence) -> None:
        """Drop seq's device and CPU blocks. Its hashed blocks stay in the prefix cache."""
        blocks = self.pool.blocks
        # Last block first: the tail of a sequence is the least likely part to be shared, so it
        # should reach the eviction end of the free list first.
        for bid in reversed(seq.block_table):
            self.pool.release(blocks[bid])
        seq.block_table = []
        seq.exclusive_until = 0
        for cpu in seq.cpu_block_table:
            self._release_cpu(cpu)
        seq.cpu_block_table = []
        self._holders.pop(seq.seq_id, None)

    def _release_cpu(self, cpu: int) -> None:
        self._cpu_ref[cpu] -= 1
        if self._cpu_ref[cpu] == 0:
            self._cpu_free.append(cpu)

    # ------------------------------------------------------------------ swap

    @staticmethod
    def _distinct(tables: Iterable[list[int]]) -> int:
        return len({b for t in tables for b in t})

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        return self._distinct(s.block_table for s in seqs) <= len(self._cpu_free)

    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Move the seqs' blocks to the CPU pool; returns (device, cpu) copies to run.

        A block shared among the seqs is copied once and keeps its sharing on the CPU side.
        """
        mapping: dict[int, int] = {}
        for seq in seqs:
            cpu_table = []
            for bid in seq.block_table:
                cpu = mapping.get(bid)
                if cpu is None:
                    cpu = mapping[bid] = self._cpu_free.pop()
                self._cpu_ref[cpu] += 1
                cpu_table.append(cpu)
            for bid in reversed(seq.block_table):
                self.pool.release(self.pool.blocks[bid])
            seq.block_table = []
            seq.exclusive_until = 0
            seq.cpu_block_table = cpu_table
        return list(mapping.items())

    def num_blocks_to_swap_in(self, seqs: list[Sequence]) -> int:
        return self._distinct(s.cpu_block_table for s in seqs)

    def swap_in(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Move the seqs' blocks back to the device; returns (cpu, device) copies to run."""
        mapping: dict[int, Block] = {}
        pool = self.pool
        for seq in seqs:
            table = []
            for cpu in seq.cpu_block_table:
                block = mapping.get(cpu)
                if block is None:
                    block = mapping[cpu] = pool.allocate()
                else:
                    pool.touch(block)
                table.append(block.block_id)
                self._release_cpu(cpu)
            seq.cpu_block_table = []
            seq.block_table = table
            seq.exclusive_until = 0  # siblings may share blocks again after swap-in
            if self.enable_prefix_caching:
                # The content is back on the device: make it findable again if nobody else
                # holds the same hash.
                for i in range(seq.num_cached_blocks):
                    pool.register(pool.blocks[table[i]], seq.block_hashes[i])
        return [(cpu, block.block_id) for cpu, block in mapping.items()]

    # ------------------------------------------------------------------ reset / checks

    def reset(self) -> None:
        """Forget every table and all cached content (the executor lost its KV cache)."""
        for seq in self._holders.values():
            seq.block_table = []
            seq.cpu_block_table = []
            seq.exclusive_until = 0
        self._holders.clear()
        self.pool.reset()
        if self.host_tier is not None:
            self.host_tier.reset()
        self._cpu_ref = [0] * self.num_cpu_blocks
        # A stack popped from the end: lowest id first, so runs are reproducible.
        self._cpu_free = list(range(self.num_cpu_blocks - 1, -1, -1))

    def check_invariants(self, *, expect_empty: bool = False) -> None:
        """Raise AssertionError if ref counts, tables and free lists disagree.

        With expect_empty (every request finished or aborted), every block must be free.
        """
        self.pool.check()
        if self.host_tier is not None:
            self.host_tier.check()
        ref = [0] * self.num_device_blocks
        cpu_ref = [0] * self.num_cpu_blocks
        for seq_id, seq in self._holders.items():
            assert seq.seq_id == seq_id
            assert not (seq.block_table and seq.cpu_block_table), f"{seq_id} on device and CPU"
            assert len(set(seq.block_table)) == len(seq.block_table), f"{seq_id} repeats a block"
            for bid in seq.block_table:
                ref[bid] += 1
            for cpu in seq.cpu_block_table:
                cpu_ref[cpu] += 1
        for block in self.pool.blocks:
            assert block.ref_cnt == ref[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {ref[block.block_id]}"
            )
        assert cpu_ref == self._cpu_ref, "CPU ref counts disagree with CPU tables"
        free = set(self._cpu_free)
        assert len(free) == len(self._cpu_free), "a CPU block is free twice"
        assert free == {i for i, r in enumerate(cpu_ref) if r == 0}, "CPU free list is wrong"
        if expect_empty:
            assert not self._holders, f"still holding blocks: {sorted(self._holders)}"
            assert self.pool.num_free == self.num_device_blocks
            assert len(self._cpu_free) == self.num_cpu_blocks
