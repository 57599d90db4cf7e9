"""Engine CPU per step for output processing, the part bench_message_size.py leaves out.

For N running sequences, one decode step's outputs go through what the engine does with them:
the scheduler core's update, detokenization and stop checks (SequenceOutputState), the Redis
append records (EngineStep) and, once acknowledged, publication to the per-request logs that
client streams read. Added to bench_message_size.py's schedule + build-message time, this is the
scheduler's whole CPU cost of a step (gRPC transport and Redis I/O excluded).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_output_processing.py
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from executor_svc.demo_model import ensure_demo_model  # noqa: E402
from protos import executor_pb2 as epb  # noqa: E402
from scheduler_svc import convert  # noqa: E402
from scheduler_svc.handles import EngineStep, RequestHandle  # noqa: E402
from scheduler_svc.request import Request  # noqa: E402
from scheduler_svc.sampling_params import SamplingParams  # noqa: E402
from scheduler_svc.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from scheduler_svc.tokenizer import load_tokenizer  # noqa: E402


def run(batch: int, steps: int, stop: list[str]) -> list[float]:
    model = ensure_demo_model(size="demo")
    files = {p.name: p.read_bytes() for p in model.iterdir() if p.suffix in (".json", ".jinja")}
    tok = load_tokenizer(files)
    vocab = len(tok)
    rng = random.Random(0)
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=max(batch, 256),
            max_num_batched_tokens=max(batch, 256) * 64,
            num_device_blocks=batch * 64,
            max_model_len=4096,
        )
    )
    params = SamplingParams(max_tokens=10**6 // 1000, ignore_eos=True, stop=stop)
    handles: dict[str, RequestHandle] = {}
    for i in range(batch):
        prompt = [rng.randrange(6, vocab) for _ in range(32)]
        h = RequestHandle(f"r{i:04d}-{'x' * 27}", prompt, params, 0, float(i))
        h.init_outputs(tok, [1, 5], 4096)
        handles[h.req_id] = h
        sched.add_request(Request(h.req_id, prompt, params, arrival_time=float(i)))
    out = sched.schedule()  # the prefill step
    sched.update_from_output(out, {s.seq_id: 7 for s, _ in out.scheduled})
    times = []
    for _ in range(steps):
        out = sched.schedule()
        resp = epb.ExecuteModelResponse(
            sampled=[
                epb.SampledToken(seq_id=s.seq_id, token_id=rng.randrange(6, vocab), logprob=-1.0)
                for s, _ in out.scheduled
            ]
        )
        t0 = time.perf_counter()
        # What Engine._process_step and the persister's acknowledgement do with one step.
        sampled = {s.seq_id: s for s in resp.sampled}
        seqs = sched.update_from_output(out, {k: v.token_id for k, v in sampled.items()})
        step = EngineStep()
        for seq in seqs:
            s = sampled[seq.seq_id]
            handles[seq.req_id].process_token(seq.index, s.token_id, s.logprob, (), step)
        record = step.to_record()
        record.on_ack()
        times.append(time.perf_counter() - t0)
        convert.execute_request(out, 0)  # keep the step realistic; not timed here
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    asyncio.set_event_loop(asyncio.new_event_loop())  # RequestHandle creates asyncio.Events
    print("| running seqs | stop strings | median µs/step | p99 µs/step | µs per sequence |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for batch in (64, 256):
        for stop in ([], ["###", "\n\n"]):
            t = sorted(run(batch, args.steps, stop))
            med = statistics.median(t) * 1e6
            p99 = t[int(len(t) * 0.99) - 1] * 1e6
            label = ", ".join(repr(s) for s in stop) or "none"
            print(f"| {batch} | {label} | {med:.0f} | {p99:.0f} | {med / batch:.1f} |")


if __name__ == "__main__":
    main()
