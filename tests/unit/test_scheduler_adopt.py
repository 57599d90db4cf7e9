"""Moving a running request between two executors' scheduler cores (live migration, issue 47):
`movable_requests`, `adopt_request` (blocks for the computed tokens, prefix-cache hits first),
`release_request` (no finish reported), and the undo of an adoption."""

from scheduler_svc.core.request import RequestStatus
from tests.unit.test_scheduler import TOKEN, add, make_requests, make_scheduler, step


def decoding_on_a(num: int = 2, prompt_len: int = 6, num_decodes: int = 3):
    """Core A with `num` requests decoding; core B empty."""
    a, b = make_scheduler(enable_prefix_caching=True), make_scheduler(enable_prefix_caching=True)
    reqs = add(a, make_requests(num, prompt_len))
    for _ in range(1 + num_decodes):
        step(a)
    return a, b, reqs


def test_movable_requests_are_the_running_single_sequence_ones():
    a, _, reqs = decoding_on_a()
    add(a, make_requests(1, 4, start=5, n=2))  # n > 1: not movable (shared blocks)
    step(a)
    assert [r.req_id for r in a.movable_requests()] == ["r0", "r1"]


def test_adopt_then_release_moves_the_request_with_its_computed_tokens():
    a, b, _ = decoding_on_a()
    old = a.get_request("r0")
    nc = old.seqs[0].num_computed_tokens
    assert nc == 6 + 3 and old.seqs[0].token_ids[6:] == [TOKEN] * 4
    new, num_hits = b.adopt_request(old)
    assert num_hits == 0  # B's cache holds nothing of it
    seq = new.seqs[0]
    assert seq.num_computed_tokens == nc and seq.token_ids == old.seqs[0].token_ids
    assert len(seq.block_table) == 3  # ceil(9 / 4): the computed tokens only
    assert a.release_request("r0")
    assert a.take_finished_requests() == []  # released, not finished
    a.check_invariants()
    b.check_invariants()
    out_a = step(a)
    assert "r0/0" in out_a.finished_seq_ids and "r0/0" not in out_a.num_scheduled_tokens
    out_b = step(b)
    (entry,) = out_b.new_seqs  # B's executor learns it in full, computed tokens included
    assert (entry.seq_id, entry.num_computed_tokens, entry.num_scheduled_tokens) == ("r0/0", 9, 1)
    assert entry.block_table == seq.block_table and entry.token_ids == old.seqs[0].token_ids
    step(b)
    assert seq.num_computed_tokens == 11 and seq.num_output_tokens == 6
    assert b.block_manager.pool.cached  # its full blocks entered B's prefix cache


def test_an_undone_adoption_frees_its_blocks_and_registers_nothing():
    a, b, _ = decoding_on_a()
    new, _ = b.adopt_request(a.get_request("r1"))
    assert b.num_free_blocks == 16 - 3
    assert b.release_request("r1")
    assert b.num_free_blocks == 16 and not b.block_manager.pool.cached
    assert b.take_finished_requests() == [] and b.num_unfinished == 0
    b.check_invariants()
    assert a.get_request("r1").status == RequestStatus.RUNNING  # still A's, untouched


def test_adoption_uses_the_destination_prefix_cache_and_respects_its_room():
    a, b, _ = decoding_on_a(num=1, prompt_len=8)
    # B computed the same 8-token prompt once: two full blocks cached there.
    add(b, make_requests(1, 8))
    step(b)
    step(b)
    b.abort_request("r0")
    b.take_finished_requests()
    step(b)
    new, num_hits = b.adopt_request(a.get_request("r0"))
    assert num_hits == 2 and new.seqs[0].num_computed_tokens == 8 + 3
    full = make_scheduler(num_device_blocks=2)
    assert full.adopt_request(a.get_request("r0")) is None  # 3 blocks + 1 for the next token
    assert full.num_free_blocks == 2


def test_adoption_takes_host_tier_hits_as_copies_in():
    """B's prefix blocks of the moved request sit in its host tier (evicted from the device): the
    adoption counts them as hits and B's next step copies them in before its forward."""
    a, _, _ = decoding_on_a(num=1, prompt_len=8)
    b = make_scheduler(
        enable_prefix_caching=True, num_device_blocks=6, num_cpu_blocks=4, num_host_cache_blocks=4
    )
    add(b, make_requests(1, 8))  # the same prompt: two full blocks cached on B
    step(b)
    b.abort_request("r0")
    b.take_finished_requests()
    step(b)
    add(b, make_requests(1, 23, start=7))  # a 6-block prompt takes all of B: the two go to host
    step(b)
    b.abort_request("r7")
    b.take_finished_requests()
    step(b)
    bm = b.block_manager
    assert not bm.pool.cached.keys() & set(a.get_request("r0").seqs[0].block_hashes[:2])
    new, num_hits = b.adopt_request(a.get_request("r0"))
    assert num_hits == 2 and new.seqs[0].num_computed_tokens == 8 + 3
    out = step(b)
    assert sorted(dst for _, dst in out.blocks_to_swap_in) == sorted(new.seqs[0].block_table[:2])
    b.check_invariants()


def test_pending_drops_are_taken_for_a_step_of_their_own_and_put_back_when_it_fails():
    """A move into a core whose ended sequences the executor still holds sends their drops
    first (the blocks may already be adopted); a failed send puts them back for the next step."""
    a, _, _ = decoding_on_a()
    a.abort_request("r0")
    a.take_finished_requests()
    drops = a.take_pending_drops()
    assert drops == ["r0/0"] and a.take_pending_drops() == []
    a.put_back_drops(drops)
    out = step(a)
    assert out.finished_seq_ids == ["r0/0"]
    a.check_invariants()


def test_a_request_in_its_chunked_prefill_moves_and_continues_its_prefill_there():
    """A drain may move a request between two chunks of its prompt (issue 47): the computed
    chunk is movable KV, and B computes the rest of the prompt from there. One that A has not
    admitted yet is waiting, not movable (`move_waiting` moves it, without KV)."""
    a = make_scheduler(max_num_batched_tokens=8, enable_prefix_caching=True)
    b = make_scheduler(max_num_batched_tokens=8, enable_prefix_caching=True)
    add(a, make_requests(2, 20))
    step(a)  # r0's first 8 prompt tokens; r1 waits for budget
    assert [r.req_id for r in a.movable_requests()] == ["r0"]
    assert a.get_request("r1").status == RequestStatus.WAITING
    new, _ = b.adopt_request(a.get_request("r0"))
    assert a.release_request("r0")
    (entry,) = step(b).new_seqs
    assert (entry.num_computed_tokens, entry.num_scheduled_tokens) == (8, 8)
    step(b)  # the last 4 prompt tokens, then the first token is sampled
    seq = new.seqs[0]
    assert seq.num_computed_tokens == 20 and seq.num_output_tokens == 1
    b.check_invariants()
