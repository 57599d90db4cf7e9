"""Scheduler.schedule_ahead (async scheduling): exact plans for the decode step after the one in
flight, and when there is none. Random workloads both ways: test_scheduler_property.py."""

import pytest

from scheduler_svc.core.request import RequestStatus
from tests.unit.test_scheduler import TOKEN, add, cached, make_requests, make_scheduler, step


def test_schedule_ahead_plans_the_next_decode_while_one_is_in_flight():
    sched = make_scheduler(max_num_seqs=2)
    a, b = add(sched, make_requests(2, prompt_len=5, max_tokens=8))
    step(sched)  # prompts; each has its first token: 6 tokens, 5 computed
    first = sched.schedule()  # writes position 5 (block 1, room up to 8)
    assert first.decode_seq_ids == ["r0/0", "r1/0"]
    ahead = sched.schedule_ahead()
    assert ahead is not None
    assert ahead.decode_seq_ids == ["r0/0", "r1/0"]
    assert ahead.decode_num_computed_tokens == [6, 6]  # once `first` is in
    assert sched.schedule_ahead() is None  # never more than two in flight
    with pytest.raises(RuntimeError):
        sched.schedule()
    sched.update_from_output(first, {"r0/0": 1, "r1/0": 2})
    sched.update_from_output(ahead, {"r0/0": 3, "r1/0": 4})
    assert a.seqs[0].output_token_ids == [TOKEN, 1, 3]
    assert b.seqs[0].output_token_ids == [TOKEN, 2, 4]
    sched.check_invariants()
    # Position 7 is the last slot of block 1: the step after it needs block 2, and gets it.
    first = sched.schedule()
    ahead = sched.schedule_ahead()
    assert ahead is not None and not ahead.decode_seq_ids
    grown = cached(ahead)
    assert [(c.seq_id, c.num_computed_tokens, len(c.new_block_ids)) for c in grown] == [
        ("r0/0", 8, 1),
        ("r1/0", 8, 1),
    ]
    assert a.seqs[0].block_table[-1] == grown[0].new_block_ids[0]


def test_schedule_ahead_only_when_nothing_else_could_happen():
    sched = make_scheduler(max_num_seqs=2)
    (a,) = add(sched, make_requests(1, prompt_len=5, max_tokens=8))
    step(sched)
    out = sched.schedule()
    add(sched, make_requests(1, prompt_len=5, start=1))
    assert sched.schedule_ahead() is None  # a free slot: the newcomer goes first
    sched.update_from_output(out, {"r0/0": TOKEN})
    step(sched)  # admits r1 (its prompt) while r0 decodes
    out = sched.schedule()
    ahead = sched.schedule_ahead()
    assert ahead is not None  # both decode; nothing waits
    sched.update_from_output(out, {"r0/0": TOKEN, "r1/0": TOKEN})
    sched.update_from_output(ahead, {"r0/0": TOKEN, "r1/0": TOKEN})
    add(sched, make_requests(1, prompt_len=5, start=2))
    out = sched.schedule()  # both slots taken: r2 waits whatever happens
    assert sched.schedule_ahead() is not None
    # A sequence the step in flight ends by length is left out of the next one.
    sched = make_scheduler()
    (a,) = add(sched, make_requests(1, prompt_len=5, max_tokens=2))
    step(sched)
    sched.schedule()  # its second and last token
    assert sched.schedule_ahead() is None


def test_a_stop_in_flight_drops_the_token_planned_ahead():
    sched = make_scheduler()
    (a,) = add(sched, make_requests(1, prompt_len=5, max_tokens=8))
    step(sched)
    first = sched.schedule()
    ahead = sched.schedule_ahead()
    sched.update_from_output(first, {"r0/0": 0})
    sched.finish_sequence("r0/0", RequestStatus.FINISHED_STOPPED, 0)  # a stop token
    assert sched.update_from_output(ahead, {"r0/0": 5}) == []
    assert a.seqs[0].output_token_ids == [TOKEN, 0]
    nxt = sched.schedule()
    assert nxt.finished_seq_ids == ["r0/0"] and nxt.is_empty is False
    sched.check_invariants()
    assert sched.num_free_blocks == sched.num_device_blocks


def test_a_constrained_request_is_not_planned_ahead():
    """Its next mask depends on the token the step in flight samples (structured outputs)."""
    sched = make_scheduler(max_num_seqs=2)
    a, b = make_requests(2, prompt_len=5, max_tokens=8)
    b.sampling_params.structured_output = {"regex": "[0-9]+"}
    add(sched, [a, b])
    step(sched)
    sched.schedule()
    assert sched.schedule_ahead() is None
