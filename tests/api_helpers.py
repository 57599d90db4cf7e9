"""Small helpers over the raw public gRPC API (no client library), shared by e2e tests."""

from __future__ import annotations

import threading
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


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference: Hugging Face transformers greedy generate, one prompt at a time."""
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
