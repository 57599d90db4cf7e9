"""Small helpers over the raw public gRPC API (no client library), shared by e2e tests."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from protos import scheduler_pb2 as pb
from protos import scheduler_pb2_grpc as pb_grpc


def stub_for(address: str) -> tuple[grpc.Channel, pb_grpc.SchedulerStub]:
    channel = grpc.insecure_channel(address)
    return channel, pb_grpc.SchedulerStub(channel)


def gen_request(
    prompt_ids: list[int] | None = None,
    *,
    text: str | None = None,
    request_id: str = "",
    detached: bool = False,
    priority: int = 0,
    **params,
) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        request_id=request_id,
        params=pb.SamplingParams(**params),
        detached=detached,
        priority=priority,
    )
    if text is not None:
        req.text = text
    else:
        req.token_ids.ids.extend(prompt_ids or [])
    return req


@dataclass
class Collected:
    """Everything one stream delivered, per sequence index."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    text: dict[int, str] = field(default_factory=dict)
    finish: dict[int, int] = field(default_factory=dict)
    # Per sequence, each token's logprob when the request asked for logprobs.
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    offsets_ok: bool = True
    error: grpc.RpcError | None = None
    messages: int = 0

    def add(self, msg: pb.GenerateResponse) -> None:
        toks = self.tokens.setdefault(msg.index, [])
        # Every delta must start exactly where the previous one ended: no gap, no repeat.
        if msg.token_ids and msg.token_offset != len(toks):
            self.offsets_ok = False
        toks.extend(msg.token_ids)
        self.text[msg.index] = self.text.get(msg.index, "") + msg.text
        if msg.logprobs:
            self.logprobs.setdefault(msg.index, []).extend(lp.logprob for lp in msg.logprobs)
        if msg.finish_reason:
            self.finish[msg.index] = msg.finish_reason
        self.messages += 1


def collect(stream, into: Collected | None = None) -> Collected:
    out = into or Collected()
    try:
        for msg in stream:
            out.add(msg)
    except grpc.RpcError as e:
        out.error = e
    return out


def generate(stub: pb_grpc.SchedulerStub, prompt_ids: list[int], **params) -> Collected:
    return collect(stub.Generate(gen_request(prompt_ids, **params), timeout=120))


def hf_greedy(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int, **generate_kwargs
) -> list[list[int]]:
    """Reference: Hugging Face transformers greedy generate, one prompt at a time
    (generate_kwargs go to `generate`, e.g. sequence_bias)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            g = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
                **generate_kwargs,
            )
            outs.append(g[0, len(p) :].tolist())
    return outs


def run_in_threads(fns) -> list:
    results: list = [None] * len(fns)

    def run(i, fn):
        results[i] = fn()

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return results


def reference_run(address: str, reqs: list[pb.GenerateRequest]) -> list[Collected]:
    """The undisturbed run of `reqs` (under other ids), for comparison."""
    channel, stub = stub_for(address)
    refs = []
    for r in reqs:
        ref = pb.GenerateRequest()
        ref.CopyFrom(r)
        ref.request_id = "ref-" + r.request_id
        refs.append(ref)
    out = run_in_threads([lambda r=r: collect(stub.Generate(r, timeout=120)) for r in refs])
    channel.close()
    assert all(o.error is None for o in out)
    return out


def mixed_workload(
    prefix: str, num: int, max_tokens: int, *, rng_seed: int, max_prompt_len: int = 20
) -> list[pb.GenerateRequest]:
    """`num` requests `{prefix}-{i}` with distinct random prompts: even ones greedy, odd ones
    seeded sampling (both must reproduce exactly after any recovery)."""
    rng = random.Random(rng_seed)
    reqs = []
    for i in range(num):
        prompt = [rng.randrange(5, 500) for _ in range(rng.randint(4, max_prompt_len))]
        params = dict(max_tokens=max_tokens, ignore_eos=True)
        params |= {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.9, "seed": 100 + i}
        reqs.append(gen_request(prompt, request_id=f"{prefix}-{i}", **params))
    return reqs


def stream_in_threads(
    stub: pb_grpc.SchedulerStub, reqs: list[pb.GenerateRequest], *, min_tokens: int = 3
) -> tuple[list[Collected], list[threading.Thread]]:
    """Start one streaming Generate per request in its own thread; return once every stream
    has delivered `min_tokens` tokens (the threads keep collecting into the results)."""
    results = [Collected() for _ in reqs]
    threads = [
        threading.Thread(target=collect, args=(stub.Generate(r, timeout=180), results[i]))
        for i, r in enumerate(reqs)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while min(len(r.tokens.get(0, [])) for r in results) < min_tokens:
        if time.monotonic() > deadline:
            raise TimeoutError("the streams did not start")
        time.sleep(0.01)
    return results, threads


def wait_until_idle(stub: pb_grpc.SchedulerStub, timeout: float = 10.0) -> pb.GetServerInfoResponse:
    """GetServerInfo once nothing runs and every KV block is free (or the last one at the
    timeout: the caller asserts on it)."""
    deadline = time.monotonic() + timeout
    while True:
        info = stub.GetServerInfo(pb.GetServerInfoRequest())
        if (info.kv_cache_usage == 0.0 and info.num_running == 0) or time.monotonic() > deadline:
            return info
        time.sleep(0.05)
