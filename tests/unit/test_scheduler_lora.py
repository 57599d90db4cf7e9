"""LoRA in the scheduling core, through its generic fields (features/lora: the step limit
``scheduling.AdapterLimit``, the request's ``tag`` and ``cache_root``): at most max_loras
distinct adapters per step (a request one adapter too many is skipped for the step, keeping its
place), the adapter goes out with each new sequence, and prefix-cache hits never cross
adapters."""

from __future__ import annotations

from scheduler_svc.core.request import Request
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.features.lora.ref import LoraRef, core_fields
from scheduler_svc.features.lora.scheduling import adapter_limit
from tests.unit import test_scheduler
from tests.unit.test_scheduler import add, step

A, B, C = (LoraRef(n, f"/adapters/{n}") for n in "abc")


def _req(i: int, lora: LoraRef | None, prompt: list[int] | None = None, max_tokens=3) -> Request:
    prompt = prompt or [100 * (i + 1) + j for j in range(5)]
    params = SamplingParams(max_tokens=max_tokens)
    return Request(f"r{i}", prompt, params, arrival_time=float(i), **core_fields(lora))


def make_scheduler(max_loras: int = 0, **kw) -> Scheduler:
    """A core whose step limit is the LoRA feature's for an executor with max_loras slots
    (what its scheduling hook gives each core)."""
    return test_scheduler.make_scheduler(step_limit=adapter_limit(max_loras), **kw)


def _loras_of(out) -> set:
    return {s.tag for s in out.new_seqs}


def test_more_adapters_than_max_loras_are_split_over_steps():
    reqs = [_req(0, A), _req(1, None), _req(2, B), _req(3, C), _req(4, A), _req(5, None)]
    sched = make_scheduler(max_loras=2, num_device_blocks=64)
    add(sched, reqs)
    out = step(sched)
    # C would be a third adapter: it is skipped for this step; A and the base behind it go on.
    assert sorted(out.num_scheduled_tokens) == ["r0/0", "r1/0", "r2/0", "r4/0", "r5/0"]
    assert _loras_of(out) == {A, None, B}
    assert sched.waiting_request_ids() == ["r3"]
    out = step(sched)
    assert "r3/0" not in out.num_scheduled_tokens and not out.new_seqs
    sched.abort_request("r2")  # B's last request ends: C gets its slot
    out = step(sched)
    assert "r3/0" in out.num_scheduled_tokens
    assert _loras_of(out) == {C}


def test_a_request_one_adapter_too_many_does_not_block_the_line():
    sched = make_scheduler(max_loras=1, num_device_blocks=64)
    add(sched, [_req(0, A), _req(1, B), _req(2, A), _req(3, None)])
    out = step(sched)
    assert sorted(out.num_scheduled_tokens) == ["r0/0", "r2/0", "r3/0"]
    assert _loras_of(out) == {A, None}
    # B kept its place: it is first in line, and goes as soon as A's requests are done.
    assert sched.waiting_request_ids() == ["r1"]
    sched.abort_request("r0")
    assert not step(sched).new_seqs  # r2 still runs on A
    sched.abort_request("r2")
    out = step(sched)
    assert [s.seq_id for s in out.new_seqs] == ["r1/0"] and _loras_of(out) == {B}


def test_a_skipped_request_goes_before_later_ones_once_its_adapter_fits():
    sched = make_scheduler(max_loras=1, num_device_blocks=64)
    add(sched, [_req(0, A), _req(1, B)])
    step(sched)  # r1 (B) is skipped
    add(sched, [_req(2, A)])  # would fit beside r0 (A)...
    sched.abort_request("r0")  # ...but r0 ends: the slot is free, and B was first
    out = step(sched)
    assert [s.seq_id for s in out.new_seqs] == ["r1/0"]  # B first, then A waits its turn
    assert sched.waiting_request_ids() == ["r2"]


def test_no_cap_without_max_loras():
    sched = make_scheduler()
    add(sched, [_req(0, A), _req(1, B), _req(2, C)])
    assert _loras_of(step(sched)) == {A, B, C}


def test_prefix_cache_hits_stay_within_one_adapter():
    prompt = list(range(1, 14))  # 3 full blocks of 4
    sched = make_scheduler(enable_prefix_caching=True)
    add(sched, [_req(0, A, prompt)])
    step(sched)
    add(sched, [_req(1, B, prompt), _req(2, None, prompt), _req(3, A, prompt)])
    out = step(sched)
    computed = {s.seq_id: s.num_computed_tokens for s in out.new_seqs}
    assert computed == {"r1/0": 0, "r2/0": 0, "r3/0": 12}


def test_adapter_loads_are_counted_against_the_executors_device_slots():
    sched = make_scheduler(max_loras=2, num_device_blocks=64)
    add(sched, [_req(0, A), _req(1, B), _req(2, None)])
    step(sched)
    stats = sched.step_limit
    assert (stats.num_loads, stats.num_in_step) == (2, 2)
    step(sched)  # A and B are still on the device: no new load
    assert stats.num_loads == 2
    sched.abort_request("r1")
    add(sched, [_req(3, C)])
    step(sched)  # C takes B's slot
    assert (stats.num_loads, stats.num_in_step) == (3, 2)
    assert set(stats.slots.held()) == {A, C}
    sched.abort_request("r3")
    add(sched, [_req(4, B)])
    step(sched)  # B was evicted (slots: A, C): loaded again
    assert stats.num_loads == 4


def test_a_request_skipped_too_long_drains_the_adapters_ahead_of_it():
    sched = make_scheduler(max_loras=1, num_device_blocks=64)
    sched.starvation_steps = 3
    add(sched, [_req(0, A), _req(1, B)])
    step(sched)  # B skipped
    add(sched, [_req(2, A), _req(3, None)])
    out = step(sched)  # A's slot is taken anyway: a second A request and the base go in
    assert {s.seq_id for s in out.new_seqs} == {"r2/0", "r3/0"}
    step(sched)
    step(sched)
    add(sched, [_req(4, A), _req(5, None)])
    out = step(sched)  # B has been skipped 3 steps: no more A requests in; the base goes
    assert [s.seq_id for s in out.new_seqs] == ["r5/0"]
    assert sched.waiting_request_ids() == ["r1", "r4"]
    sched.abort_request("r0")
    sched.abort_request("r2")
    out = step(sched)  # A drained: B is in, r4 waits for A to get a slot again
    assert [s.seq_id for s in out.new_seqs] == ["r1/0"]
    assert sched.waiting_request_ids() == ["r4"]
    assert list(sched._skipped) == ["r4"]  # r1 forgotten; r4 now waits for B


def test_an_adopted_request_respects_the_destination_adapter_limit():
    """Live migration / a handoff: B already runs adapter A in its one slot; a request on
    adapter B may not be adopted there (B's next step would hold two adapters, which its
    executor refuses), one on A or on the base model may."""
    src, dst = make_scheduler(max_loras=2), make_scheduler(max_loras=1)
    add(src, [_req(0, B, max_tokens=9), _req(1, A, max_tokens=9), _req(2, None, max_tokens=9)])
    add(dst, [_req(3, A, max_tokens=9)])
    step(src)
    step(dst)
    assert dst.adopt_request(src.get_request("r0")) is None
    assert dst.adopt_request(src.get_request("r1")) is not None
    assert dst.adopt_request(src.get_request("r2")) is not None
    assert {s.tag for s in step(dst).new_seqs} == {A, None}
    dst.check_invariants()
