"""ExecuteModel message size against context length, and scheduler CPU time per step.

Part 1 drives the scheduler core (no executor, no network) with fake sampled tokens: BATCH
requests with distinct prompts of CONTEXT tokens each, prefilled, then decoded. It records
`step_message.execute_request(out, step).ByteSize()` of every step:

* prefill (one step): the token budget admits the whole batch at once, so the first step carries
  every prompt in full (the only time the executor sees the tokens);
* prefill (chunked): the engine's default budget of 2048 tokens; bytes summed over every step
  until the batch decodes, to show a prompt is sent once even when its prefill is split;
* decode: steady-state steps, one token per sequence, no sequence crossing a block boundary;
* decode + new block: the step on which every sequence starts a new 16-token block (they
  decode in lockstep, so all BATCH sequences get a block on the same step).

Request ids are 32 hex characters, like the ids the engine makes up (uuid4().hex). The KV
cache has the same number of blocks for every context length, sized for the longest.

Part 2 times schedule + message build + update_from_output per step at 64 and 256 running
sequences with `bench_step` from bench_scheduler.py (the engine's own message builder).

    .venv/bin/python benchmarks/bench_message_size.py [--contexts 128,512,2048,8192] \
        [--steps 2000] [--repeats 3] [--write-notes]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_scheduler import bench_step  # noqa: E402

from scheduler_svc.core.request import Request  # noqa: E402
from scheduler_svc.core.sampling_params import SamplingParams  # noqa: E402
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from scheduler_svc.engine.fleet import step_message  # noqa: E402

NOTES = ROOT / "docs" / "bench-notes" / "message_size.md"
BLOCK_SIZE = 16
VOCAB = 32000
DECODE_STEPS = 48  # three block boundaries at block size 16
CHUNKED_BUDGET = 2048  # EngineConfig.max_num_batched_tokens default


def make_scheduler(batch: int, context: int, *, budget: int, num_blocks: int, max_len: int):
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=batch,
            block_size=BLOCK_SIZE,
            num_device_blocks=num_blocks,
            max_model_len=max_len,
            max_waiting=batch,
        )
    )
    for i in range(batch):
        prompt = [(i * 7919 + j * 31) % VOCAB for j in range(context)]
        params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
        sched.add_request(Request(f"{i:032x}", prompt, params))
    return sched


def step(sched: Scheduler, token: int = 11) -> tuple[Any, int]:
    """One scheduled step with fake sampled tokens; returns (SchedulerOutput, message bytes)."""
    out = sched.schedule()
    size = step_message.execute_request(out, out.step_id).ByteSize()
    sampled = {seq.seq_id: token for seq, _ in out.scheduled}
    sched.update_from_output(out, sampled)
    return out, size


def is_decode(out: Any, batch: int) -> bool:
    return (
        not out.new_seqs
        and len(out.cached_seqs) + len(out.decode_seq_ids)
        == batch
        == out.total_num_scheduled_tokens
    )


def measure_context(batch: int, context: int, *, num_blocks: int, max_len: int) -> dict[str, float]:
    # Whole batch in one prefill step, then decode.
    sched = make_scheduler(
        batch, context, budget=batch * context, num_blocks=num_blocks, max_len=max_len
    )
    out, first = step(sched)
    assert len(out.new_seqs) == batch, "the first step should admit the whole batch"
    prefill_steps = 1
    while True:
        out, size = step(sched)
        if is_decode(out, batch):
            break
        prefill_steps += 1
        assert prefill_steps < 10, "the batch should decode right after its prefill step"
    plain, with_block, blocks_per_step = [], [], []
    for _ in range(DECODE_STEPS):
        new_blocks = sum(len(c.new_block_ids) for c in out.cached_seqs)
        (with_block if new_blocks else plain).append(size)
        if new_blocks:
            blocks_per_step.append(new_blocks)
        out, size = step(sched)
        assert is_decode(out, batch)
    sched.check_invariants()
    # The engine's default budget: chunked prefill, prompt bytes summed over every step.
    chunked = make_scheduler(
        batch, context, budget=CHUNKED_BUDGET, num_blocks=num_blocks, max_len=max_len
    )
    total, steps = 0, 0
    while True:
        out, size = step(chunked)
        if is_decode(out, batch):
            break
        total += size
        steps += 1
        assert steps <= 2 * batch * context // (CHUNKED_BUDGET - batch) + 10, "never decodes"
    return {
        "prefill_bytes": first,
        "prefill_steps": prefill_steps,
        "chunked_bytes": total,
        "chunked_steps": steps,
        "decode_bytes": statistics.median(plain),
        "decode_min": min(plain),
        "decode_max": max(plain),
        "block_bytes": statistics.median(with_block),
        "block_max": max(with_block),
        "blocks_per_block_step": statistics.median(blocks_per_step),
        "num_block_steps": len(with_block),
    }


def size_table(batch: int, contexts: list[int]) -> str:
    max_ctx = max(contexts)
    # Sequences whose chunked prefill ends first decode while the others still prefill.
    chunked_steps = -(-batch * max_ctx // (CHUNKED_BUDGET - batch))
    max_len = max_ctx + max(DECODE_STEPS, chunked_steps) + 2 * BLOCK_SIZE
    # 5% on top of what the batch needs: admission keeps a watermark (1%) of blocks free.
    num_blocks = int(batch * (-(-max_len // BLOCK_SIZE) + 1) * 1.05)
    lines = [
        f"Batch {batch}, block size {BLOCK_SIZE}, {num_blocks} device blocks for every context.",
        "",
        "| context (tokens/seq) | prefill step, whole batch (bytes) | chunked prefill, budget "
        "2048: total bytes / steps | decode step (bytes, min-max) | decode step + new block "
        "(bytes) | bytes/seq decode | bytes/seq + block |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for ctx in contexts:
        r = measure_context(batch, ctx, num_blocks=num_blocks, max_len=max_len)
        lines.append(
            f"| {ctx} | {r['prefill_bytes']:,} | {r['chunked_bytes']:,} / "
            f"{r['chunked_steps']} | {r['decode_bytes']:,.0f} ({r['decode_min']:,}-"
            f"{r['decode_max']:,}) | {r['block_bytes']:,.0f} "
            f"({r['blocks_per_block_step']:.0f} blocks, {r['num_block_steps']} of "
            f"{DECODE_STEPS} steps) | {r['decode_bytes'] / batch:.1f} | "
            f"{r['block_bytes'] / batch:.1f} |"
        )
        print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines)


def cpu_table(batches: list[int], steps: int, repeats: int) -> str:
    def build(out: Any) -> object:
        return step_message.execute_request(out, 0)

    runs: dict[int, list[dict[str, float]]] = {n: [] for n in batches}
    for _ in range(repeats):  # interleaved so background load hits both sizes alike
        for n in batches:
            runs[n].append(bench_step(n, steps, build_message=build))
    lines = [
        "| running seqs | schedule (us) | message build (us) | update_from_output (us) "
        "| total median (us) | total p99 (us) | per-repeat totals (us) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n in batches:
        rs = runs[n]

        def m(key: str, rs: list[dict[str, float]] = rs) -> float:
            return statistics.median(r[key] for r in rs)

        lines.append(
            f"| {n} | {m('schedule_us'):.0f} | {m('build_us'):.0f} | {m('update_us'):.0f} | "
            f"{m('total_us'):.0f} | {m('p99_us'):.0f} | "
            + ", ".join(f"{r['total_us']:.0f}" for r in rs)
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--contexts", default="128,512,2048,8192")
    ap.add_argument("--steps", type=int, default=2000, help="timed steps per bench_step run")
    ap.add_argument("--repeats", type=int, default=3, help="bench_step runs per batch size")
    ap.add_argument("--write-notes", action="store_true", help=f"write {NOTES}")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    sizes = size_table(args.batch, contexts)
    print(sizes, flush=True)
    cpu = cpu_table([64, 256], args.steps, args.repeats)
    print()
    print(cpu)
    if args.write_notes:
        cmd = ".venv/bin/python benchmarks/bench_message_size.py " + " ".join(sys.argv[1:])
        NOTES.parent.mkdir(parents=True, exist_ok=True)
        NOTES.write_text(
            "# ExecuteModel message size and scheduler CPU per step (issue 3)\n\n"
            f"```\n{cmd}\n```\n\n"
            "## Message size against context length\n\n"
            "`step_message.execute_request(out, step).ByteSize()` of steps planned by the scheduler "
            "core with fake sampled tokens; request ids of 32 hex characters.\n\n"
            f"{sizes}\n\n"
            "## Scheduler CPU per step\n\n"
            "`bench_step(n, steps, build_message=lambda out: step_message.execute_request(out, 0))` "
            f"from bench_scheduler.py, {args.steps} steady-decode steps per run, "
            f"{args.repeats} runs per size interleaved, medians of the per-run medians. "
            "Shared 2-core machine. Target: <= 1000 us per step at 256 sequences.\n\n"
            f"{cpu}\n\n"
            "Notes. Decode steps are flat in context length: each running sequence costs the "
            "same few dozen bytes, most of them its seq_id (34 characters here). A step on which "
            "a sequence starts a new block adds its block id (a varint: 3 bytes once ids pass "
            "16383, which depends on how much of the cache is in use, not on the context). The "
            "prompt goes over the wire once, in the sequence's first step, also when its "
            "prefill is chunked. `bench_step` times `update_from_output` only: the engine's "
            "own output processing (detokenization, stop checks, step records, "
            "`Engine._process_step`) is not in these numbers; bench_persistence.py measures it "
            "on the real engine at 64 sequences.\n"
        )


if __name__ == "__main__":
    main()
