"""Host-memory prefix tier (core/host_tier.py): what an eviction stores, what a lookup loads, LRU
order and bounds, pins within a step, swap beside it, no leaks; and random multi-turn workloads
against the fake executor of test_scheduler_property, which checks every KV slot read."""

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.block_pool import Block
from scheduler_svc.core.host_tier import HostHit
from scheduler_svc.core.request import Request, RequestStatus, Sequence
from scheduler_svc.core.sampling_params import SamplingParams
from tests.unit.test_scheduler import add, make_scheduler, step
from tests.unit.test_scheduler_property import config_st, run_workload


def make_bm(**kw) -> BlockManager:
    args = dict(block_size=4, num_device_blocks=4, num_cpu_blocks=6, num_host_cache_blocks=2)
    args.update(kw)
    return BlockManager(**args)


def make_seq(tokens, name: str = "s") -> Sequence:
    tokens = list(tokens)
    return Sequence(f"{name}/0", name, 0, tokens, len(tokens), None)


def run(bm: BlockManager, seq: Sequence) -> Sequence:
    """Admit seq with whatever it hits and mark its prompt computed, as after its prefill."""
    bm.allocate(seq, bm.find_cached_prefix(seq, len(seq.token_ids) - 1), len(seq.token_ids))
    seq.num_computed_tokens = len(seq.token_ids)
    bm.cache_full_blocks(seq)
    return seq


def kinds(hits) -> list[str]:
    return ["host" if isinstance(h, HostHit) else "device" for h in hits]


def test_an_evicted_prefix_block_is_copied_out_and_a_later_hit_copies_it_in():
    bm = make_bm()
    a = run(bm, make_seq([1] * 4 + [2] * 4 + [3], "a"))  # blocks 0, 1 cached, 2 partial
    bm.free(a)
    assert bm.take_host_transfers() == ([], [])
    b = run(bm, make_seq(range(100, 113), "b"))  # 4 blocks: evicts a's 2 cached blocks
    # The CPU pool's top two ids (4, 5) are the tier's; a's tail block went first (LRU).
    assert bm.take_host_transfers() == ([(1, 4), (0, 5)], [])
    bm.free(b)

    a2 = make_seq([1] * 4 + [2] * 4 + [9, 9], "a2")
    hits = bm.find_cached_prefix(a2, 9)
    assert kinds(hits) == ["host", "host"]
    assert [h.host_block for h in hits] == [5, 4]
    assert bm.holds_prefix_block(a2.block_hashes[1])
    bm.allocate(a2, hits, 10)
    assert a2.num_computed_tokens == 8  # nothing of the prefix is recomputed
    out, into = bm.take_host_transfers()
    # Loading evicted b's cached blocks on the way (they were LRU on the device).
    assert into == [(5, a2.block_table[0]), (4, a2.block_table[1])]
    assert {dev for dev, _ in out} <= {0, 1, 2, 3}
    assert bm.prefix_cache_host_hits == 8
    assert bm.prefix_cache_hits == 8  # host hits are hits too
    # On the device again: a third request hits the device copies.
    bm.free(a2)
    a3 = make_seq([1] * 4 + [2] * 4 + [7], "a3")
    assert kinds(bm.find_cached_prefix(a3, 8)) == ["device", "device"]
    bm.check_invariants(expect_empty=True)


def test_the_tier_is_bounded_and_least_recently_used_goes_first():
    bm = make_bm(num_device_blocks=2, num_host_cache_blocks=2)
    prompts = [[k] * 4 + [0] for k in (1, 2, 3)]  # one cached block each
    for k, p in enumerate(prompts):
        bm.free(run(bm, make_seq(p, f"p{k}")))
    bm.take_host_transfers()
    # p0's block evicted by p1's tail, p1's by p2's: both in the tier, which is full.
    assert len(bm.host_tier) == 2
    # A hit on p0 makes it the most recently used ...
    p0 = make_seq(prompts[0], "again")
    assert kinds(bm.find_cached_prefix(p0, 4)) == ["host"]
    bm.free(run(bm, p0))
    bm.take_host_transfers()
    # ... so filling the tier further drops p1 (least recently used), not p0.
    for k in (4, 5):
        bm.free(run(bm, make_seq([k] * 4 + [0], f"q{k}")))
        bm.take_host_transfers()
    assert len(bm.host_tier) == 2
    hit = {k: kinds(bm.find_cached_prefix(make_seq(p, "x"), 4)) for k, p in enumerate(prompts)}
    assert hit[1] == []
    bm.check_invariants(expect_empty=True)


def test_a_host_block_read_in_a_step_is_not_overwritten_in_the_same_step():
    bm = make_bm(num_device_blocks=3, num_host_cache_blocks=1)
    bm.free(run(bm, make_seq([1] * 4 + [0], "a")))
    bm.free(run(bm, make_seq([2] * 8 + [0], "b")))  # evicts a's block into host block 5
    assert bm.take_host_transfers() == ([(0, 5)], [])
    # One step: a's block comes back from host block 5 (pinned now), and the allocation that
    # takes the device for it evicts b's content, which finds no unpinned host block.
    a2 = make_seq([1] * 4 + [0], "a2")
    bm.allocate(a2, bm.find_cached_prefix(a2, 4), 5)
    out, into = bm.take_host_transfers()
    assert into == [(5, a2.block_table[0])]
    assert all(cpu != 5 for _, cpu in out)
    assert bm.host_tier.num_dropped == 1
    bm.free(a2)
    bm.check_invariants(expect_empty=True)


def test_swap_keeps_its_own_blocks_beside_the_tier():
    bm = make_bm(num_device_blocks=4, num_cpu_blocks=5, num_host_cache_blocks=3)
    assert bm.num_cpu_blocks == 2 and bm.num_free_cpu_blocks == 2
    seq = run(bm, make_seq(range(12), "s"))  # 3 blocks
    assert not bm.can_swap_out([seq])  # 3 blocks, 2 swap blocks: the tier's are not lent
    small = make_seq(range(50, 55), "t")
    bm.free(seq)
    run(bm, small)
    assert bm.can_swap_out([small])
    pairs = bm.swap_out([small])
    assert all(cpu < 2 for _, cpu in pairs)
    back = bm.swap_in([small])
    assert sorted(cpu for cpu, _ in back) == sorted(cpu for _, cpu in pairs)
    bm.free(small)
    bm.check_invariants(expect_empty=True)
    assert bm.num_free_cpu_blocks == 2


def test_without_prefix_caching_there_is_no_tier_and_reset_empties_it():
    assert make_bm(enable_prefix_caching=False).host_tier is None
    bm = make_bm()
    bm.free(run(bm, make_seq([1] * 4 + [0], "a")))
    run(bm, make_seq(range(100, 116), "b"))
    assert len(bm.host_tier) == 1
    bm.reset()
    assert len(bm.host_tier) == 0 and bm.take_host_transfers() == ([], [])
    bm.check_invariants(expect_empty=True)


def test_sequences_of_one_request_hitting_the_same_host_block_share_one_copy():
    bm = make_bm(num_device_blocks=4)
    bm.free(run(bm, make_seq([1] * 4 + [0], "a")))
    bm.free(run(bm, make_seq(range(100, 116), "b")))
    bm.take_host_transfers()
    s1, s2 = make_seq([1] * 4 + [5], "c"), make_seq([1] * 4 + [6], "d")
    hits = [bm.find_cached_prefix(s, 4) for s in (s1, s2)]
    bm.allocate_group([s1, s2], hits, [5, 5])
    _, into = bm.take_host_transfers()
    assert len(into) == 1 and s1.block_table[0] == s2.block_table[0]
    assert bm.pool.blocks[s1.block_table[0]].ref_cnt == 2
    assert isinstance(bm.find_cached_prefix(make_seq([1] * 4 + [7]), 4)[0], Block)
    bm.free(s1)
    bm.free(s2)
    bm.check_invariants(expect_empty=True)


_turn = st.fixed_dictionaries(
    {
        "conv": st.integers(0, 3),
        "new": st.lists(st.integers(0, 2), min_size=1, max_size=6),
        "n": st.sampled_from([1, 1, 2]),
        "max_tokens": st.integers(1, 5),
        "priority": st.integers(0, 1),
        "abort_at": st.one_of(st.none(), st.integers(0, 40)),
        "abort_in_flight": st.booleans(),
        "eos_stop": st.just(False),
    }
)


def _conversations(turns: list[dict]) -> list[dict]:
    """Each turn's prompt is its conversation so far plus new text; the 'answer' appended to
    the history is fixed (the fake executor samples its own)."""
    history: dict[int, list[int]] = {}
    reqs = []
    for i, turn in enumerate(turns):
        prompt = history.get(turn["conv"], []) + turn["new"]
        history[turn["conv"]] = prompt + [i % 3, (i + 1) % 3]
        reqs.append(dict(turn, prompt=prompt[:20], arrival=2 * i))
    return reqs


@settings(max_examples=150, deadline=None)
@given(
    cfg=config_st,
    host=st.integers(1, 10),
    turns=st.lists(_turn, min_size=2, max_size=10),
    reset_at=st.one_of(st.none(), st.integers(1, 20)),
    ahead=st.booleans(),
)
def test_multi_turn_workloads_with_the_tier_read_only_their_own_kv(
    cfg, host, turns, reset_at, ahead
):
    cfg = dict(cfg, num_host_cache_blocks=host, enable_prefix_caching=True)
    cfg["num_cpu_blocks"] = max(cfg["num_cpu_blocks"], host)
    run_workload(cfg, _conversations(turns), reset_at, ahead)


def _serve(sched, rid: str, prompt: list[int]):
    """Run a request to its first token and finish it there; returns the first step."""
    add(sched, [Request(rid, prompt, SamplingParams(max_tokens=1))])
    out = step(sched)
    sched.finish_sequence(f"{rid}/0", RequestStatus.FINISHED_LENGTH)
    return out


def test_the_scheduler_puts_the_tiers_copies_in_the_step_that_needs_them():
    sched = make_scheduler(
        enable_prefix_caching=True, num_device_blocks=6, num_cpu_blocks=4, num_host_cache_blocks=4
    )
    prompt = list(range(1, 10))  # 2 full blocks + 1 token
    out = _serve(sched, "a", prompt)
    assert not (out.blocks_to_swap_out or out.blocks_to_swap_in)
    # b takes every device block: a's two cached blocks go to the host in b's step.
    out = _serve(sched, "b", list(range(100, 123)))
    (b,) = out.new_seqs
    assert sorted(out.blocks_to_swap_out) == [(0, 1), (1, 0)]  # a's blocks 0 and 1
    assert out.blocks_to_swap_in == []
    # a's prompt again: both blocks come back from the host, only the last token is computed.
    out = _serve(sched, "a2", prompt)
    (a2,) = out.new_seqs
    assert a2.num_computed_tokens == 8 and a2.num_scheduled_tokens == 1
    assert out.blocks_to_swap_in == [(1, a2.block_table[0]), (0, a2.block_table[1])]
    # The device blocks it took held b's cached blocks: those went to the two free host
    # blocks, not to 0 or 1, which this step reads.
    assert sorted(cpu for _, cpu in out.blocks_to_swap_out) == [2, 3]
    assert sched.get_stats().prefix_cache_host_hits == 8
    step(sched)  # the drop of a2
    sched.check_invariants()
    assert sched.num_free_blocks == 6 and sched.num_unfinished == 0
