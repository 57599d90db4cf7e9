"""Deadlines as plain data (scheduler_svc/features/deadlines/): what a timeout may be, the
absolute deadline a request gets, the heap's order, and the deadline's round trip through the
stored record. The serving behaviour is tests/integration/test_deadlines.py."""

from __future__ import annotations

import math

import pytest

from scheduler_svc.core.sampling_params import SamplingParams, ValidationError
from scheduler_svc.engine.config import GenerateInput
from scheduler_svc.engine.streams import RequestHandle
from scheduler_svc.features.base import Features
from scheduler_svc.features.deadlines.feature import DeadlineHeap, Deadlines
from scheduler_svc.features.deadlines.timeouts import MAX_TIMEOUT_S, check_timeout
from scheduler_svc.flags import build_parser
from scheduler_svc.settings import SchedulerSettings
from scheduler_svc.state.records import decode_record


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf, -math.inf, MAX_TIMEOUT_S * 2])
def test_a_timeout_must_be_positive_finite_and_bounded(value: float) -> None:
    with pytest.raises(ValidationError, match="timeout_s"):
        check_timeout(value)


def test_the_earliest_timeout_sets_the_deadline() -> None:
    inp = GenerateInput(req_id="r", params=SamplingParams(), timeouts=(5.0, 2.5))
    assert Deadlines(None, {}, None).handle_fields(inp) == {"timeout_s": 2.5}
    assert Deadlines(1.0, {}, None).handle_fields(inp) == {"timeout_s": 1.0}
    none = GenerateInput(req_id="r", params=SamplingParams())
    assert Deadlines(None, {}, None).handle_fields(none) == {}
    handle = RequestHandle("r", [1, 2], SamplingParams(), 0, arrival_time=100.0, timeout_s=2.5)
    assert handle.deadline == 102.5
    assert RequestHandle("r", [1, 2], SamplingParams(), 0, arrival_time=100.0).deadline == 0.0


def _handle(req_id: str, deadline: float) -> RequestHandle:
    handle = RequestHandle(req_id, [1, 2], SamplingParams(), 0, arrival_time=0.0)
    handle.deadline = deadline
    return handle


def test_the_heap_yields_due_ids_earliest_first_and_skips_requests_without_one() -> None:
    heap = DeadlineHeap()
    for req_id, deadline in [("c", 30.0), ("a", 10.0), ("none", 0.0), ("b", 20.0)]:
        heap.push(_handle(req_id, deadline))
    assert len(heap) == 3
    assert not heap.due(9.9)
    assert heap.due(10.0)
    assert heap.pop_due(25.0) == ["a", "b"]
    assert heap.pop_due(25.0) == []
    assert heap.pop_due(30.0) == ["c"]


def test_the_heap_drops_entries_of_requests_no_longer_held() -> None:
    heap = DeadlineHeap()
    for i in range(10):
        heap.push(_handle(f"r{i}", 100.0 - i))
    heap.keep(lambda req_id: req_id in {"r2", "r7"})
    assert len(heap) == 2
    assert heap.pop_due(1000.0) == ["r7", "r2"]


def test_the_stored_deadline_reads_back_and_old_records_have_none() -> None:
    fields = {b"v": b"1", b"prompt": b"[1, 2]", b"params": b"{}", b"deadline": b"1234.5"}
    assert decode_record("r", fields).deadline == 1234.5
    del fields[b"deadline"]
    assert decode_record("r", fields).deadline == 0.0


def test_the_server_default_is_off_and_checked() -> None:
    parse = build_parser().parse_args
    assert SchedulerSettings.from_args(parse([])).engine.request_timeout_s is None
    settings = SchedulerSettings.from_args(parse(["--request-timeout", "30"]))
    assert settings.engine.request_timeout_s == 30.0
    for bad in ("0", "-3", "nan", "soon"):
        with pytest.raises(SystemExit):
            parse(["--request-timeout", bad])


def test_admit_compacts_the_heap_but_keeps_the_request_it_admits() -> None:
    # `admit` runs just before the table holds the request: a compaction then must not drop it.
    held = {"kept": _handle("kept", 5.0)}
    feature = Deadlines(None, held, None)
    feature.heap.push(held["kept"])
    for i in range(1100):  # finished before their deadline: their entries stayed
        feature.heap.push(_handle(f"gone{i}", 1.0))
    feature.admit(_handle("new", 9.0))
    assert len(feature.heap) == 2
    assert feature.heap.pop_due(100.0) == ["kept", "new"]


def test_the_feature_is_on_the_step_hooks() -> None:
    features = Features([Deadlines(None, {}, None)])
    assert len(features.between_steps) == len(features.holds_ahead) == len(features.admit) == 1
    assert len(features.metrics) == 1
    assert Features([]).between_steps == Features([]).holds_ahead == ()
