"""The engine's two lifecycles as specifications: `lifecycle.Lifecycle` (one state, one reason
why it does not serve) and `executor_handle.ExecutorState` (changed only by its handle)."""

from __future__ import annotations

import pytest

from protos import executor_pb2 as epb
from scheduler_svc.core.errors import Unavailable
from scheduler_svc.engine.faults.lifecycle import EngineState, Lifecycle
from scheduler_svc.engine.fleet.executor_handle import ExecutorHandle, ExecutorState
from tests.unit.test_scheduler import make_scheduler


def watched(leader_election: bool) -> tuple[Lifecycle, list[EngineState]]:
    lifecycle = Lifecycle(leader_election)
    seen: list[EngineState] = []
    lifecycle.watchers.append(lambda: seen.append(lifecycle.state))
    return lifecycle, seen


def test_a_leader_serves_only_between_election_and_stop() -> None:
    lifecycle, seen = watched(leader_election=True)
    assert lifecycle.state is EngineState.STANDBY
    assert "standby" in lifecycle.why_not_serving()
    lifecycle.started()  # not before the lease: nothing happens
    assert lifecycle.state is EngineState.STANDBY
    lifecycle.elected()
    assert "starting" in lifecycle.why_not_serving()
    lifecycle.started()
    assert lifecycle.serving and lifecycle.why_not_serving() is None
    lifecycle.check()  # serving: no error
    lifecycle.stop()
    assert lifecycle.stopping and not lifecycle.serving
    assert seen == [EngineState.STARTING, EngineState.SERVING, EngineState.STOPPING]


def test_without_leader_election_it_starts_at_once() -> None:
    lifecycle, _ = watched(leader_election=False)
    assert lifecycle.state is EngineState.STARTING
    with pytest.raises(Unavailable, match="scheduler is starting"):
        lifecycle.check()


def test_lost_leadership_is_final_and_said_once() -> None:
    lifecycle, seen = watched(leader_election=False)
    lifecycle.started()
    lifecycle.lose_leadership("lease lost")
    lifecycle.lose_leadership("a write was refused")
    lifecycle.stop()  # a stop afterwards does not hand the lease over: still lost
    lifecycle.started()
    assert lifecycle.state is EngineState.LOST_LEADERSHIP
    assert lifecycle.lost_reason == "lease lost"
    assert lifecycle.leadership_lost.is_set() and lifecycle.stopping
    assert seen == [EngineState.SERVING, EngineState.LOST_LEADERSHIP]
    with pytest.raises(Unavailable, match="no longer the leader"):
        lifecycle.check()


def executor(state: ExecutorState = ExecutorState.UP) -> ExecutorHandle:
    describe = epb.DescribeResponse(instance_id="x", block_size=4, num_device_blocks=8)
    sched = make_scheduler(num_device_blocks=8, block_size=4)
    return ExecutorHandle("x", None, None, describe, sched, state)  # type: ignore[arg-type]


def test_an_executor_that_drains_and_goes_down_is_not_waited_for() -> None:
    ex = executor()
    assert ex.healthy and not ex.draining
    ex.set_draining(True)
    assert ex.state is ExecutorState.DRAINING and ex.healthy
    ex.went_down()
    assert ex.state is ExecutorState.DOWN_DRAINING and not ex.healthy and ex.draining
    ex.came_back()
    assert ex.state is ExecutorState.DRAINING


def test_down_and_back_keeps_when_it_went_down() -> None:
    ex = executor()
    ex.went_down()
    since = ex.down_since
    ex.went_down()  # a second failure while down does not restart the fail-over clock
    assert ex.state is ExecutorState.DOWN and ex.down_since == since > 0
    ex.set_draining(False)
    assert ex.state is ExecutorState.DOWN
    ex.came_back()
    assert ex.state is ExecutorState.UP and ex.healthy


def test_a_retired_executor_stays_retired() -> None:
    ex = executor(ExecutorState.RETIRED)
    ex.went_down()
    ex.set_draining(True)
    assert ex.retired and not ex.healthy and ex.state is ExecutorState.RETIRED
