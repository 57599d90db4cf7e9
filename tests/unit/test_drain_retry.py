"""When a draining executor's migration tries again (`engine/faults/drain_retry.py`): only
when a request became movable or a destination has more room than at the last attempt that
left requests behind."""

from scheduler_svc.engine.faults.drain_retry import RetryGate, Room

FULL = {"b": Room(num_free_blocks=2, num_free_seqs=0)}


def test_the_first_attempt_is_due_once_something_is_movable():
    gate = RetryGate()
    assert not gate.due([], FULL)  # nothing movable yet (e.g. nothing computed)
    assert gate.due(["r0"], FULL)
    assert gate.due(["r0"], {})  # no destination: the attempt finds that out itself


def test_nothing_changed_nothing_is_tried():
    gate = RetryGate()
    gate.record(["r0", "r1"], FULL)
    assert not gate.due(["r0", "r1"], FULL)
    assert not gate.due(["r1"], FULL)  # r0 finished on the source meanwhile
    assert not gate.due(["r1"], {"b": Room(1, 0)})  # b's own requests grew: less room
    assert not gate.due([], {"b": Room(40, 8)})  # room, but nothing left to move


def test_a_request_that_became_movable_is_tried():
    gate = RetryGate()
    gate.record(["r0"], FULL)
    assert gate.due(["r0", "r2"], FULL)  # r2's first chunk computed, or swapped back in


def test_more_room_on_a_destination_is_tried():
    gate = RetryGate()
    gate.record(["r0"], FULL)
    assert gate.due(["r0"], {"b": Room(3, 0)})  # b freed blocks
    assert gate.due(["r0"], {"b": Room(2, 1)})  # b freed a sequence slot
    assert gate.due(["r0"], {**FULL, "c": Room(0, 0)})  # a destination new since then
    gate.record(["r0"], {"b": Room(3, 1)})
    assert not gate.due(["r0"], {"b": Room(3, 1)})  # measured from the latest attempt
