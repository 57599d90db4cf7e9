"""Device block pool: O(1) allocate/free through an intrusive free list, and the prefix cache.

A freed block keeps its content hash and stays findable until it is handed out again. The free
list is ordered for that: blocks with no hash (nothing worth keeping) go to the front and are
reused first; hashed blocks go to the back, so the front-most hashed block is always the least
recently freed one, and eviction is least-recently-used first at no extra cost.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from hashlib import blake2b


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Chained hash of (parent block hash, this block's token ids) once the block is full and
        # computed; kept after the block is freed so a later request can hit it.
        self.block_hash: bytes | None = None
        # Free-list links; None when the block is in use.
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref_cnt={self.ref_cnt})"


def hash_block_tokens(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    """Chained content hash of one full block.

    A cryptographic hash (not Python's hash()) so that a crafted prompt cannot collide with
    another request's prefix and read its KV cache. Only run when a block fills.
    """
    h = blake2b(parent_hash or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Sentinels bracket the free list so that link/unlink never test for None.
        self._head = Block(-1)
        self._tail = Block(-1)
        self.cached: dict[bytes, Block] = {}  # block hash -> block holding that content
        self.num_evictions = 0
        # Called with (block id, hash) before a free block's cached content is overwritten (the
        # host tier keeps a copy); None: the content is simply lost.
        self.on_evict: Callable[[int, bytes], None] | None = None
        self.reset()

    def reset(self) -> None:
        """Every block free, in id order, and the cache empty (the executor lost its KV)."""
        self.cached.clear()
        prev = self._head
        for block in self.blocks:
            block.ref_cnt = 0
            block.block_hash = None
            prev.next_free = block
            block.prev_free = prev
            prev = block
        prev.next_free = self._tail
        self._tail.prev_free = prev
        self.num_free = self.num_blocks

    def allocate(self) -> Block:
        """Take the front block of the free list, evicting its cached content if any."""
        block = self._head.next_free
        if block is self._tail:
            raise RuntimeError("no free device block (the caller must check num_free first)")
        self._unlink(block)
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.on_evict is not None:
                    self.on_evict(block.block_id, block.block_hash)
            block.block_hash = None
            self.num_evictions += 1
        block.ref_cnt = 1
        return block

    def touch(self, block: Block) -> None:
        """Take one more reference (a prefix-cache hit or a fork)."""
        if block.ref_cnt == 0:
            self._unlink(block)
        block.ref_cnt += 1

    def release(self, block: Block) -> None:
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            if block.block_hash is None:
                self._link_after(self._head, block)
            else:
                self._link_after(self._tail.prev_free, block)
            self.num_free += 1

    def register(self, block: Block, block_hash: bytes) -> None:
        """Make a full, computed block findable by its hash (first holder of a hash wins)."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def lookup(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash)

    def free_block_ids(self) -> list[int]:
        """Free blocks in the order they would be handed out (front first)."""
        out = []
        block = self._head.next_free
        while block is not self._tail:
            out.append(block.block_id)
            block = block.next_free
        return out

    def _unlink(self, block: Block) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def _link_after(self, prev: Block, block: Block) -> None:
        nxt = prev.next_free
        prev.next_free = block
        block.prev_free = prev
        block.next_free = nxt
        nxt.prev_free = block

    def check(self) -> None:
        """Free list and cache map are consistent with the blocks' own fields."""
        seen = set()
        prev = self._head
        block = self._head.next_free
        while block is not self._tail:
            assert block.prev_free is prev, f"broken back link at block {block.block_id}"
            assert block.block_id not in seen, f"block {block.block_id} twice in the free list"
            assert block.ref_cnt == 0, f"block {block.block_id} free with ref_cnt {block.ref_cnt}"
            seen.add(block.block_id)
            prev, block = block, block.next_free
        assert self._tail.prev_free is prev, "broken tail link"
        assert len(seen) == self.num_free, f"free count {self.num_free} != list {len(seen)}"
        for b in self.blocks:
            if b.ref_cnt == 0:
                assert b.block_id in seen, f"block {b.block_id} has ref_cnt 0 but is not free"
            else:
                assert b.prev_free is None and b.next_free is None
        for h, b in self.cached.items():
            assert b.block_hash == h, f"cache entry points at block {b.block_id} with other hash"
