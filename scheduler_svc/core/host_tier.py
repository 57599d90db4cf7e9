"""Host-memory prefix tier: prefix blocks evicted from the device cache kept in CPU blocks.

The tier owns a fixed range of the executor's CPU pool (the top `num_blocks` ids; swap for
preemption keeps the rest), so it never competes with swap and needs no executor changes: it
speaks the step's existing swap lists. When the device pool hands out a free block that still
holds cached content, `on_evict` adds a (device, host) pair to the step's swap-out; a prefix
lookup that misses on the device but finds the hash here gets a fresh device block and a
(host, device) pair in the step's swap-in. The executor applies all swap-outs, then all
swap-ins, then copies, then the forward, and that order makes one step self-consistent:

- an evicted block is read before anything of the step writes into it;
- content evicted and looked up again in the same step is swapped out before it is swapped in;
- no host block is both read and written, or written twice, in one step: every host block a
  step touches is pinned until the step's pairs are taken (`take_transfers`), and LRU eviction
  in the tier skips pinned entries.

Entries are kept after a copy-in (the tier is inclusive): the device copy evicted again later
costs no second copy-out. Copies are bit-exact, so outputs with the tier are identical to
outputs without it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["HostHit", "HostTier"]


@dataclass(slots=True, frozen=True)
class HostHit:
    """A prefix block found in the host tier (not on the device): a copy-in at allocation."""

    block_hash: bytes
    host_block: int  # CPU block id holding the content


class HostTier:
    def __init__(self, first_block: int, num_blocks: int) -> None:
        self.first_block = first_block  # CPU block ids [first_block, first_block + num_blocks)
        self.num_blocks = num_blocks
        # block hash -> host block, least recently used first.
        self._lru: OrderedDict[bytes, int] = OrderedDict()
        self._free: list[int] = []
        # The step being planned: its pairs, and the host / device blocks they touch.
        self._swap_out: list[tuple[int, int]] = []  # (device, host)
        self._swap_in: list[tuple[int, int]] = []  # (host, device)
        self._pinned: set[int] = set()
        self._step_device: set[int] = set()
        self.num_stored = 0  # blocks copied device -> host
        self.num_loaded = 0  # blocks copied host -> device
        self.num_dropped = 0  # evicted device blocks not stored (every host block pinned)
        self.reset()

    def __len__(self) -> int:
        return len(self._lru)

    def reset(self) -> None:
        """Empty (the executor lost its memory, or the scheduler forgot what it sent)."""
        self._lru.clear()
        # A stack popped from the end: lowest id first, so runs are reproducible.
        self._free = list(range(self.first_block + self.num_blocks - 1, self.first_block - 1, -1))
        self._swap_out.clear()
        self._swap_in.clear()
        self._pinned.clear()
        self._step_device.clear()

    def lookup(self, block_hash: bytes) -> int | None:
        return self._lru.get(block_hash)

    def on_evict(self, block_id: int, block_hash: bytes) -> None:
        """A device block holding `block_hash` is being handed out: keep its content here."""
        lru = self._lru
        if block_hash in lru:
            lru.move_to_end(block_hash)
            return
        if block_id in self._step_device:
            # Written by this step's swap-in: it holds nothing yet when the swap-outs run.
            self.num_dropped += 1
            return
        host = self._take()
        if host is None:
            self.num_dropped += 1
            return
        lru[block_hash] = host
        self._swap_out.append((block_id, host))
        self._pinned.add(host)
        self._step_device.add(block_id)
        self.num_stored += 1

    def pin(self, hit: HostHit) -> None:
        """Keep a looked-up entry from being reused before its copy-in is planned."""
        assert self._lru.get(hit.block_hash) == hit.host_block, "stale host-tier hit"
        self._pinned.add(hit.host_block)

    def load(self, hit: HostHit, block_id: int) -> None:
        """Copy a pinned entry into device block `block_id` in this step."""
        self._lru.move_to_end(hit.block_hash)
        self._swap_in.append((hit.host_block, block_id))
        self._step_device.add(block_id)
        self.num_loaded += 1

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The planned step's (device, host) swap-outs and (host, device) swap-ins; the next
        step starts unpinned."""
        out, self._swap_out = self._swap_out, []
        into, self._swap_in = self._swap_in, []
        self._pinned.clear()
        self._step_device.clear()
        return out, into

    def _take(self) -> int | None:
        """A host block to write into: a free one, else the least recently used unpinned."""
        if self._free:
            return self._free.pop()
        for block_hash, host in self._lru.items():
            if host not in self._pinned:
                del self._lru[block_hash]
                return host
        return None

    def check(self) -> None:
        held = list(self._lru.values())
        assert len(set(held)) == len(held), "a host block holds two hashes"
        assert not set(held) & set(self._free), "a host block is both free and held"
        ids = set(held) | set(self._free)
        assert len(ids) == self.num_blocks, f"host tier lost blocks: {self.num_blocks - len(ids)}"
        assert all(self.first_block <= b < self.first_block + self.num_blocks for b in ids)
