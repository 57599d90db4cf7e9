"""The scheduler's whole CPU cost of one decode step, measured on the engine's own code.

For N running sequences (the demo model's tokenizer, random sampled tokens, so the text has
multi-byte characters and spaces like real output), every timed step runs what StepLoop's step and
the persister run, minus the network and the executor:

* schedule: `Scheduler.schedule()`;
* build: `step_message.execute_request(...)` and its serialization (what gRPC sends);
* process: parse the executor's reply (serialized here, not timed), `process_step_outputs`
  (scheduler core update, stop checks, incremental detokenization, step records), the step's
  Redis command as the store packs it (also shown on its own: persistence's share, run by the
  persister while the executor computes), and the publication to the acknowledged per-request
  logs that client streams read (`on_ack`);
* total = schedule + build + process: the issue's "schedule + build message + process outputs".

A second figure, `streams`, is what the event loop then spends waking one listener per request
and building its GenerateResponse (`convert.event_to_proto`), the per-client share of a
streaming step. It is reported beside the total, not in it: it scales with attached clients, not
with the batch, and it runs while the executor computes the next step.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_engine_step.py [--steps 300]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from executor_svc.demo.demo_model import ensure_demo_model  # noqa: E402
from protos import executor_pb2 as epb  # noqa: E402
from scheduler_svc.api import convert  # noqa: E402
from scheduler_svc.core.request import Request  # noqa: E402
from scheduler_svc.core.sampling_params import SamplingParams  # noqa: E402
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from scheduler_svc.engine.fleet import step_message  # noqa: E402
from scheduler_svc.engine.step_results import process_step_outputs  # noqa: E402
from scheduler_svc.engine.streams import EngineStep, RequestHandle  # noqa: E402
from scheduler_svc.features.base import Features  # noqa: E402
from scheduler_svc.features.prompt_logprobs.feature import PromptLogprobs  # noqa: E402
from scheduler_svc.output.tokenizer import load_tokenizer  # noqa: E402
from scheduler_svc.state.keys import pack_appends  # noqa: E402

# The hooks process_step_outputs calls in a default engine (features/registry.py): prompt
# logprobs' on_reply, every step; the other features only hook the admission of requests that
# use them (these do not) or run outside this function. Their cost is in `process`.
FEATURES = Features([PromptLogprobs()])

PROMPT_LEN = 32
NOTES = ROOT / "docs" / "bench-notes" / "engine_step.md"
SHA = "0" * 40  # the script's digest only changes the bytes, not the work


def reply_bytes(out, rng: random.Random, vocab: int) -> bytes:
    """What the executor would answer: the decode lane packed, every other sampling sequence
    as a SampledToken."""
    lane = set(out.decode_seq_ids)
    resp = epb.ExecuteModelResponse(
        step_id=out.step_id,
        decode_token_ids=[rng.randrange(6, vocab) for _ in out.decode_seq_ids],
        decode_logprobs=[-1.0] * len(out.decode_seq_ids),
    )
    for seq, num in out.scheduled:
        if seq.seq_id not in lane and seq.num_computed_tokens + num == len(seq.token_ids):
            resp.sampled.add(seq_id=seq.seq_id, token_id=rng.randrange(6, vocab), logprob=-1.0)
    return resp.SerializeToString()


async def listen(handle: RequestHandle, counts: list[int]) -> None:
    async for event in handle.events(0):
        convert.event_to_proto(handle, event).SerializeToString()  # what gRPC sends
        counts[0] += 1


async def run(batch: int, steps: int, stop: list[str], streams: bool) -> dict[str, list[float]]:
    model = ensure_demo_model(size="demo")
    files = {p.name: p.read_bytes() for p in model.iterdir() if p.suffix in (".json", ".jinja")}
    tok = load_tokenizer(files)
    vocab = len(tok)
    rng = random.Random(0)
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=batch,
            max_num_batched_tokens=batch * PROMPT_LEN,
            num_device_blocks=batch * (PROMPT_LEN + steps + 64) // 16 * 2,
            max_model_len=4096,
        )
    )
    params = SamplingParams(max_tokens=steps + 16, ignore_eos=True, stop=stop)
    requests: dict[str, RequestHandle] = {}
    for i in range(batch):
        prompt = [rng.randrange(6, vocab) for _ in range(PROMPT_LEN)]
        h = RequestHandle(f"{i:032x}", prompt, params, 0, float(i))
        h.init_outputs(tok, [1], 4096)
        for admit in FEATURES.admit:  # as RequestTable.add
            admit(h)
        requests[h.req_id] = h
        sched.add_request(Request(h.req_id, prompt, params, arrival_time=float(i)))
    counts = [0]
    tasks = [asyncio.create_task(listen(h, counts)) for h in requests.values()] if streams else []
    times: dict[str, list[float]] = {
        k: [] for k in ("schedule", "build", "process", "redis_pack", "publish", "streams")
    }
    opens: list[bool] = []  # steps on which the lockstep batch opens new blocks
    clock = time.perf_counter
    gc.collect()
    gc.freeze()  # as Engine.start does once start-up is over
    for step in range(steps + 1):
        t0 = clock()
        out = sched.schedule()
        t1 = clock()
        step_message.execute_request(out, out.step_id).SerializeToString()
        t2 = clock()
        payload = reply_bytes(out, rng, vocab)
        t3 = clock()
        resp = epb.ExecuteModelResponse.FromString(payload)
        record = EngineStep()
        process_step_outputs(sched, requests, out, resp, record, FEATURES)
        for req in sched.take_finished_requests():  # as RequestTable.finish_ended_in_core
            handle = requests[req.req_id]
            handle.finished_in_engine = True
            record.finishes.append(handle.finish_record())
        tp = clock()
        pack_appends(SHA, record.appends)
        tp = clock() - tp
        tq = clock()
        record.acknowledged()
        t4 = clock()
        for _ in range(3):  # listeners wake, build their responses and wait again
            await asyncio.sleep(0)
        t5 = clock()
        if step == 0:
            continue  # the prefill step
        times["schedule"].append(t1 - t0)
        times["build"].append(t2 - t1)
        times["process"].append(t4 - t3)
        times["redis_pack"].append(tp)
        times["publish"].append(t4 - tq)
        opens.append(bool(out.cached_seqs))
        times["streams"].append(t5 - t4)
    assert counts[0] >= batch * steps or not streams, "listeners fell behind"
    for h in requests.values():
        h.close("done")
    await asyncio.gather(*tasks, return_exceptions=True)
    gc.unfreeze()
    # A block is filled (and hashed for the prefix cache) on the step before it is opened.
    times["block_step"] = [
        float(o or nxt) for o, nxt in zip(opens, [*opens[1:], False], strict=True)
    ]
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--repeats", type=int, default=3, help="runs per row; medians over all")
    ap.add_argument("--write-notes", action="store_true", help=f"write {NOTES}")
    args = ap.parse_args()
    lines = [
        "| running seqs | stop strings | stream listeners | schedule µs | build µs | process µs |"
        " of which Redis packing µs | of which publication µs | **total µs** | total p90 µs |"
        " streams µs |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for line in lines:
        print(line)
    tails: list[str] = []
    for batch in (int(b) for b in args.batches.split(",")):
        for stop in ([], ["###", "\n\n"]):
            for streams in (False, True):
                t: dict[str, list[float]] = {}
                for _ in range(args.repeats):
                    for k, v in asyncio.run(run(batch, args.steps, stop, streams)).items():
                        t.setdefault(k, []).extend(v)
                totals = [
                    a + b + c
                    for a, b, c in zip(t["schedule"], t["build"], t["process"], strict=True)
                ]
                total = sorted(totals)
                slowest = sorted(range(len(totals)), key=totals.__getitem__)[-len(totals) // 10 :]
                tails.append(
                    f"{batch} seqs, stop {stop or 'none'}, listeners {streams}: "
                    f"{sum(t['block_step'][i] > 0 for i in slowest)} of the {len(slowest)} "
                    f"slowest steps fill or open blocks ({statistics.mean(t['block_step']):.0%} "
                    "of all steps do)"
                )
                med = {k: statistics.median(v) * 1e6 for k, v in t.items()}
                label = ", ".join(repr(s) for s in stop) or "none"
                listeners = "one per request" if streams else "none"
                streams_us = f"{med['streams']:.0f}" if streams else "-"
                lines.append(
                    f"| {batch} | {label} | {listeners} | {med['schedule']:.0f} |"
                    f" {med['build']:.0f} | {med['process']:.0f} | {med['redis_pack']:.0f} |"
                    f" {med['publish']:.0f} |"
                    f" **{statistics.median(total) * 1e6:.0f}** |"
                    f" {total[int(len(total) * 0.9)] * 1e6:.0f} | {streams_us} |"
                )
                print(lines[-1])
    lines += ["", "Where the slowest 10 % of steps fall (all sequences decode in lockstep):", ""]
    lines += [f"- {t}" for t in tails]
    for line in lines[-len(tails) - 3 :]:
        print(line)
    if args.write_notes:
        cmd = "HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_engine_step.py " + " ".join(
            sys.argv[1:]
        )
        body = "\n".join(lines)
        NOTES.write_text(
            "# Scheduler CPU per engine step (issue 3)\n\n"
            f"{__doc__.split(chr(10) + chr(10), 1)[1].rsplit(chr(10) + chr(10), 1)[0]}\n\n"
            f"{args.steps} decode steps per run, {args.repeats} runs per row, medians over all "
            "steps; the demo model's tokenizer (byte-level BPE, 4096 tokens), prompts of "
            f"{PROMPT_LEN} tokens. Shared 2-core machine.\n\n```\n{cmd}\n```\n\n{body}\n"
        )


if __name__ == "__main__":
    main()
