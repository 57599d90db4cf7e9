"""Plays the scheduler against a real executor over gRPC, for tests.

`ExecutorDriver` does the minimum a scheduler does: a free list of device and CPU blocks, block
tables, NewSequence for a sequence's first step (or after swap-in) and CachedSequence diffs
afterwards, chunked prefill, swap-out/swap-in and copy of a sequence's blocks. Helpers start a
real executor server, in-process or as a `llmserve-executor` subprocess.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from protos import executor_pb2 as pb
from protos import executor_pb2_grpc as pb_grpc
from tests.support.stack import stop_process

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class DriverSeq:
    seq_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: pb.SamplingParams
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prefill chunk limit per step (None: the whole remainder at once).
    chunk_size: int | None = None
    sent: bool = False  # the executor holds this sequence's state
    swapped: bool = False
    cpu_blocks: list[int] = field(default_factory=list)
    # Differences not yet sent in a CachedSequence.
    new_block_ids: list[int] = field(default_factory=list)
    replaced: dict[int, int] = field(default_factory=dict)
    outputs: list[pb.SampledToken] = field(default_factory=list)

    @property
    def output_token_ids(self) -> list[int]:
        return [s.token_id for s in self.outputs]


class ExecutorDriver:
    """A deliberately simple scheduler: every live, non-swapped sequence runs every step."""

    def __init__(
        self,
        stub: pb_grpc.ExecutorStub,
        info: pb.DescribeResponse | None = None,
        *,
        decode_lane: bool = True,
    ):
        """`decode_lane`: send plain one-token decodes in the packed decode lane, as the
        scheduler does (else every running sequence goes in cached_sequences)."""
        self.stub = stub
        self.decode_lane = decode_lane
        self.info = info or stub.Describe(pb.DescribeRequest())
        self.block_size = self.info.block_size
        self.free_device = list(range(self.info.num_device_blocks))
        self.free_cpu = list(range(self.info.num_cpu_blocks))
        self.seqs: dict[str, DriverSeq] = {}
        self.step_id = 0
        # Pending for the next step.
        self.finished: list[str] = []
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.copy: list[tuple[int, int]] = []
        self.free_after_step: list[int] = []
        self._lane_ids: list[str] = []  # the decode lane of the last built request

    # ------------------------------------------------------------ sequences

    def add(
        self,
        seq_id: str,
        prompt: list[int],
        params: pb.SamplingParams | None = None,
        *,
        chunk_size: int | None = None,
    ) -> DriverSeq:
        seq = DriverSeq(seq_id, list(prompt), len(prompt), params or pb.SamplingParams())
        seq.chunk_size = chunk_size
        self.seqs[seq_id] = seq
        return seq

    def finish(self, seq_id: str) -> DriverSeq:
        seq = self.seqs.pop(seq_id)
        if seq.sent:
            self.finished.append(seq_id)
        self.free_device.extend(seq.block_table)
        self.free_cpu.extend(seq.cpu_blocks)
        return seq

    def swap_out_seq(self, seq_id: str) -> None:
        """Move the sequence's KV to the CPU pool; the executor forgets the sequence."""
        seq = self.seqs[seq_id]
        assert seq.sent and not seq.swapped
        seq.cpu_blocks = self._alloc(self.free_cpu, len(seq.block_table))
        self.swap_out += list(zip(seq.block_table, seq.cpu_blocks, strict=True))
        self.finished.append(seq_id)
        # Freed at once: the swap-out runs before anything of this step writes the cache.
        self.free_device.extend(seq.block_table)
        seq.block_table, seq.new_block_ids, seq.replaced = [], [], {}
        seq.sent, seq.swapped = False, True

    def swap_in_seq(self, seq_id: str) -> None:
        """Bring the KV back into fresh device blocks; the sequence is re-sent as new."""
        seq = self.seqs[seq_id]
        assert seq.swapped
        seq.block_table = self._alloc(self.free_device, len(seq.cpu_blocks))
        self.swap_in += list(zip(seq.cpu_blocks, seq.block_table, strict=True))
        self.free_cpu.extend(seq.cpu_blocks)
        seq.cpu_blocks, seq.swapped = [], False

    def copy_seq_blocks(self, seq_id: str) -> None:
        """Copy every block of a running sequence to fresh blocks and point its table at them."""
        seq = self.seqs[seq_id]
        assert seq.sent and not seq.new_block_ids
        old = list(seq.block_table)
        new = self._alloc(self.free_device, len(old))
        self.copy += list(zip(old, new, strict=True))
        for i, b in enumerate(new):
            seq.replaced[i] = b
        seq.block_table = new
        # Freed after the step: within one step the executor refuses a block that is both a copy
        # source and a copy destination.
        self.free_after_step += old

    @staticmethod
    def _alloc(free: list[int], n: int) -> list[int]:
        if n > len(free):
            raise RuntimeError(f"out of blocks: need {n}, {len(free)} free")
        # Lowest ids first keeps runs reproducible.
        free.sort()
        taken, free[:] = free[:n], free[n:]
        return taken

    # ------------------------------------------------------------ steps

    def build_request(self) -> tuple[pb.ExecuteModelRequest, dict[str, int]]:
        """The next step's request and each sequence's num_scheduled_tokens."""
        req = pb.ExecuteModelRequest(step_id=self.step_id)
        req.finished_seq_ids.extend(self.finished)
        req.blocks_to_swap_out.extend(pb.BlockMapping(src=s, dst=d) for s, d in self.swap_out)
        req.blocks_to_swap_in.extend(pb.BlockMapping(src=s, dst=d) for s, d in self.swap_in)
        req.blocks_to_copy.extend(pb.BlockMapping(src=s, dst=d) for s, d in self.copy)
        num_scheduled: dict[str, int] = {}
        for seq in self.seqs.values():
            if seq.swapped:
                continue
            n = len(seq.token_ids) - seq.num_computed_tokens
            if seq.chunk_size is not None:
                n = min(n, seq.chunk_size)
            needed = -(-(seq.num_computed_tokens + n) // self.block_size)
            grow = self._alloc(self.free_device, max(0, needed - len(seq.block_table)))
            seq.block_table += grow
            num_scheduled[seq.seq_id] = n
            if not seq.sent:
                req.new_sequences.append(
                    pb.NewSequence(
                        seq_id=seq.seq_id,
                        token_ids=seq.token_ids,
                        num_prompt_tokens=seq.num_prompt_tokens,
                        sampling_params=seq.params,
                        block_table=seq.block_table,
                        num_computed_tokens=seq.num_computed_tokens,
                        num_scheduled_tokens=n,
                    )
                )
            elif (
                self.decode_lane
                and n == 1
                and not grow
                and not seq.new_block_ids
                and not seq.replaced
                and seq.num_computed_tokens + 1 == len(seq.token_ids)
                and not seq.params.num_logprobs
            ):
                req.decode_seq_ids.append(seq.seq_id)
                req.decode_num_computed_tokens.append(seq.num_computed_tokens)
            else:
                seq.new_block_ids += grow
                req.cached_sequences.append(
                    pb.CachedSequence(
                        seq_id=seq.seq_id,
                        new_block_ids=seq.new_block_ids,
                        num_scheduled_tokens=n,
                        num_computed_tokens=seq.num_computed_tokens,
                        replaced_blocks=[
                            pb.BlockReplacement(logical_index=i, block_id=b)
                            for i, b in sorted(seq.replaced.items())
                        ],
                    )
                )
        self._lane_ids = list(req.decode_seq_ids)
        return req, num_scheduled

    def step(self) -> pb.ExecuteModelResponse:
        req, num_scheduled = self.build_request()
        resp = self.stub.ExecuteModel(req)
        self.commit(resp, num_scheduled)
        return resp

    def commit(self, resp: pb.ExecuteModelResponse, num_scheduled: dict[str, int]) -> None:
        """Record a successful step: the executor now holds what was sent."""
        assert resp.step_id == self.step_id
        self.step_id += 1
        self.finished, self.swap_out, self.swap_in, self.copy = [], [], [], []
        self.free_device += self.free_after_step
        self.free_after_step = []
        for seq_id, n in num_scheduled.items():
            seq = self.seqs[seq_id]
            seq.sent = True
            seq.new_block_ids, seq.replaced = [], {}
            seq.num_computed_tokens += n
        lane = [
            pb.SampledToken(seq_id=seq_id, token_id=t, logprob=lp)
            for seq_id, t, lp in zip(
                self._lane_ids, resp.decode_token_ids, resp.decode_logprobs, strict=True
            )
        ]
        for s in [*resp.sampled, *lane]:
            seq = self.seqs[s.seq_id]
            assert seq.num_computed_tokens == len(seq.token_ids), "sampled mid-prefill"
            seq.token_ids.append(s.token_id)
            seq.outputs.append(s)

    def generate(
        self,
        prompts: dict[str, list[int]] | list[list[int]],
        max_new_tokens: int,
        params: pb.SamplingParams | None = None,
        *,
        chunk_sizes: dict[str, int] | None = None,
        before_step: Callable[[int, ExecutorDriver], None] | None = None,
        max_steps: int = 10_000,
    ) -> dict[str, list[int]]:
        """Run the given prompts together until each has `max_new_tokens` outputs."""
        if isinstance(prompts, list):
            prompts = {f"seq-{i}": p for i, p in enumerate(prompts)}
        for seq_id, prompt in prompts.items():
            self.add(seq_id, prompt, params, chunk_size=(chunk_sizes or {}).get(seq_id))
        done: dict[str, list[int]] = {}
        for i in range(max_steps):
            if len(done) == len(prompts):
                break
            if before_step is not None:
                before_step(i, self)
            self.step()
            for seq_id in prompts:
                seq = self.seqs.get(seq_id)
                if seq is not None and len(seq.outputs) >= max_new_tokens:
                    done[seq_id] = self.finish(seq_id).output_token_ids
        else:
            raise RuntimeError("generation did not finish")
        return done


# ---------------------------------------------------------------- servers


@contextlib.contextmanager
def running_executor(model: str | Path, **runner_kwargs: Any) -> Iterator[tuple[Any, int]]:
    """An in-process executor on 127.0.0.1 with an OS-chosen port: yields (ExecutorServer, port)."""
    from executor_svc.api.server import ExecutorServer

    srv = ExecutorServer(model, "127.0.0.1", 0, **runner_kwargs)
    port = srv.start()
    try:
        srv.load()
        yield srv, port
    finally:
        srv.stop(grace=1.0)


@contextlib.contextmanager
def executor_channel(port: int) -> Iterator[pb_grpc.ExecutorStub]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield pb_grpc.ExecutorStub(channel)


@contextlib.contextmanager
def executor_subprocess(
    model: str | Path,
    tmp_dir: Path,
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
) -> Iterator[tuple[subprocess.Popen, int]]:
    """`python -m executor_svc` on port 0; yields (process, port) once it reports ready."""
    port_file = tmp_dir / "executor.port"
    log_file = tmp_dir / "executor.log"
    cmd = [sys.executable, "-m", "executor_svc", "--model", str(model), "--port", "0"]
    cmd += ["--port-file", str(port_file), *args]
    with open(log_file, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    try:
        deadline = time.monotonic() + timeout
        while not port_file.exists():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"executor exited with {proc.returncode}:\n{log_file.read_text()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"executor not ready in {timeout}s:\n{log_file.read_text()}")
            time.sleep(0.1)
        yield proc, int(port_file.read_text())
    finally:
        stop_process(proc, timeout=15)
