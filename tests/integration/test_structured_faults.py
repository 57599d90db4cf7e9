"""Structured outputs under preemption (recompute and swap) and a kill -9 of the scheduler:
the matcher is rebuilt from the tokens already generated, and outputs stay byte-identical."""

from __future__ import annotations

import json
import threading
import time

import grpc
import jsonschema
import pytest
import redis as redis_lib

from protos import scheduler_pb2 as pb
from protos import scheduler_pb2_grpc as pb_grpc
from scheduler_svc.local.redis_server import RedisServer
from tests.support.api_helpers import Collected, collect, gen_request, run_in_threads, stub_for
from tests.support.stack import make_stack
from tests.support.standby import electing_schedulers, follow_channel, resume_in_threads

ARRAY = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 99},
    "minItems": 24,
    "maxItems": 24,
}
NUM_REQUESTS = 12
MAX_TOKENS = 400


def requests(prefix: str) -> list[pb.GenerateRequest]:
    """Greedy and seeded json_schema requests of various prompts."""
    out = []
    for i in range(NUM_REQUESTS):
        req = gen_request(
            [(7 * i + j) % 200 + 5 for j in range(6 + i % 9)],
            request_id=f"{prefix}-{i}",
            max_tokens=MAX_TOKENS,
            temperature=0.0 if i % 2 == 0 else 0.8,
            seed=1000 + i,
        )
        req.params.structured_output.json_schema = json.dumps(ARRAY)
        out.append(req)
    return out


def check_valid(results: list[Collected]) -> None:
    for r in results:
        assert r.error is None, r.error
        assert r.finish[0] == pb.FINISH_REASON_STOP, r.text
        jsonschema.validate(json.loads(r.text[0]), ARRAY)


@pytest.fixture
def redis(tmp_path):
    server = RedisServer(data_dir=tmp_path / "redis")
    server.start()
    yield server
    server.close()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_constrained_outputs(tmp_path, redis, mode):
    stack = make_stack(
        tmp_path,
        redis,
        scheduler_args=["--num-device-blocks", "24", "--preemption-mode", mode],
    )
    try:
        channel, stub = stub_for(stack.address)
        alone = [collect(stub.Generate(r, timeout=120)) for r in requests("alone")]
        check_valid(alone)
        together = run_in_threads(
            [lambda r=r: collect(stub.Generate(r, timeout=120)) for r in requests("together")]
        )
        check_valid(together)
        assert [r.tokens[0] for r in together] == [r.tokens[0] for r in alone]
        assert stub.GetServerInfo(pb.GetServerInfoRequest()).num_preemptions > 0
        channel.close()
    finally:
        stack.stop()


def test_kill_9_scheduler_mid_generation_gives_identical_output(tmp_path, redis):
    stack = make_stack(tmp_path, redis, scheduler_args=["--finished-ttl", "600"])
    try:
        channel, stub = stub_for(stack.address)
        reference = run_in_threads(
            [lambda r=r: collect(stub.Generate(r, timeout=120)) for r in requests("ref")]
        )
        channel.close()
        check_valid(reference)

        run = requests("run")
        got_some = threading.Barrier(NUM_REQUESTS + 1)
        first: list[Collected] = [Collected() for _ in run]

        def start(i: int) -> None:
            ch, st = stub_for(stack.address)
            passed = False
            try:
                for msg in st.Generate(run[i]):
                    first[i].add(msg)
                    if not passed and len(first[i].tokens.get(0, [])) >= 3:
                        passed = True
                        got_some.wait(timeout=60)
            except grpc.RpcError:
                pass
            if not passed:
                got_some.wait(timeout=60)
            ch.close()

        threads = [threading.Thread(target=start, args=(i,)) for i in range(NUM_REQUESTS)]
        for t in threads:
            t.start()
        got_some.wait(timeout=120)
        stack.kill_scheduler()
        mid = [len(c.tokens.get(0, [])) for c in first]
        for t in threads:
            t.join(timeout=60)
        stack.start_scheduler()
        assert sum(1 for m, r in zip(mid, reference, strict=True) if m < len(r.tokens[0])) > 0

        def resume(req: pb.GenerateRequest) -> Collected:
            deadline = time.monotonic() + 120
            while True:
                ch, st = stub_for(stack.address)
                try:
                    resumed = pb.ResumeRequest(request_id=req.request_id, from_token_index=0)
                    out = collect(st.Resume(resumed, timeout=120))
                finally:
                    ch.close()
                if out.error is None or time.monotonic() > deadline:
                    return out
                time.sleep(0.3)

        after = run_in_threads([lambda r=r: resume(r) for r in run])
        check_valid(after)
        for i, (got, ref) in enumerate(zip(after, reference, strict=True)):
            assert got.tokens[0] == ref.tokens[0], f"request {i} differs from the undisturbed run"
            assert got.text[0] == ref.text[0]
    finally:
        stack.stop()


def test_standby_takeover_rebuilds_matchers_and_output_is_identical(tmp_path, redis):
    """Leader killed (-9) mid-generation; the standby takes the lease, recovers the requests
    from Redis, rebuilds each matcher by replaying the stored outputs, and finishes them."""
    with electing_schedulers(tmp_path, redis) as (start, _):
        leader = start("a")
        leader.wait_serving(60)
        standby = start("b")
        with follow_channel(leader, standby) as ch:
            stub = pb_grpc.SchedulerStub(ch)
            reference = run_in_threads(
                [lambda r=r: collect(stub.Generate(r, timeout=120)) for r in requests("sref")]
            )
        check_valid(reference)
        run = requests("srun")
        results, _, threads = resume_in_threads((leader, standby), run, min_tokens=2)
        leader.proc.kill()
        mid = [len(r.tokens.get(0, [])) for r in results]
        for t in threads:
            t.join(timeout=200)
        assert any(m < len(r.tokens[0]) for m, r in zip(mid, reference, strict=True)), mid
        check_valid(results)
        for i, (got, ref) in enumerate(zip(results, reference, strict=True)):
            assert got.offsets_ok, f"request {i} saw a gap or a repeat"
            assert got.tokens[0] == ref.tokens[0], f"request {i} differs from the undisturbed run"


def test_chunked_prefill_and_prefix_hits_keep_constrained_outputs(tmp_path, redis):
    """Prompts longer than the step's token budget are prefilled in chunks (only the last chunk
    samples, so only it carries a mask), and a repeated prompt starts from cached blocks: the
    outputs equal those of a stack that does neither."""
    prompts = [[(11 * i + j) % 300 + 5 for j in range(40 + 7 * i)] for i in range(4)]

    def reqs(prefix: str) -> list[pb.GenerateRequest]:
        out = []
        for i, p in enumerate(prompts * 2):  # the second round hits the prefix cache
            r = gen_request(p, request_id=f"{prefix}-{i}", max_tokens=MAX_TOKENS,
                            temperature=0.8 if i % 2 else 0.0, seed=i % 4)  # fmt: skip
            r.params.structured_output.json_schema = json.dumps(ARRAY)
            out.append(r)
        return out

    def run(stack, prefix: str) -> list[Collected]:  # ids of their own: one Redis for both
        channel, stub = stub_for(stack.address)
        got = [collect(stub.Generate(r, timeout=120)) for r in reqs(prefix)]
        stack.hits = sum(
            e.prefix_cache_hits for e in stub.GetServerInfo(pb.GetServerInfoRequest()).executors
        )
        channel.close()
        check_valid(got)
        return got

    (tmp_path / "plain").mkdir()
    (tmp_path / "chunked").mkdir()
    plain = make_stack(tmp_path / "plain", redis, scheduler_args=["--no-prefix-caching"])
    try:
        want = run(plain, "plain")
    finally:
        plain.stop()
    chunked = make_stack(
        tmp_path / "chunked",
        redis,
        scheduler_args=["--max-num-batched-tokens", "16", "--max-num-seqs", "8"],
    )
    try:
        got = run(chunked, "chunked")
    finally:
        chunked.stop()
    assert [r.tokens[0] for r in got] == [r.tokens[0] for r in want]
    assert [r.tokens[0] for r in got[:4]] == [r.tokens[0] for r in got[4:]]  # same seeds
    assert plain.hits == 0 and chunked.hits > 0


def test_stored_tokens_that_complete_the_grammar_end_the_request_after_a_crash(tmp_path, redis):
    """The step that completes a grammar writes its tokens, then (a separate write) the finish.
    A crash (or a Redis failover) between the two leaves the tokens without the finish: the
    next scheduler ends the request there with reason stop, exactly as the undisturbed run did,
    instead of sampling one token more (the EOS the complete grammar's mask forces)."""
    stack = make_stack(tmp_path, redis, scheduler_args=["--finished-ttl", "600"])
    try:
        channel, stub = stub_for(stack.address)
        reference = run_in_threads(
            [lambda r=r: collect(stub.Generate(r, timeout=120)) for r in requests("done")[:4]]
        )
        channel.close()
        check_valid(reference)
        # Redis as the crash leaves it: every token stored, the finish not.
        r = redis_lib.Redis(host="127.0.0.1", port=redis.port)
        for i in range(4):
            r.hset(f"llmserve:request:done-{i}", mapping={
                "status": "active", "finish_reasons": "[null]", "stop_reasons": "[null]"})  # fmt: skip
            r.persist(f"llmserve:request:done-{i}")
            r.persist(f"llmserve:tokens:done-{i}:0")
            r.sadd("llmserve:index:unfinished", f"done-{i}")
        stack.kill_scheduler()
        stack.start_scheduler()
        channel, stub = stub_for(stack.address)
        after = run_in_threads(
            [lambda i=i: collect(stub.Resume(pb.ResumeRequest(request_id=f"done-{i}"), timeout=60))
             for i in range(4)]
        )  # fmt: skip
        channel.close()
        check_valid(after)
        for i, (got, ref) in enumerate(zip(after, reference, strict=True)):
            assert got.tokens[0] == ref.tokens[0], f"request {i}: {len(got.tokens[0])} tokens"
            assert r.lrange(f"llmserve:tokens:done-{i}:0", 0, -1) == [
                str(t).encode() for t in ref.tokens[0]
            ]
            assert r.hget(f"llmserve:request:done-{i}", "status") == b"finished"
    finally:
        stack.stop()
