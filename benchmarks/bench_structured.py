"""Structured outputs: what a constraint costs.

    .venv/bin/python benchmarks/bench_structured.py [--num-requests 64] [--model demo|tiny]

1. In process: 64 constrained sequences walked along valid JSON (the masks choose each token):
   the scheduler's mask time per sequence-step (matcher advance + llguidance mask + packing) and
   the bytes a step's TokenMask rows add to an ExecuteModelRequest whose other payload is the
   64-sequence decode lane.
2. End to end (Redis, executor, scheduler as processes; the demo model on the CPU): output tokens
   per second of 64 concurrent json_schema requests over the same 64 unconstrained (ignore_eos,
   same number of output tokens each), with async scheduling on (constrained sequences are not
   planned ahead) and off.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client import LLMClient, SamplingParams  # noqa: E402
from client import structured as so  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "scores": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 999},
            "minItems": 16,
            "maxItems": 16,
        },
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "scores", "kind", "ok"],
    "additionalProperties": False,
}


def in_process(model_dir: Path, num: int) -> None:
    from transformers import AutoTokenizer

    from protos import executor_pb2 as epb
    from scheduler_svc.core.request import Request
    from scheduler_svc.core.sampling_params import SamplingParams as CoreParams
    from scheduler_svc.core.scheduler_output import SchedulerOutput
    from scheduler_svc.engine.fleet.step_message import execute_request
    from scheduler_svc.features.structured.bitmask import allowed_ids, decode_rows
    from scheduler_svc.features.structured.compiler import GrammarCompiler
    from scheduler_svc.features.structured.matchers import SeqMatchers

    tok = AutoTokenizer.from_pretrained(model_dir)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    compiler = GrammarCompiler(tok, vocab, [tok.eos_token_id])
    spec = {"json_schema": json.dumps(SCHEMA)}
    t0 = time.perf_counter()
    compiler.validate(spec)
    print(f"grammar compile (first matcher): {(time.perf_counter() - t0) * 1e3:.2f} ms")
    matchers = SeqMatchers(compiler)
    rng = random.Random(0)
    reqs = [
        Request(f"bench-{i:04d}", [1, 2, 3, 4], CoreParams(structured_output=spec))
        for i in range(num)
    ]
    seqs = [r.seqs[0] for r in reqs]
    step_s, mask_bytes, other_bytes, steps = [], [], [], 0
    live = list(seqs)
    while live and steps < 400:
        out = SchedulerOutput(steps)
        for s in live:
            s.num_computed_tokens = len(s.token_ids) - 1
            out.scheduled.append((s, 1))
            out.decode_seq_ids.append(s.seq_id)
            out.decode_num_computed_tokens.append(s.num_computed_tokens)
        msg = execute_request(out, steps)
        t0 = time.perf_counter()
        rows = matchers.step_masks(out, lambda _id: spec)
        step_s.append((time.perf_counter() - t0) / len(live))
        masked = epb.ExecuteModelRequest()
        lane = {seq_id: i for i, seq_id in enumerate(out.decode_seq_ids)}
        masked.token_masks.seq_positions.extend(lane[seq_id] for seq_id in rows.seq_ids)
        masked.token_masks.row_index.extend(rows.row_index)
        masked.token_masks.rows = rows.rows
        table = decode_rows(rows.rows, vocab)
        if len(live) == num:
            mask_bytes.append(masked.ByteSize())
            other_bytes.append(msg.ByteSize())
        still = []
        for s, i in zip(live, rows.row_index, strict=True):
            token = rng.choice(allowed_ids(table[i], vocab))
            s.token_ids.append(token)
            if token != tok.eos_token_id:
                still.append(s)
        live = still
        steps += 1
    step_s.sort()
    print(
        f"mask per sequence-step: median {step_s[len(step_s) // 2] * 1e6:.1f} us, "
        f"p90 {step_s[int(len(step_s) * 0.9)] * 1e6:.1f} us over {steps} steps"
    )
    print(
        f"bytes per step at {num} sequences: masks {sum(mask_bytes) / len(mask_bytes):.0f} "
        f"(max {max(mask_bytes)}), rest of the step message {sum(other_bytes) / len(other_bytes):.0f}"
    )
    print(f"raw bitmask would be {num * 4 * ((vocab + 31) // 32)} bytes")  # fmt: skip


def end_to_end(model_dir: Path, num: int, async_scheduling: bool) -> None:
    from scheduler_svc.local.redis_server import RedisServer
    from tests.support.stack import Stack

    tmp = Path(tempfile.mkdtemp(prefix="bench-structured-"))
    redis = RedisServer(data_dir=tmp / "redis")
    redis.start()
    args = [] if async_scheduling else ["--no-async-scheduling"]
    stack = Stack(tmp, model_dir, redis, executor_args=[], scheduler_args=args)
    try:
        stack.start_executor()
        stack.start_scheduler()
        with LLMClient(stack.address, timeout=600) as c:
            c.wait_ready(60)
            prompts = [f"record {i}: " for i in range(num)]
            bound = [
                SamplingParams(
                    temperature=0.8,
                    seed=i,
                    max_tokens=400,
                    structured_output=so.json_schema(SCHEMA),
                )
                for i in range(num)
            ]
            c.generate(prompts[:4], bound[:4], use_tqdm=False)  # warm-up (and grammar cache)
            t0 = time.perf_counter()
            outs = c.generate(prompts, bound, use_tqdm=False)
            t_bound = time.perf_counter() - t0
            lengths = [len(o.outputs[0].token_ids) for o in outs]
            assert all(json.loads(o.outputs[0].text) for o in outs)
            free = [
                SamplingParams(temperature=0.8, seed=i, max_tokens=n, ignore_eos=True)
                for i, n in enumerate(lengths)
            ]
            t0 = time.perf_counter()
            c.generate(prompts, free, use_tqdm=False)
            t_free = time.perf_counter() - t0
        total = sum(lengths)
        print(
            f"async_scheduling={async_scheduling}: {num} requests, {total} output tokens; "
            f"json_schema {total / t_bound:.0f} tok/s, unconstrained {total / t_free:.0f} tok/s, "
            f"ratio {t_free / t_bound:.3f}"
        )
    finally:
        stack.stop()
        redis.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--model", choices=["demo", "tiny"], default="demo")
    ap.add_argument("--skip-e2e", action="store_true")
    args = ap.parse_args()
    from executor_svc.demo.demo_model import ensure_demo_model

    model_dir = Path(ensure_demo_model(Path("/tmp/llmserve-bench"), size=args.model, seed=0))
    in_process(model_dir, args.num_requests)
    if not args.skip_e2e:
        for async_scheduling in (True, False):
            end_to_end(model_dir, args.num_requests, async_scheduling)


if __name__ == "__main__":
    main()
