"""A standby scheduler: two schedulers with --leader-election on one Redis and one executor.

- kill -9 of the leader under 50 streams: the standby takes the lease within 3 s, recovers
  every request from Redis, and every stream (clients re-attach through one channel over both
  addresses, which follows the SERVING one) ends exactly as in an undisturbed run.
- SIGSTOP of the leader until the standby has taken over, then SIGCONT: the old leader writes
  nothing to request state (checked on Redis's MONITOR feed, by connection), notices, and comes
  back as a standby.

Real processes throughout: Redis, the executor, two schedulers.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import grpc
import psutil
import pytest
import redis as redis_lib
from grpc_health.v1 import health_pb2

from protos import scheduler_pb2 as pb
from protos import scheduler_pb2_grpc as pb_grpc
from tests.support.api_helpers import collect, mixed_workload, run_in_threads
from tests.support.standby import (
    LEADER_KEY,
    electing_schedulers,
    follow_channel,
    resume_in_threads,
)

STATE_PREFIXES = (
    "llmserve:request:",
    "llmserve:tokens:",
    "llmserve:logprobs:",
    "llmserve:index:unfinished",
)


@pytest.fixture
def deployment(tmp_path):
    with electing_schedulers(tmp_path) as (start, redis):
        yield start, redis


def leader_pair(start):
    first = start("a")
    first.wait_serving(60)
    second = start("b")
    second.wait_standing_by(30)
    assert second.health() == health_pb2.HealthCheckResponse.NOT_SERVING
    with grpc.insecure_channel(second.address) as ch, pytest.raises(grpc.RpcError) as err:
        pb_grpc.SchedulerStub(ch).GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "standby" in err.value.details()
    return first, second


def test_the_standby_takes_over_a_killed_leader_under_50_streams(deployment) -> None:
    start, redis = deployment
    leader, standby = leader_pair(start)
    raw = redis_lib.Redis.from_url(redis.url)
    reqs = mixed_workload("sb", 50, 64, rng_seed=3, max_prompt_len=16)
    with follow_channel(leader, standby) as ch:
        stub = pb_grpc.SchedulerStub(ch)
        ref_reqs = mixed_workload("ref", 50, 64, rng_seed=3, max_prompt_len=16)
        reference = run_in_threads(
            [lambda r=r: collect(stub.Generate(r, timeout=120)) for r in ref_reqs]
        )
    results, codes, threads = resume_in_threads((leader, standby), reqs, min_tokens=2)
    holder = raw.get(LEADER_KEY)
    leader.proc.kill()
    killed_at = time.monotonic()
    while raw.get(LEADER_KEY) in (holder, None):
        assert time.monotonic() - killed_at < 3.0, "the standby did not take the lease in 3 s"
        time.sleep(0.02)
    took_over_s = time.monotonic() - killed_at
    for t in threads:
        t.join(timeout=200)
    unexpected = {c for c in codes if c != grpc.StatusCode.UNAVAILABLE}
    assert not unexpected, unexpected
    unfinished = [i for i, r in enumerate(results) if 0 not in r.finish]
    assert not unfinished, (unfinished, standby.log()[-3000:])
    for i, (got, ref) in enumerate(zip(results, reference, strict=True)):
        assert ref.error is None and len(ref.tokens[0]) == 64
        assert got.offsets_ok, i  # no token missed or repeated across the takeover
        assert got.tokens[0] == ref.tokens[0], i
    assert standby.health() == health_pb2.HealthCheckResponse.SERVING
    assert "leader.elected" in standby.log()
    print(f"lease taken over {took_over_s:.2f} s after the kill")
    raw.close()


def _client_ports(pid: int, redis_port: int) -> set[int]:
    """Local ports of the process's connections to Redis."""
    return {
        c.laddr.port
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.raddr and c.raddr.port == redis_port
    }


def test_a_paused_leader_writes_nothing_after_the_takeover(deployment) -> None:
    start, redis = deployment
    leader, standby = leader_pair(start)
    raw = redis_lib.Redis.from_url(redis.url)
    redis_port = raw.connection_pool.connection_kwargs["port"]
    # Detached requests keep generating with no client attached.
    reqs = [
        pb.GenerateRequest(
            request_id=f"bg-{i}",
            token_ids=pb.TokenIds(ids=[5 + i, 6, 7]),
            params=pb.SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0),
            detached=True,
        )
        for i in range(8)
    ]
    with grpc.insecure_channel(leader.address) as ch:
        stub = pb_grpc.SchedulerStub(ch)
        for r in reqs:
            next(iter(stub.Generate(r, timeout=30)))
    time.sleep(0.3)
    old_ports = _client_ports(leader.proc.pid, redis_port)
    assert old_ports
    leader.proc.send_signal(signal.SIGSTOP)
    try:
        standby.wait_serving(30)  # took the lease (2 s expiry) and recovered the requests
    finally:
        feed = MonitorFeed(redis.url)
        leader.proc.send_signal(signal.SIGCONT)
    # The old leader notices (a refused write or step, or its lease renewal) and starts over
    # as a standby: the same process, a fresh program.
    deadline = time.monotonic() + 30
    while "leader.standby" not in leader.log().split("scheduler.restarting_as_standby", 1)[-1]:
        assert time.monotonic() < deadline, leader.log()[-3000:]
        time.sleep(0.1)
    assert "scheduler.restarting_as_standby" in leader.log()
    time.sleep(1.0)
    commands = feed.stop()
    writes = [
        c
        for c in commands
        if c["port"] in old_ports and c["key"].startswith(STATE_PREFIXES) and c["write"]
    ]
    assert not writes, writes[:5]
    assert any(c["port"] in old_ports for c in commands), "the old leader never tried Redis"
    # Meanwhile the new leader finishes every request from where the old one stopped.
    with grpc.insecure_channel(standby.address) as ch:
        stub = pb_grpc.SchedulerStub(ch)
        for r in reqs:
            got = collect(stub.Resume(pb.ResumeRequest(request_id=r.request_id), timeout=120))
            assert got.error is None and got.offsets_ok and len(got.tokens[0]) == 400
    raw.close()


WRITE_COMMANDS = {"SET", "HSET", "RPUSH", "LTRIM", "DEL", "SREM", "SADD", "PEXPIRE", "EXPIRE"}


class MonitorFeed:
    """Every command Redis runs, from MONITOR, with the client port that sent it (commands a
    script runs are attributed to the client whose script call precedes them)."""

    def __init__(self, url: str) -> None:
        self._client = redis_lib.Redis.from_url(url)
        self._monitor = self._client.monitor()
        self._conn = self._monitor.__enter__()
        self.commands: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        port = None
        while not self._stop.is_set():
            try:
                c = self._conn.next_command()
            except Exception:
                return
            if c is None:
                continue
            if c["client_type"] == "tcp":
                port = int(c["client_port"])
            words = c["command"].split(" ")
            self.commands.append(
                {
                    "port": port,
                    "command": c["command"][:120],
                    "key": words[1] if len(words) > 1 else "",
                    "write": words[0].upper() in WRITE_COMMANDS,
                }
            )

    def stop(self) -> list[dict]:
        self._stop.set()
        self._client.ping()  # wakes the reader
        self._thread.join(timeout=5)
        return list(self.commands)


def test_leader_election_needs_a_shared_redis() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "scheduler_svc", "--leader-election"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--leader-election needs --redis-url" in proc.stderr


def test_clients_given_every_address_reach_the_leader(deployment, tmp_path) -> None:
    """The standby listed first: the Python client and the OpenAI frontend still reach the
    leader (one channel over all addresses sends calls only to the SERVING one)."""
    import openai

    from client import LLMClient, SamplingParams
    from tests.support.frontend import Frontend

    start, _ = deployment
    leader, standby = leader_pair(start)
    both = f"{standby.address},{leader.address}"
    with LLMClient(both, timeout=30) as client:
        for _ in range(3):
            (out,) = client.generate([5, 6, 7], SamplingParams(max_tokens=4), use_tqdm=False)
            assert len(out.outputs[0].token_ids) == 4
    fe = Frontend.start(tmp_path / "fe", both)
    try:
        fe.wait_healthy()
        oai = openai.OpenAI(base_url=f"{fe.base_url}/v1", api_key="unused")
        model = oai.models.list().data[0].id
        got = oai.completions.create(model=model, prompt="Hi", max_tokens=3)
        assert got.usage.completion_tokens >= 1
    finally:
        fe.stop()
