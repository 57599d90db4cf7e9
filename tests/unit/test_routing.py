"""Routing across executors (scheduler_svc/engine/fleet/routing.py) over real scheduling cores.

Each "executor" here is an ExecutorHandle with a real Scheduler core and no connection: routing
reads only the cores (their prefix caches, blocks in use, waiting queues) and health flags.
"""

from __future__ import annotations

import pytest

from protos import executor_pb2 as epb
from scheduler_svc.core.request import Request
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.engine.fleet.executors import ExecutorHandle, ExecutorState
from scheduler_svc.engine.fleet.routing import Router, cached_prefix_blocks
from tests.unit.test_scheduler import make_scheduler, step

BS = 4
PREFIX_A = list(range(100, 132))  # 8 blocks
PREFIX_B = list(range(200, 232))


def executor(name: str, blocks: int = 64) -> ExecutorHandle:
    sched = make_scheduler(
        enable_prefix_caching=True, num_device_blocks=blocks, block_size=BS, max_num_seqs=16
    )
    describe = epb.DescribeResponse(instance_id=name, block_size=BS, num_device_blocks=blocks)
    return ExecutorHandle(name, None, None, describe, sched)  # type: ignore[arg-type]


def request(rid: str, prefix: list[int], own: int, max_tokens: int = 2) -> Request:
    prompt = [*prefix, *[9000 + own * 10 + j for j in range(3)]]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens))


def run_to_completion(ex: ExecutorHandle, req: Request) -> None:
    ex.sched.add_request(req)
    while ex.sched.num_unfinished:
        step(ex.sched)
        ex.step_id += 1
    ex.sched.take_finished_requests()


def warm(ex: ExecutorHandle, prefix: list[int], rid: str) -> None:
    run_to_completion(ex, request(rid, prefix, own=99))


def test_counts_the_leading_blocks_an_executor_has_cached() -> None:
    a, b = executor("a"), executor("b")
    warm(a, PREFIX_A, "w")
    req = request("r", PREFIX_A, own=1)
    assert cached_prefix_blocks(a, req, {}) == len(PREFIX_A) // BS
    assert cached_prefix_blocks(b, req, {}) == 0
    # A prompt that diverges after two blocks matches two.
    other = request("o", [*PREFIX_A[:8], *range(500, 524)], own=2)
    assert cached_prefix_blocks(a, other, {}) == 2


def test_kv_routes_each_prefix_to_the_executor_holding_it() -> None:
    a, b = executor("a"), executor("b")
    warm(a, PREFIX_A, "wa")
    warm(b, PREFIX_B, "wb")
    router = Router("kv")
    for i in range(6):
        assert router.choose([a, b], request(f"ra{i}", PREFIX_A, own=i)) is a
        assert router.choose([a, b], request(f"rb{i}", PREFIX_B, own=i)) is b


def test_kv_weighs_the_saved_prefill_against_load() -> None:
    a, b = executor("a"), executor("b")
    warm(a, PREFIX_A, "wa")
    router = Router("kv")
    # On a, a request with PREFIX_A prefills 1 block (its own); on b all 9. Each one queued on a
    # adds its 1 block to a's load, so once a's queue outweighs the 8 blocks its cache saves,
    # requests go to the idle b.
    chosen = []
    for i in range(12):
        req = request(f"r{i}", PREFIX_A, own=i)
        ex = router.choose([a, b], req)
        ex.sched.add_request(req)
        chosen.append(ex.address)
    assert chosen[:9] == ["a"] * 9 and chosen[9] == "b", chosen
    # At the next step the load is recounted from the cores: a's nine queued requests need a
    # block each (their prefix is cached there), b's three need 9 each; the next one costs
    # 1 + 9 on a and 9 + 27 on b.
    a.step_id += 1
    b.step_id += 1
    assert router.choose([a, b], request("next", PREFIX_A, own=50)) is a


def test_running_sequences_count_as_load_not_the_blocks_they_share() -> None:
    a, b = executor("a"), executor("b")
    warm(a, PREFIX_A, "wa")
    for i in range(4):  # four requests with the cached prefix start running on a
        a.sched.add_request(request(f"run{i}", PREFIX_A, own=i, max_tokens=50))
    step(a.sched)
    a.step_id += 1
    assert a.sched.num_running_seqs == 4
    # a: 1 block to prefill + 4 running; b: 9 blocks. Blocks in use on a (the shared prefix)
    # are not load: a wins.
    assert Router("kv").choose([a, b], request("new", PREFIX_A, own=9)) is a


def test_least_loaded_and_round_robin_ignore_the_cache() -> None:
    a, b = executor("a"), executor("b")
    warm(a, PREFIX_A, "wa")
    rr = Router("round-robin")
    picks = [rr.choose([a, b], request(f"r{i}", PREFIX_A, own=i)).address for i in range(4)]
    assert picks == ["a", "b", "a", "b"]
    b.sched.add_request(request("busy", PREFIX_B, own=0))
    least = Router("least-loaded")
    assert least.choose([a, b], request("x", PREFIX_B, own=5)) is a  # b has one waiting


def test_unhealthy_and_draining_executors_get_nothing_while_another_can() -> None:
    a, b = executor("a"), executor("b")
    warm(a, PREFIX_A, "wa")
    router = Router("kv")
    a.state = ExecutorState.DRAINING
    assert router.choose([a, b], request("r1", PREFIX_A, own=1)) is b
    a.state = ExecutorState.DOWN
    assert router.choose([a, b], request("r2", PREFIX_A, own=2)) is b
    b.state = ExecutorState.DOWN  # nobody healthy: somewhere to queue it all the same
    assert router.choose([a, b], request("r3", PREFIX_A, own=3)) in (a, b)


def test_unknown_policy() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        Router("random")


def test_a_burst_with_a_new_prefix_follows_the_first_request() -> None:
    # Nothing is cached yet: the first request goes anywhere; the next ones with the same
    # prefix, routed before it is prefilled, count its blocks as soon cached there. (With the
    # default weight 1 the second goes to the idle executor: 9 blocks there against 1 + the
    # first's 9 queued; a prefill weight of 2 keeps the burst together.)
    a, b = executor("a"), executor("b")
    router = Router("kv", prefill_weight=2.0)
    picks = []
    for i in range(4):
        req = request(f"r{i}", PREFIX_B, own=i)
        ex = router.choose([a, b], req)
        ex.sched.add_request(req)
        picks.append(ex.address)
    assert len(set(picks)) == 1, picks
    # ...for a while: after many steps without the blocks appearing, the claim lapses.
    first = a if picks[0] == "a" else b
    first.step_id += 1000
    assert cached_prefix_blocks(first, request("x", PREFIX_B, own=9), {}, {}) == 0
    assert router.choose([a, b], request("late", PREFIX_B, own=8)) is not first


def test_lora_requests_prefer_the_executor_holding_their_adapter() -> None:
    from scheduler_svc.features.lora.ref import LoraRef, core_fields

    a, b = executor("a"), executor("b")
    router = Router("kv")
    lora = LoraRef("ad", "/adapters/ad")

    def lora_request(rid: str, own: int) -> Request:
        prompt = [9000 + own * 10 + j for j in range(7)]
        return Request(rid, prompt, SamplingParams(max_tokens=2), **core_fields(lora))

    first = router.choose([a, b], lora_request("r0", 0))
    other = b if first is a else a
    # Load on the holder short of the adapter miss cost keeps the adapter's requests there.
    for i in range(3):
        first.sched.add_request(request(f"busy{i}", [], own=i + 1))
    assert router.choose([a, b], lora_request("r1", 1)) is first
    assert router.holds_adapter(first, lora_request("r2", 2))
    assert not router.holds_adapter(other, lora_request("r2", 2))
    # A base-model request sees no adapter term: it goes to the idle executor.
    assert router.choose([a, b], request("base", [], own=5)) is other


def test_a_lora_prefix_is_not_a_base_model_hit() -> None:
    from scheduler_svc.features.lora.ref import LoraRef, core_fields

    a = executor("a")
    warm(a, PREFIX_A, "w")
    lora_req = Request(
        "l", [*PREFIX_A, 1, 2, 3], SamplingParams(max_tokens=2), **core_fields(LoraRef("x", "/x"))
    )
    assert cached_prefix_blocks(a, lora_req, {}) == 0
    assert cached_prefix_blocks(a, request("r", PREFIX_A, own=1), {}) == len(PREFIX_A) // BS


def test_blocks_in_the_host_tier_count_as_cached() -> None:
    # 12 device blocks: warming PREFIX_B evicts PREFIX_A from a's device into its host tier.
    sched = make_scheduler(
        enable_prefix_caching=True,
        num_device_blocks=12,
        num_cpu_blocks=16,
        num_host_cache_blocks=16,
        block_size=BS,
        max_num_seqs=16,
    )
    describe = epb.DescribeResponse(instance_id="a", block_size=BS, num_device_blocks=12)
    a = ExecutorHandle("a", None, None, describe, sched)  # type: ignore[arg-type]
    b = executor("b")
    warm(a, PREFIX_A, "wa")
    warm(a, PREFIX_B, "wb")
    req = request("r", PREFIX_A, own=1)
    seq = req.seqs[0]
    hits = a.sched.block_manager.find_cached_prefix(seq, len(seq.token_ids) - 1)
    assert [type(h).__name__ for h in hits] == ["HostHit"] * (len(PREFIX_A) // BS)
    assert cached_prefix_blocks(a, req, {}) == len(PREFIX_A) // BS
    assert Router("kv").choose([b, a], req) is a
