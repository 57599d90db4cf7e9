"""Block pool and block manager: free-list order, LRU eviction, prefix hits, CoW, swap, checks."""

import pytest

from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.block_pool import hash_block_tokens
from scheduler_svc.core.request import Sequence


def make_bm(**kw) -> BlockManager:
    args = dict(block_size=4, num_device_blocks=8, num_cpu_blocks=4, enable_prefix_caching=True)
    args.update(kw)
    return BlockManager(**args)


def make_seq(tokens: list[int], name: str = "s") -> Sequence:
    return Sequence(f"{name}/0", name, 0, list(tokens), len(tokens), None)


def computed(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> Sequence:
    """Allocate seq's blocks and mark everything computed, as after a finished prefill."""
    bm.allocate(seq, [], len(seq.token_ids))
    seq.num_computed_tokens = len(seq.token_ids) if num_tokens is None else num_tokens
    bm.cache_full_blocks(seq)
    return seq


def test_allocate_and_free_return_blocks_in_id_order():
    bm = make_bm()
    seq = make_seq(range(10))
    bm.allocate(seq, [], 10)
    assert seq.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 5
    bm.free(seq)
    assert seq.block_table == []
    # Unhashed blocks go to the front (reused first), last block first.
    assert bm.pool.free_block_ids() == [0, 1, 2, 3, 4, 5, 6, 7]
    bm.check_invariants(expect_empty=True)


def test_freed_hashed_blocks_are_evicted_least_recently_used_first():
    bm = make_bm()
    a = computed(bm, make_seq([1, 1, 1, 1, 2, 2, 2, 2], "a"))
    b = computed(bm, make_seq([3, 3, 3, 3, 4, 4, 4, 4], "b"))
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    bm.free(a)
    bm.free(b)
    # Unused blocks first, then a's blocks (freed earlier), tail block before prefix block.
    assert bm.pool.free_block_ids() == [4, 5, 6, 7, 1, 0, 3, 2]

    c = make_seq(range(100, 120), "c")  # 5 blocks, no hit
    bm.allocate(c, bm.find_cached_prefix(c, 19), 20)
    assert c.block_table == [4, 5, 6, 7, 1]
    assert bm.pool.num_evictions == 1

    # a lost its second block, b kept both.
    a2 = make_seq([1, 1, 1, 1, 2, 2, 2, 2, 9], "a2")
    b2 = make_seq([3, 3, 3, 3, 4, 4, 4, 4, 9], "b2")
    assert [blk.block_id for blk in bm.find_cached_prefix(a2, 8)] == [0]
    assert [blk.block_id for blk in bm.find_cached_prefix(b2, 8)] == [2, 3]


def test_prefix_hit_shares_blocks_and_skips_computation():
    bm = make_bm()
    a = computed(bm, make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "a"))
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 42], "b")
    hits = bm.find_cached_prefix(b, len(b.token_ids) - 1)
    assert [blk.block_id for blk in hits] == [0, 1]
    bm.allocate(b, hits, len(b.token_ids))
    assert b.block_table == [0, 1, 3]
    assert b.num_computed_tokens == 8
    assert [bm.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10 + 9, 8)
    bm.free(a)
    bm.free(b)
    bm.check_invariants(expect_empty=True)


def test_prefix_hit_never_covers_the_tokens_to_compute():
    bm = make_bm()
    computed(bm, make_seq(range(8), "a"))
    same = make_seq(range(8), "b")
    # An identical 8-token prompt may reuse only its first block: one token must be computed.
    assert [blk.block_id for blk in bm.find_cached_prefix(same, 7)] == [0]


def test_only_full_computed_blocks_are_cached():
    bm = make_bm()
    a = computed(bm, make_seq(range(10), "a"), num_tokens=6)
    assert a.num_cached_blocks == 1
    assert len(bm.pool.cached) == 1
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    assert a.num_cached_blocks == 2 and len(bm.pool.cached) == 2


def test_hashes_are_chained_on_the_prefix():
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    bm = make_bm()
    computed(bm, make_seq([1, 2, 3, 4, 5, 6, 7, 8], "a"))
    other_prefix = make_seq([0, 2, 3, 4, 5, 6, 7, 8, 9], "b")
    assert bm.find_cached_prefix(other_prefix, 8) == []


def test_prefix_caching_off_never_hashes():
    bm = make_bm(enable_prefix_caching=False)
    a = computed(bm, make_seq(range(8), "a"))
    assert a.block_hashes == [] and not bm.pool.cached
    assert bm.find_cached_prefix(make_seq(range(9), "b"), 8) == []


def forked_pair(bm: BlockManager, prompt_len: int) -> tuple[Sequence, Sequence]:
    parent = make_seq(range(prompt_len), "p")
    bm.allocate(parent, [], prompt_len)
    parent.num_computed_tokens = prompt_len - 1
    child = make_seq(range(prompt_len), "c")
    child.num_computed_tokens = prompt_len - 1
    bm.fork(parent, [child])
    return parent, child


def test_copy_on_write_of_shared_partly_filled_block():
    bm = make_bm()
    parent, child = forked_pair(bm, 6)
    assert child.block_table == [0, 1]
    assert [bm.pool.blocks[i].ref_cnt for i in (0, 1)] == [2, 2]
    assert bm.num_blocks_to_compute([parent, child]) == 1  # the last holder writes in place
    copies: list[tuple[int, int]] = []
    assert bm.grow(parent, 1, copies) == ([], (1, 2))
    assert bm.grow(child, 1, copies) == ([], None)
    assert copies == [(1, 2)]  # position 4 is computed: it must travel with the copy
    assert (parent.block_table, child.block_table) == ([0, 2], [0, 1])
    assert [bm.pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [2, 1, 1]
    bm.check_invariants()


def test_copy_on_write_without_copy_when_nothing_in_the_block_is_computed():
    bm = make_bm()
    parent, child = forked_pair(bm, 5)  # position 4 opens block 1
    copies: list[tuple[int, int]] = []
    assert bm.grow(parent, 1, copies) == ([], (1, 2))
    assert copies == []


def test_append_block_when_the_last_one_is_full():
    bm = make_bm()
    seq = make_seq(range(9))
    bm.allocate(seq, [], 8)
    seq.num_computed_tokens = 8
    assert bm.num_blocks_to_compute([seq]) == 1
    assert bm.grow(seq, 1, []) == ([2], None)
    assert seq.block_table == [0, 1, 2]


def test_swap_out_and_in_keep_sharing_within_the_request():
    bm = make_bm()
    parent, child = forked_pair(bm, 6)
    bm.grow(parent, 1, [])
    assert (parent.block_table, child.block_table) == ([0, 2], [0, 1])
    assert bm.can_swap_out([parent, child])
    assert bm.swap_out([parent, child]) == [(0, 0), (2, 1), (1, 2)]
    assert (parent.cpu_block_table, child.cpu_block_table) == ([0, 1], [0, 2])
    assert bm.num_free_blocks == 8 and bm.num_free_cpu_blocks == 1
    bm.check_invariants()
    assert bm.num_blocks_to_swap_in([parent, child]) == 3
    assert bm.swap_in([parent, child]) == [(0, 0), (1, 1), (2, 2)]
    assert (parent.block_table, child.block_table) == ([0, 1], [0, 2])
    assert bm.pool.blocks[0].ref_cnt == 2
    assert bm.num_free_cpu_blocks == 4
    bm.check_invariants()


def test_swap_out_needs_room_in_the_cpu_pool():
    bm = make_bm(num_cpu_blocks=2)
    seq = make_seq(range(12))
    bm.allocate(seq, [], 12)
    assert not bm.can_swap_out([seq])


def test_watermark_and_usage():
    bm = make_bm(num_device_blocks=10, watermark=0.2)
    assert bm.watermark_blocks == 2
    bm.allocate(make_seq(range(8)), [], 8)
    assert bm.usage == pytest.approx(0.2)


def test_check_invariants_catches_corruption_and_leaks():
    bm = make_bm()
    seq = make_seq(range(6))
    bm.allocate(seq, [], 6)
    bm.check_invariants()
    with pytest.raises(AssertionError, match="still holding"):
        bm.check_invariants(expect_empty=True)
    bm.pool.blocks[0].ref_cnt = 2
    with pytest.raises(AssertionError, match="ref_cnt"):
        bm.check_invariants()


def test_reset_forgets_tables_and_cached_content():
    bm = make_bm()
    a = computed(bm, make_seq(range(9), "a"))
    bm.reset()
    assert a.block_table == [] and bm.num_free_blocks == 8
    assert bm.find_cached_prefix(make_seq(range(9), "b"), 8) == []
    bm.check_invariants(expect_empty=True)


def test_group_allocation_takes_every_hit_before_any_fresh_block():
    bm = make_bm(num_device_blocks=5)
    for k, name in enumerate("abc"):
        bm.free(computed(bm, make_seq(range(4 * k, 4 * k + 4), name)))
    assert bm.pool.free_block_ids() == [3, 4, 0, 1, 2]
    s1 = make_seq([20] * 12, "s1")
    s2 = make_seq([0, 1, 2, 3, 30], "s2")
    hits = [bm.find_cached_prefix(s1, 11), bm.find_cached_prefix(s2, 4)]
    assert [[b.block_id for b in h] for h in hits] == [[], [0]]
    # Taken one sequence at a time, s1's third block would evict block 0 under s2's hit.
    bm.allocate_group([s1, s2], hits, [12, 5])
    assert (s1.block_table, s2.block_table) == ([3, 4, 1], [0, 2])
    assert s2.num_computed_tokens == 4
    bm.check_invariants()
