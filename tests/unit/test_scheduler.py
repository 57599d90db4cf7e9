"""Scheduler policy: exact schedules, chunks, block ids, victims, forks, cache hits, errors."""

import pytest

from scheduler_svc.core.errors import QueueFull
from scheduler_svc.core.request import Request, RequestStatus, sequence_seed
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.scheduler_output import CachedSeqData, NewSeqData, SchedulerOutput

TOKEN = 7  # what the fake executor samples


def make_scheduler(**kw) -> Scheduler:
    args = dict(
        max_num_batched_tokens=64,
        max_num_seqs=8,
        block_size=4,
        num_device_blocks=16,
        num_cpu_blocks=8,
        max_model_len=128,
        watermark=0.0,
        enable_prefix_caching=False,
    )
    args.update(kw)
    return Scheduler(SchedulerConfig(**args))


def make_requests(
    num: int,
    prompt_len: int = 4,
    *,
    start: int = 0,
    n: int = 1,
    max_tokens: int = 16,
    priorities: list[int] | None = None,
    seed: int | None = None,
) -> list[Request]:
    """Requests r{start}, r{start+1}, ... with distinct prompts (no accidental prefix hits)."""
    reqs = []
    for k in range(start, start + num):
        prompt = [1000 * (k + 1) + j for j in range(prompt_len)]
        params = SamplingParams(n=n, max_tokens=max_tokens, seed=seed)
        prio = priorities[k - start] if priorities else 0
        reqs.append(Request(f"r{k}", prompt, params, priority=prio, arrival_time=float(k)))
    return reqs


def add(sched: Scheduler, reqs: list[Request]) -> list[Request]:
    for r in reqs:
        sched.add_request(r)
    return reqs


def step(sched: Scheduler) -> SchedulerOutput:
    """schedule() and feed back TOKEN for every sequence that reached its end."""
    out = sched.schedule()
    sampled = {
        seq.seq_id: TOKEN
        for seq, num in out.scheduled
        if seq.num_computed_tokens + num == len(seq.token_ids)
    }
    sched.update_from_output(out, sampled)
    sched.check_invariants()
    return out


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    return out.num_scheduled_tokens


def cached(out: SchedulerOutput) -> list[CachedSeqData]:
    """Every running sequence sent as a difference, decode lane entries spelled out, in
    batch order."""
    lane = {
        sid: CachedSeqData(sid, [], [], 1, nc)
        for sid, nc in zip(out.decode_seq_ids, out.decode_num_computed_tokens, strict=True)
    }
    by_id = {c.seq_id: c for c in out.cached_seqs} | lane
    assert len(by_id) == len(out.cached_seqs) + len(lane), "a sequence in both forms"
    return [by_id[seq.seq_id] for seq, _ in out.scheduled if seq.seq_id in by_id]


def test_decode_lane_only_for_requests_without_logprobs():
    sched = make_scheduler()
    sched.add_request(Request("plain", [1, 2, 3], SamplingParams(max_tokens=8)))
    sched.add_request(Request("lp", [4, 5, 6], SamplingParams(max_tokens=8, logprobs=2)))
    step(sched)
    out = step(sched)
    assert out.decode_seq_ids == ["plain/0"]
    assert [c.seq_id for c in out.cached_seqs] == ["lp/0"]  # the lane carries no top logprobs


def test_prefill_is_sent_in_full_then_decodes_as_differences():
    sched = make_scheduler()
    (r0,) = add(sched, make_requests(1, prompt_len=6))
    out = step(sched)
    assert out.new_seqs == [
        NewSeqData("r0/0", r0.prompt_token_ids, 6, r0.sampling_params, None, [0, 1], 0, 6)
    ]
    assert out.cached_seqs == [] and out.total_num_scheduled_tokens == 6
    assert r0.seqs[0].token_ids[-1] == TOKEN
    out = step(sched)  # position 6 still fits block 1
    assert out.new_seqs == [] and out.cached_seqs == []
    assert (out.decode_seq_ids, out.decode_num_computed_tokens) == (["r0/0"], [6])  # the lane
    step(sched)
    out = step(sched)  # position 8 opens a block
    assert out.cached_seqs == [CachedSeqData("r0/0", [2], [], 1, 8)]


def test_chunked_prefill_keeps_decodes_flowing():
    sched = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4)
    add(sched, make_requests(1, prompt_len=3) + make_requests(1, prompt_len=20, start=1))
    assert scheduled(step(sched)) == {"r0/0": 3, "r1/0": 5}
    assert scheduled(step(sched)) == {"r0/0": 1, "r1/0": 7}
    assert scheduled(step(sched)) == {"r0/0": 1, "r1/0": 7}
    out = step(sched)
    assert scheduled(out) == {"r0/0": 1, "r1/0": 1}  # r1's last prompt token, then it samples
    assert [c.num_computed_tokens for c in cached(out)] == [5, 19]
    assert sched.get_request("r1").seqs[0].output_token_ids == [TOKEN]


def test_long_prefill_token_threshold_caps_each_chunk():
    sched = make_scheduler(long_prefill_token_threshold=4)
    add(sched, make_requests(1, prompt_len=10))
    assert [scheduled(step(sched))["r0/0"] for _ in range(4)] == [4, 4, 2, 1]


def test_max_num_seqs_caps_the_batch():
    sched = make_scheduler(max_num_seqs=2)
    add(sched, make_requests(3))
    assert list(scheduled(step(sched))) == ["r0/0", "r1/0"]
    assert sched.num_waiting == 1
    sched.finish_sequence("r0/0", RequestStatus.FINISHED_STOPPED)
    out = step(sched)
    assert out.finished_seq_ids == ["r0/0"]
    assert list(scheduled(out)) == ["r1/0", "r2/0"]


def test_fcfs_blocks_behind_the_head_of_the_queue():
    sched = make_scheduler(num_device_blocks=8)
    add(sched, make_requests(1, 20) + make_requests(1, 16, start=1) + make_requests(1, 4, start=2))
    out = step(sched)
    assert [s.seq_id for s in out.new_seqs] == ["r0/0"]  # r1 needs 4 of 3 free; r2 waits too
    assert sched.waiting_request_ids() == ["r1", "r2"]


def test_priority_policy_admits_higher_priority_then_earlier_arrival():
    sched = make_scheduler(policy="priority", max_num_seqs=2)
    add(sched, make_requests(3, priorities=[0, 5, 5]))
    assert list(scheduled(step(sched))) == ["r1/0", "r2/0"]
    assert sched.running_request_ids() == ["r1", "r2"]


def test_watermark_keeps_blocks_back_from_admission():
    sched = make_scheduler(num_device_blocks=10, watermark=0.2)
    add(sched, make_requests(2, 16) + make_requests(1, 4, start=2))
    assert list(scheduled(step(sched))) == ["r0/0", "r1/0"]  # r2 would leave 1 < 2 free
    assert sched.waiting_request_ids() == ["r2"]


def fill_three_single_block_requests(**kw) -> Scheduler:
    sched = make_scheduler(num_device_blocks=4, **kw)
    add(sched, make_requests(3, 4, priorities=kw.pop("priorities", None)))
    step(sched)  # blocks 0, 1, 2; every sequence now needs a second block
    return sched


def test_preemption_by_recompute_takes_the_latest_arrival():
    sched = fill_three_single_block_requests()
    out = step(sched)
    assert out.preempted_req_ids == ["r2"]
    assert out.finished_seq_ids == ["r2/0"]  # the executor forgets it
    assert cached(out) == [
        CachedSeqData("r0/0", [3], [], 1, 4),
        CachedSeqData("r1/0", [2], [], 1, 4),  # the victim's block
    ]
    r2 = sched.get_request("r2")
    assert r2.status == RequestStatus.WAITING and r2.seqs[0].num_computed_tokens == 0
    assert sched.waiting_request_ids() == ["r2"]

    sched.finish_sequence("r0/0", RequestStatus.FINISHED_STOPPED)
    out = step(sched)
    assert out.finished_seq_ids == ["r0/0"]
    # Resent in full: prompt plus the output it had, recomputed from scratch.
    assert out.new_seqs == [
        NewSeqData("r2/0", r2.prompt_token_ids + [TOKEN], 4, r2.sampling_params, None, [0, 3], 0, 5)
    ]
    assert sched.get_stats().num_preemptions == 1


def test_preemption_takes_the_lowest_priority_first():
    sched = make_scheduler(num_device_blocks=4, policy="priority")
    add(sched, make_requests(3, 4, priorities=[1, 0, 2]))
    assert list(scheduled(step(sched))) == ["r2/0", "r0/0", "r1/0"]
    out = step(sched)
    assert out.preempted_req_ids == ["r1"]
    assert list(scheduled(out)) == ["r2/0", "r0/0"]


def test_a_request_with_nothing_behind_it_preempts_itself():
    sched = make_scheduler(num_device_blocks=3)
    add(sched, make_requests(1, 6) + make_requests(1, 4, start=1))
    step(sched)
    out = step(sched)  # r0 writes position 6 in its block 1; r1 needs a block, none left
    assert out.preempted_req_ids == ["r1"]
    assert list(scheduled(out)) == ["r0/0"]


def test_preemption_by_swap_moves_blocks_and_resumes_before_new_work():
    sched = fill_three_single_block_requests(preemption_mode="swap")
    add(sched, make_requests(1, 4, start=3))
    out = step(sched)
    assert out.preempted_req_ids == ["r2"] and out.finished_seq_ids == ["r2/0"]
    assert out.blocks_to_swap_out == [(2, 0)]
    assert sched.swapped_request_ids() == ["r2"]
    assert [c.new_block_ids for c in cached(out)] == [[3], [2]]

    sched.finish_sequence("r0/0", RequestStatus.FINISHED_STOPPED)
    out = step(sched)
    assert out.blocks_to_swap_in == [(0, 0)]
    r2 = sched.get_request("r2")
    assert out.new_seqs == [
        NewSeqData("r2/0", r2.prompt_token_ids + [TOKEN], 4, r2.sampling_params, None, [0, 3], 4, 1)
    ]
    assert "r3/0" not in scheduled(out)  # new work waits behind the swapped request
    assert sched.get_stats().num_free_cpu_blocks == 8


def test_swap_falls_back_to_recompute_when_the_cpu_pool_is_full():
    sched = fill_three_single_block_requests(preemption_mode="swap", num_cpu_blocks=0)
    out = step(sched)
    assert out.preempted_req_ids == ["r2"] and out.blocks_to_swap_out == []
    assert sched.waiting_request_ids() == ["r2"] and sched.num_swapped == 0


def test_parallel_sampling_forks_after_the_prompt_and_copies_on_write():
    sched = make_scheduler()
    (r0,) = add(sched, make_requests(1, 6, n=3, seed=42))
    out = step(sched)
    # Sequence 0 alone computes the prompt but its last token, and samples nothing.
    assert scheduled(out) == {"r0/0": 5}
    assert out.new_seqs[0].block_table == [0, 1] and len(r0.seqs) == 1

    out = step(sched)
    assert scheduled(out) == {"r0/0": 1, "r0/1": 1, "r0/2": 1}
    # Block 1 holds computed position 4 and is shared three ways: two copies, the last
    # holder (sequence 2) writes in place.
    assert out.blocks_to_copy == [(1, 2), (1, 3)]
    assert out.cached_seqs == [CachedSeqData("r0/0", [], [(1, 2)], 1, 5)]
    p = r0.prompt_token_ids
    assert out.new_seqs == [
        NewSeqData("r0/1", p, 6, r0.sampling_params, sequence_seed(42, 1), [0, 3], 5, 1),
        NewSeqData("r0/2", p, 6, r0.sampling_params, sequence_seed(42, 2), [0, 1], 5, 1),
    ]
    assert sched.block_manager.pool.blocks[0].ref_cnt == 3
    assert [s.output_token_ids for s in r0.seqs] == [[TOKEN]] * 3


def test_sequence_seeds_are_derived_from_the_request_seed():
    assert sequence_seed(None, 3) is None
    assert sequence_seed(42, 0) == 42
    seeds = {sequence_seed(42, i) for i in range(1, 16)}
    assert len(seeds) == 15 and 42 not in seeds
    assert all(0 <= s < 2**63 for s in seeds)
    assert sequence_seed(42, 1) == sequence_seed(42, 1)


def test_prefix_cache_hit_skips_the_cached_blocks():
    sched = make_scheduler(enable_prefix_caching=True)
    sched.add_request(Request("a", list(range(1, 11)), SamplingParams()))
    step(sched)
    sched.finish_sequence("a/0", RequestStatus.FINISHED_STOPPED)
    sched.add_request(Request("b", list(range(1, 9)) + [99], SamplingParams()))
    out = step(sched)
    # Blocks 0 and 1 hold tokens 1..8; block 2 (a's unhashed tail) is reused first.
    assert [(s.seq_id, s.block_table, s.num_computed_tokens) for s in out.new_seqs] == [
        ("b/0", [0, 1, 2], 8)
    ]
    assert scheduled(out) == {"b/0": 1}
    stats = sched.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (10 + 9, 8)


def test_prefix_cache_hit_leaves_a_token_to_compute():
    sched = make_scheduler(enable_prefix_caching=True)
    sched.add_request(Request("a", list(range(1, 10)), SamplingParams()))
    step(sched)
    sched.add_request(Request("b", list(range(1, 9)), SamplingParams()))  # all 8 cached
    out = step(sched)
    new = [s for s in out.new_seqs if s.seq_id == "b/0"]
    assert new[0].num_computed_tokens == 4 and scheduled(out)["b/0"] == 4


def test_a_request_too_large_for_the_cache_or_model_fails_at_once():
    sched = make_scheduler(num_device_blocks=4, max_model_len=20)
    add(sched, make_requests(1, 16) + make_requests(1, 15, start=1))
    (r0,) = sched.take_finished_requests()
    assert r0.req_id == "r0" and r0.status == RequestStatus.FINISHED_ERROR
    assert "needs 5 KV cache blocks" in r0.error
    assert r0.seqs[0].status == RequestStatus.FINISHED_ERROR
    assert sched.num_waiting == 1  # r1 (15 + 1 tokens, 4 blocks) fits

    sched2 = make_scheduler(max_model_len=20)
    sched2.add_request(make_requests(1, 20)[0])
    (err,) = sched2.take_finished_requests()
    assert "maximum model length 20" in err.error


def test_a_request_that_outgrows_the_whole_cache_ends_with_an_error():
    sched = make_scheduler(num_device_blocks=2)
    add(sched, make_requests(1, 4, max_tokens=100))
    for _ in range(5):
        step(sched)
    out = step(sched)  # position 8 needs a third block: preempts itself
    assert out.preempted_req_ids == ["r0"] and out.finished_seq_ids == ["r0/0"]
    out = step(sched)  # 9 tokens need 3 blocks even in an empty cache
    assert out.total_num_scheduled_tokens == 0
    (r0,) = sched.take_finished_requests()
    assert r0.status == RequestStatus.FINISHED_ERROR and "needs 3 KV cache blocks" in r0.error
    sched.check_invariants()
    assert sched.num_free_blocks == 2


def test_n_above_max_num_seqs_fails_at_once():
    sched = make_scheduler(max_num_seqs=2)
    sched.add_request(make_requests(1, n=3)[0])
    (r0,) = sched.take_finished_requests()
    assert "n=3" in r0.error and [s.seq_id for s in r0.seqs] == ["r0/0", "r0/1", "r0/2"]


def test_full_waiting_queue_raises_queue_full():
    sched = make_scheduler(max_waiting=2)
    add(sched, make_requests(2))
    with pytest.raises(QueueFull, match="waiting queue is full"):
        sched.add_request(make_requests(1, start=2)[0])
    with pytest.raises(ValueError, match="already active"):
        step(sched)
        sched.add_request(make_requests(1)[0])


def test_abort_frees_blocks_at_once_and_tells_the_executor_next_step():
    sched = make_scheduler()
    add(sched, make_requests(2, 6))
    step(sched)
    assert sched.abort_request("r0") is True
    assert sched.abort_request("r0") is False and sched.abort_request("nope") is False
    assert sched.num_free_blocks == 16 - 2
    out = step(sched)
    assert out.finished_seq_ids == ["r0/0"] and list(scheduled(out)) == ["r1/0"]
    (r0,) = sched.take_finished_requests()
    assert r0.status == RequestStatus.FINISHED_ABORTED


def test_abort_of_a_waiting_request_sends_no_drop():
    sched = make_scheduler(max_num_seqs=1)
    add(sched, make_requests(2))
    assert sched.abort_request("r1") is True and sched.waiting_request_ids() == ["r0"]
    out = step(sched)
    assert out.finished_seq_ids == [] and list(scheduled(out)) == ["r0/0"]


def test_abort_while_the_step_is_in_flight_ignores_its_result():
    sched = make_scheduler()
    add(sched, make_requests(2))
    out = sched.schedule()
    sched.abort_request("r0")
    got = sched.update_from_output(out, {"r0/0": 1, "r1/0": 2})
    assert [s.seq_id for s in got] == ["r1/0"]
    sched.check_invariants()


def test_request_ends_with_its_last_sequence():
    sched = make_scheduler()
    (r0,) = add(sched, make_requests(1, 6, n=2))
    step(sched)
    step(sched)
    sched.finish_sequence("r0/1", RequestStatus.FINISHED_STOPPED, stop_reason=7)
    assert sched.take_finished_requests() == []
    out = step(sched)
    assert out.finished_seq_ids == ["r0/1"] and list(scheduled(out)) == ["r0/0"]
    sched.finish_sequence("r0/0", RequestStatus.FINISHED_LENGTH)
    assert sched.take_finished_requests() == [r0]
    assert [s.status for s in r0.seqs] == [
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_STOPPED,
    ]
    assert r0.seqs[1].stop_reason == 7
    sched.check_invariants()
    assert sched.num_free_blocks == 16


def test_reset_executor_requeues_everything_for_recompute():
    sched = make_scheduler(num_device_blocks=4, preemption_mode="swap")
    add(sched, make_requests(3, 4))
    step(sched)
    step(sched)  # r2 swapped out
    in_flight = sched.schedule()
    sched.reset_executor()
    assert sched.update_from_output(in_flight, {}) == []  # discarded
    assert sched.num_free_blocks == 4 and sched.num_swapped == 0
    assert sched.waiting_request_ids() == ["r0", "r1", "r2"]
    out = step(sched)
    assert out.finished_seq_ids == []  # the executor already forgot everything
    assert [(s.seq_id, len(s.token_ids), s.num_computed_tokens) for s in out.new_seqs] == [
        ("r0/0", 6, 0),
        ("r1/0", 6, 0),
    ]


def test_resumed_request_recomputes_its_outputs_as_output():
    sched = make_scheduler()
    req = Request("x", [1, 2, 3], SamplingParams(n=2), output_token_ids=[[9, 8], [5]])
    sched.add_request(req)
    out = step(sched)
    assert [(s.seq_id, s.token_ids, s.num_prompt_tokens) for s in out.new_seqs] == [
        ("x/0", [1, 2, 3, 9, 8], 3),
        ("x/1", [1, 2, 3, 5], 3),
    ]
    assert scheduled(out) == {"x/0": 5, "x/1": 4}
    assert req.seqs[0].output_token_ids == [9, 8, TOKEN]


def test_a_running_decode_step_is_independent_of_context_length():
    sched = make_scheduler(num_device_blocks=64)
    add(sched, make_requests(2, 40))
    step(sched)
    for _ in range(10):
        out = step(sched)
        assert out.new_seqs == []
        assert all(len(c.new_block_ids) <= 1 and not c.replaced_blocks for c in cached(out))


def test_schedule_twice_without_update_is_an_error():
    sched = make_scheduler()
    add(sched, make_requests(1))
    sched.schedule()
    with pytest.raises(RuntimeError, match="update_from_output"):
        sched.schedule()


def test_a_step_that_computes_nothing_needs_no_update():
    sched = make_scheduler()
    assert sched.schedule().is_empty
    add(sched, make_requests(1))
    out = step(sched)
    sched.abort_request("r0")
    out = sched.schedule()
    assert not out.is_empty and out.finished_seq_ids == ["r0/0"]
    assert out.total_num_scheduled_tokens == 0
    assert sched.schedule().is_empty  # no update_from_output needed in between


def test_resumed_request_skips_sequences_that_had_already_finished():
    sched = make_scheduler()
    req = Request("x", [1, 2, 3], SamplingParams(n=2), output_token_ids=[[9], [5, 0]])
    req.seqs[1].status = RequestStatus.FINISHED_STOPPED  # ended before the restart
    sched.add_request(req)
    assert list(scheduled(step(sched))) == ["x/0"]
    sched.finish_sequence("x/0", RequestStatus.FINISHED_LENGTH)
    assert sched.take_finished_requests() == [req]
    sched.check_invariants()


def test_a_request_waits_for_a_prefix_being_computed_instead_of_computing_it_again():
    sched = make_scheduler(enable_prefix_caching=True, num_device_blocks=64)
    prefix = list(range(100, 124))  # 6 blocks of 4
    first = Request("first", [*prefix, 1, 2], SamplingParams(max_tokens=4))
    second = Request("second", [*prefix, 3, 4], SamplingParams(max_tokens=4))
    add(sched, [first, second])
    out = step(sched)
    # The second would compute the same 6 blocks beside the first: it waits one step.
    assert scheduled(out) == {"first/0": 26}
    out = step(sched)
    assert scheduled(out)["second/0"] == 2  # its prefix came from the cache
    assert sched.block_manager.prefix_cache_hits == 24


def test_waiting_for_a_prefix_ends_when_its_computation_goes_away():
    # The request computing the prefix is aborted before it is done: nobody waits for ever.
    sched = make_scheduler(
        enable_prefix_caching=True, num_device_blocks=64, max_num_batched_tokens=8
    )
    prefix = list(range(100, 124))
    add(sched, [Request("a", [*prefix, 1], SamplingParams(max_tokens=4))])
    step(sched)  # "a" computes its first chunk of 8 tokens
    add(sched, [Request("b", [*prefix, 2], SamplingParams(max_tokens=4))])
    out = step(sched)
    assert "b/0" not in scheduled(out)  # waits: a's next blocks are being computed
    sched.abort_request("a")
    out = step(sched)
    assert "b/0" in scheduled(out)


def test_unrelated_prompts_do_not_wait():
    sched = make_scheduler(enable_prefix_caching=True, num_device_blocks=64)
    reqs = make_requests(3, prompt_len=12)
    add(sched, reqs)
    out = step(sched)
    assert set(scheduled(out)) == {"r0/0", "r1/0", "r2/0"}
