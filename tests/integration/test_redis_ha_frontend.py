"""The issue-42 acceptance run: OpenAI HTTP streams through the frontend, a leader scheduler and
its standby, on Redis with 2 replicas and 3 Sentinels, while the Redis primary is killed -9
twice (the second time the replica the first failover promoted) and, in that second failover,
the leader scheduler too. Every stream ends as in an undisturbed run: the same text, the same
per-token logprobs, the same finish reasons and token counts, byte for byte; none breaks.

100 streams: completions and chat, greedy and seeded, some with logprobs, some constrained by a
JSON schema (`response_format`), some with n = 2. Each client sends its request once and reads
one HTTP stream; the frontend re-attaches to the scheduler behind it (`Resume`) whenever the
scheduler goes away. `--redis-min-replicas 1`: every token a client gets is on a replica first.

This is not the mutation check (LLMSERVE_TEST_MIN_REPLICAS=0 runs it without the barrier):
tokens Redis lost are recomputed by the next leader, and greedy and seeded outputs are exact,
so a client re-attaching from where it was gets the same tokens whether or not they survived.
The loss itself, tokens a client got missing on the promoted replica, is what
test_redis_ha_streams.py checks (and fails with --redis-min-replicas 0).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from tests.support.api_helpers import run_in_threads
from tests.support.frontend import Frontend
from tests.support.standby import SERVING, Scheduler, leader_and_standby

pytestmark = pytest.mark.timeout(300)

NUM_STREAMS = 100
MIN_REPLICAS = os.environ.get("LLMSERVE_TEST_MIN_REPLICAS", "1")
MAX_TOKENS = 48
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "boolean"}, "size": {"enum": ["small", "large"]}},
    "required": ["answer", "size"],
    "additionalProperties": False,
}


def request_body(i: int, model: str) -> tuple[str, dict]:
    """(path, body) of stream `i`: five kinds in turn, greedy and seeded alternating (n = 2 is
    always seeded, so that its two choices differ)."""
    kind = i % 5
    seeded = i % 2 == 1 or kind == 2
    body: dict = {
        "model": model,
        "max_tokens": MAX_TOKENS,
        "stream_options": {"include_usage": True},
        **({"temperature": 0.9, "seed": 1000 + i} if seeded else {"temperature": 0.0}),
    }
    if kind != 3:
        body["ignore_eos"] = True  # full length: still running when the kills come
    if kind in (0, 1):
        body["prompt"] = f"Item {i}: the story of number {i * 7 % 13} goes"
        if kind == 1:
            body["logprobs"] = 2
        return "/v1/completions", body
    body["messages"] = [{"role": "user", "content": f"Question {i}: is {i % 9} large?"}]
    if kind == 2:
        body["n"] = 2
    elif kind == 3:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": SCHEMA},
        }
    else:
        body.update(logprobs=True, top_logprobs=2)
    return "/v1/chat/completions", body


def canonical(events: list[dict]) -> dict:
    """What a client keeps of a stream, independent of how tokens were grouped into events:
    per choice its text, one entry per token's logprobs, its finish reason; and the usage."""
    choices: dict[int, dict] = {}
    usage = None
    for ev in events:
        assert "error" not in ev, ev
        usage = ev.get("usage") or usage
        for c in ev.get("choices", []):
            ch = choices.setdefault(c["index"], {"text": "", "logprobs": [], "finish": None})
            ch["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
            ch["finish"] = c.get("finish_reason") or ch["finish"]
            lp = c.get("logprobs")
            if lp and "content" in lp:  # chat: a list of per-token entries
                ch["logprobs"].extend(json.dumps(e, sort_keys=True) for e in lp["content"])
            elif lp:  # completions: parallel lists
                per_token = zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                                lp["text_offset"], strict=True)  # fmt: skip
                ch["logprobs"].extend(json.dumps(e, sort_keys=True) for e in per_token)
    return {"choices": choices, "usage": usage}


class Streams:
    """The 100 streams running through the frontend, one thread each."""

    def __init__(self, fe: Frontend, bodies: list[tuple[str, dict]]) -> None:
        self.bodies = bodies
        self.events: list[list[dict]] = [[] for _ in self.bodies]
        self.done: list[bool | BaseException | None] = [None] * NUM_STREAMS
        self.threads = [
            threading.Thread(target=self._run, args=(fe, i)) for i in range(NUM_STREAMS)
        ]
        for t in self.threads:
            t.start()

    def _run(self, fe: Frontend, i: int) -> None:
        path, body = self.bodies[i]
        try:
            self.done[i] = fe.stream(path, body, self.events[i])
        except BaseException as e:  # reported by the test, not lost in a thread
            self.done[i] = e

    def counts(self) -> list[int]:
        return [len(ev) for ev in self.events]

    def wait_change(self, held: list[int], timeout: float = 60) -> float | None:
        """Until any stream has an event beyond `held`: when (time.monotonic()), or None if
        every stream has ended meanwhile."""
        deadline = time.monotonic() + timeout
        while self.counts() == held:
            if not self.progress():
                return None
            assert time.monotonic() < deadline, "no event after the failover"
            time.sleep(0.002)
        return time.monotonic()

    def progress(self) -> list[int]:
        """Events so far of every stream still running."""
        return [len(ev) for ev, d in zip(self.events, self.done, strict=True) if d is None]

    def wait_progress(self, more: int, timeout: float = 60) -> None:
        """Until every running stream has `more` events beyond what it has now."""
        want = [len(ev) + more for ev in self.events]
        deadline = time.monotonic() + timeout
        rows = zip(self.events, want, self.done, strict=True)
        while any(len(ev) < w and d is None for ev, w, d in rows):
            assert time.monotonic() < deadline, f"the streams stalled: {self.progress()}"
            time.sleep(0.01)
            rows = zip(self.events, want, self.done, strict=True)


def wait_leader(pair: tuple[Scheduler, ...], timeout: float = 60) -> Scheduler:
    """The scheduler that serves (holds the lease), once one does."""
    deadline = time.monotonic() + timeout
    while True:
        for s in pair:
            if s.proc.poll() is None and s.health() == SERVING:
                return s
        assert time.monotonic() < deadline, "no scheduler serves"
        time.sleep(0.02)


def test_http_streams_through_two_primary_kills_and_a_leader_kill_are_unchanged(tmp_path):
    topology = leader_and_standby(tmp_path, num_device_blocks=1024, min_replicas=MIN_REPLICAS)
    with topology as (ha, stack, pair):
        fe = Frontend.start(tmp_path / "fe", ",".join(s.address for s in pair),
                            "--resume-timeout", "120")  # fmt: skip
        try:
            fe.wait_healthy()
            model = fe.request("GET", "/v1/models")[1]["data"][0]["id"]
            bodies = [request_body(i, model) for i in range(NUM_STREAMS)]
            reference = run_in_threads([lambda b=b: _stream_all(fe, *b) for b in bodies])
            reference = [canonical(evs) for evs in reference]
            t0 = time.monotonic()
            streams = Streams(fe, bodies)
            streams.wait_progress(1)  # the engine is ahead of what clients have read
            # Kill 1: the primary, while steps are being written. The executor is frozen at
            # once until the failover is done: the engine runs ahead of what HTTP clients have
            # read, and would otherwise finish every stream before the second kill.
            first = ha.kill_primary()
            first_at = time.monotonic()
            stack.executor_proc.send_signal(signal.SIGSTOP)
            try:
                ha.wait_failover(first)
                time.sleep(0.3)  # what was released before the kill has reached the clients
                held = streams.counts()
            finally:
                stack.executor_proc.send_signal(signal.SIGCONT)
            resumed_at = streams.wait_change(held)
            assert resumed_at is not None, "every stream ended before the second kill"
            # Kill 2, at the first event written through the promoted replica: that replica
            # and the leader scheduler. The last replica is promoted, with no replica left to
            # acknowledge writes: every stream and the next leader's epoch are held until the
            # node of kill 1 is back as its replica.
            assert streams.progress(), "every stream ended before the second kill"
            leader = wait_leader(pair)
            second = ha.kill_primary()
            assert second is not first
            leader.proc.kill()
            killed_at = time.monotonic()
            ha.wait_failover(second)
            ha.restart_as_replica(first)
            resumed_at_2 = streams.wait_change(streams.counts())
            for t in streams.threads:
                t.join(timeout=200)
            elapsed = time.monotonic() - t0
            broken = [(i, d) for i, d in enumerate(streams.done) if d is not True]
            assert not broken, (broken[:5], fe.log()[-3000:])
            for i, (events, ref) in enumerate(zip(streams.events, reference, strict=True)):
                assert canonical(events) == ref, f"stream {i} ({bodies[i][0]}) differs"
            full = [r for (_, b), r in zip(bodies, reference, strict=True) if "ignore_eos" in b]
            assert all(
                r["usage"]["completion_tokens"] == MAX_TOKENS * len(r["choices"]) for r in full
            )
            log = fe.log()
            assert "frontend.stream_interrupted" in log  # they were cut, and re-attached
            assert "Traceback" not in log
            outage_2 = "-" if resumed_at_2 is None else f"{resumed_at_2 - killed_at:.2f} s"
            print(f"{NUM_STREAMS} streams in {elapsed:.1f} s; the primary's death to the next "
                  f"event: {resumed_at - first_at:.2f} s, {outage_2} (the leader killed too)")  # fmt: skip
        finally:
            fe.stop()


def _stream_all(fe: Frontend, path: str, body: dict) -> list[dict]:
    events: list[dict] = []
    assert fe.stream(path, body, events), f"the reference stream {path} broke"
    return events
