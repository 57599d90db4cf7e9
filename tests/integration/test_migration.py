"""Live migration on drain (issue 47): streams running on executor A, executor B idle, SIGTERM
to A. Every running request moves with its KV cache to B and continues there: output
byte-identical to an undisturbed run (greedy and seeded), and no token computed again
(`llmserve:prompt_tokens_recomputed` stays 0). When the move fails (A or B killed with -9 in
the middle of the KV's byte stream), nothing is lost: the requests are recomputed on B (A dead)
or stay on A, which finishes them (B dead), and the output is still identical.

Real processes: Redis, two executors, the scheduler. B is paused (SIGSTOP) until the health
probe marks it down, so that the reference run and the streams run on A alone; it is let go
(SIGCONT) and back, idle, before A is told to drain. Failpoints open a window to kill an end in,
with the bytes relayed in 64 KiB gRPC chunks: `engine.kv_move=delay:S` holds the scheduler's
relay for S seconds after the first chunk (B holds the header and the first bytes), and
`executor.export_kv=delay:S` holds A's export after its first chunk, so that A dies with the
rest of its payload unsent (without it the scheduler's HTTP/2 receive window may already hold
the whole export, and the move then succeeds).
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from protos import scheduler_pb2 as pb
from scheduler_svc.local.redis_server import RedisServer
from tests.support.api_helpers import (
    collect,
    mixed_workload,
    run_in_threads,
    stream_in_threads,
    stub_for,
)
from tests.support.prom import free_port, scrape, total
from tests.support.stack import Stack, start_two_executor_stack

NUM_STREAMS = 64
MAX_TOKENS = 240
EXECUTOR_ARGS = ["--num-device-blocks", "512", "--swap-space", "0.01", "--log-level", "info"]


class Pair:
    """The scheduler with executors A (leaves) and B (takes over)."""

    def __init__(self, stack: Stack, leaving: Stack, metrics_port: int) -> None:
        self.stack, self.leaving, self.metrics_port = stack, leaving, metrics_port
        self.a, self.b = leaving.executor_proc, stack.executor_proc
        self.a_address, self.b_address = leaving.executor_address, stack.executor_address
        self.channel, self.stub = stub_for(stack.address)

    def metric(self, name: str) -> float:
        return total(scrape(self.metrics_port), name)

    def executors(self) -> dict[str, pb.ExecutorInfo]:
        return {e.address: e for e in self.stub.GetServerInfo(pb.GetServerInfoRequest()).executors}

    def wait_b(self, healthy: bool) -> pb.ExecutorInfo:
        deadline = time.monotonic() + 30
        while (info := self.executors()[self.b_address]).healthy != healthy:
            assert time.monotonic() < deadline, f"B never became healthy={healthy}"
            time.sleep(0.02)
        return info

    def scheduler_log(self) -> str:
        return (self.stack.workdir / "scheduler.log").read_text(errors="replace")

    def a_log(self) -> str:
        return (self.leaving.workdir / "executor.log").read_text(errors="replace")


@contextmanager
def pair_of_executors(
    tmp: Path, scheduler_args: tuple[str, ...] = (), b_args: tuple[str, ...] = ()
) -> Iterator[Pair]:
    """Redis, A, B (`b_args` after the common flags) and the scheduler; B is paused (SIGSTOP)
    until the health probe finds it gone, so that everything runs on A until the test lets it
    back (`streams_on_a_with_b_idle`)."""
    redis = RedisServer(data_dir=tmp / "redis")
    redis.start()
    port = free_port()
    stack, leaving = start_two_executor_stack(
        tmp,
        redis,
        [*EXECUTOR_ARGS, *b_args],
        second_args=[*EXECUTOR_ARGS, "--drain-timeout", "60"],
        scheduler_args=["--executor-failover", "600", "--metrics-port", str(port)]
        + ["--log-level", "info", *scheduler_args],
    )
    try:
        pair = Pair(stack, leaving, port)
        pair.b.send_signal(signal.SIGSTOP)
        pair.wait_b(healthy=False)
        yield pair
        pair.channel.close()
    except BaseException:
        print(stack.logs(), leaving.logs())
        raise
    finally:
        with contextlib.suppress(ProcessLookupError):
            pair.b.send_signal(signal.SIGCONT)
        stack.stop()
        leaving.stop()
        redis.close()


def reference_run(pair: Pair) -> list:
    """The workload undisturbed, on A alone."""
    reqs = mixed_workload("ref", NUM_STREAMS, MAX_TOKENS, rng_seed=11, max_prompt_len=24)
    reference = run_in_threads([lambda r=r: collect(pair.stub.Generate(r)) for r in reqs])
    assert all(r.error is None and len(r.tokens[0]) == MAX_TOKENS for r in reference)
    return reference


def streams_on_a_with_b_idle(pair: Pair, prefix: str):
    """NUM_STREAMS streams started on A; then B is back (idle)."""
    reqs = mixed_workload(prefix, NUM_STREAMS, MAX_TOKENS, rng_seed=11, max_prompt_len=24)
    results, threads = stream_in_threads(pair.stub, reqs)
    pair.b.send_signal(signal.SIGCONT)
    idle = pair.wait_b(healthy=True)
    assert idle.num_free_blocks == idle.num_device_blocks
    busy = pair.executors()[pair.a_address]
    assert busy.num_free_blocks < busy.num_device_blocks
    assert min(len(r.tokens.get(0, [])) for r in results) < MAX_TOKENS, "finished too soon"
    return results, threads


def check_identical(results: list, reference: list, threads: list) -> None:
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "streams hung"
    for i, (got, ref) in enumerate(zip(results, reference, strict=True)):
        assert got.error is None, (i, got.error)
        assert got.offsets_ok, i  # no token missed or repeated
        assert got.tokens[0] == ref.tokens[0], i


# auto: shared memory (both on loopback); push: A streams the bytes to B itself (PushKV).
@pytest.mark.parametrize("transport", ["auto", "push"])
def test_sigterm_moves_every_running_stream_to_the_idle_executor(tmp_path, transport):
    with pair_of_executors(tmp_path, ("--migrate-transport", transport)) as pair:
        reference = reference_run(pair)
        recomputed_before = pair.metric("llmserve:prompt_tokens_recomputed_total")
        results, threads = streams_on_a_with_b_idle(pair, "mig")
        pair.a.send_signal(signal.SIGTERM)
        check_identical(results, reference, threads)
        assert pair.a.wait(timeout=60) == 0  # drained and gone
        assert pair.metric("llmserve:requests_migrated_total") == NUM_STREAMS
        assert pair.metric("llmserve:prompt_tokens_recomputed_total") == recomputed_before == 0
        log = pair.scheduler_log()
        assert f"moved_requests={NUM_STREAMS}" in log and "left_requests=0" in log, log[-3000:]
        assert "executor.failed_over" not in log
        b_log = (pair.stack.workdir / "executor.log").read_text()
        assert "kv.imported" in b_log
        assert ("kv.pushed" in pair.a_log()) == (transport == "push")


MID_STREAM = ("--migrate-transport", "grpc", "--migrate-chunk-bytes", str(64 << 10))
# victim: (failpoints, scheduler flags, the log lines (scheduler's, A's) that open the window)
CUTS = {
    # A's export stands still after its first chunk, which the relay has passed on to B: A dies
    # in the middle of the byte stream, B holding the header and the first bytes.
    "a": (
        "executor.export_kv=delay:30;engine.kv_move=delay:0.2",
        MID_STREAM,
        ("kv_move.paused_mid_stream", "kv.export_paused"),
    ),
    # The relay stands still after the first chunk: B dies holding a partial import.
    "b": ("engine.kv_move=delay:1.5", MID_STREAM, ("kv_move.paused_mid_stream", "")),
}


@pytest.mark.parametrize("victim", sorted(CUTS))
def test_a_move_cut_short_by_a_dead_end_loses_nothing(tmp_path, monkeypatch, victim):
    """kill -9 of A (the source) or B (the destination) during the move: B's blocks are freed
    and the requests take the path without migration. A dead: they are recomputed on B (the
    counter goes up). B dead: they stay on A, which finishes them while it drains."""
    failpoints, scheduler_args, (window, a_window) = CUTS[victim]
    monkeypatch.setenv("LLMSERVE_FAILPOINTS", failpoints)
    with pair_of_executors(tmp_path, scheduler_args) as pair:
        reference = reference_run(pair)
        results, threads = streams_on_a_with_b_idle(pair, "cut")
        pair.a.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while window not in pair.scheduler_log() or a_window not in pair.a_log():
            assert time.monotonic() < deadline, "the migration never started"
            time.sleep(0.02)
        proc = pair.a if victim == "a" else pair.b
        proc.kill()
        proc.wait()
        check_identical(results, reference, threads)
        log = pair.scheduler_log()
        assert "executor.migration_failed" in log, log[-3000:]
        assert pair.metric("llmserve:requests_migrated_total") == 0
        recomputed = pair.metric("llmserve:prompt_tokens_recomputed_total")
        if victim == "a":
            assert recomputed > 0 and "executor.failed_over" in log
        else:
            assert recomputed == 0 and pair.a.wait(timeout=60) == 0
