"""The host-memory prefix tier end to end (scheduler --host-cache-blocks, core/host_tier.py): a
multi-turn chat whose working set is about three times the device cache, run by one real
executor under a scheduler without the tier and then under one with it. The outputs (greedy and
seeded) are the same tokens, the tier serves hits, fewer prompt tokens are recomputed, and every
block is free afterwards."""

from __future__ import annotations

import pytest

from scheduler_svc.local.redis_server import RedisServer
from tests.support.api_helpers import stub_for, wait_until_idle
from tests.support.chat_workload import ChatWorkload, run_chat
from tests.support.prom import free_port, scrape, total
from tests.support.stack import make_stack, stop_process

DEVICE_BLOCKS = 20  # of 16 tokens: 320 tokens
WORKLOAD = ChatWorkload(num_conversations=8, num_turns=3)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("host_tier")
    redis = RedisServer(data_dir=tmp / "redis")
    redis.start()
    executor_args = ["--num-device-blocks", str(DEVICE_BLOCKS), "--swap-space", "0.05"]
    s = make_stack(tmp, redis, executor_args=executor_args)
    yield s
    s.stop()
    redis.stop()


def _run(stack, scheduler_args: list[str], tag: str):
    """Restart the scheduler with `scheduler_args` (a fresh core: empty caches, zero counters),
    run the workload, and return its result and the executor's counters once idle."""
    stop_process(stack.scheduler_proc)
    stack.scheduler_args = scheduler_args
    stack.start_scheduler()
    channel, stub = stub_for(stack.address)
    try:
        res = run_chat(stub, WORKLOAD, tag)
        info = wait_until_idle(stub)
    finally:
        channel.close()
    return res, info


def test_the_tier_serves_hits_and_outputs_stay_identical(stack):
    assert WORKLOAD.working_set_tokens() >= 3 * DEVICE_BLOCKS * 16
    off, info_off = _run(stack, [], "off")
    port = free_port()
    on, info_on = _run(stack, ["--host-cache-blocks", "128", "--metrics-port", str(port)], "on")
    metrics = scrape(port)
    assert off.errors == [] and on.errors == [], stack.logs()
    assert all(len(o) == WORKLOAD.max_tokens for o in off.outputs)
    assert on.outputs == off.outputs
    (ex_off,), (ex_on,) = info_off.executors, info_on.executors
    assert ex_off.prefix_cache_host_hits == 0 and ex_off.num_host_cache_blocks == 0
    assert ex_on.num_host_cache_blocks == 128
    assert ex_on.prefix_cache_host_hits > 0
    for name in ("prefix_cache_host_hits", "executor_prefix_cache_host_hits"):
        assert total(metrics, f"llmserve:{name}_total") == ex_on.prefix_cache_host_hits
    recomputed_off = ex_off.prefix_cache_queries - ex_off.prefix_cache_hits
    recomputed_on = ex_on.prefix_cache_queries - ex_on.prefix_cache_hits
    # Preemptions (the turns of a round run at once) make both counts vary from run to run;
    # with every evicted block kept (128 host blocks > the working set), the tier's run
    # recomputes about half as many prompt tokens.
    assert recomputed_on < recomputed_off
    for info in (info_off, info_on):  # no block leaked
        assert info.num_running == 0 and info.kv_cache_usage == 0.0
        assert info.executors[0].num_free_blocks == info.executors[0].num_device_blocks


def test_swap_preemption_beside_the_tier_keeps_outputs_identical(stack):
    """The round's turns at once overflow the 20 device blocks: preempted requests are swapped
    out to the CPU blocks below the tier's, while the tier keeps the evicted prefix blocks."""
    off, _ = _run(stack, [], "off2")
    swap, info = _run(stack, ["--host-cache-blocks", "64", "--preemption-mode", "swap"], "swap")
    assert swap.errors == [], stack.logs()
    assert swap.outputs == off.outputs
    (ex,) = info.executors
    assert ex.prefix_cache_host_hits > 0
    assert info.kv_cache_usage == 0.0 and ex.num_free_blocks == ex.num_device_blocks
