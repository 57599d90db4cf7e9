"""A multi-turn chat workload over the gRPC API: several conversations, each turn's prompt the
conversation so far (a shared system prompt, earlier user turns and the model's answers) plus new
user text. Its prefix-cache working set grows with every turn, so a device cache smaller than
it evicts what the next turn of a conversation will hit again (the host tier's case)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from protos import scheduler_pb2_grpc as pb_grpc
from tests.support.api_helpers import collect, gen_request, run_in_threads

__all__ = ["ChatResult", "ChatWorkload", "run_chat"]


@dataclass(slots=True)
class ChatWorkload:
    num_conversations: int = 6
    num_turns: int = 3
    system_tokens: int = 48  # shared by every conversation
    first_user_tokens: int = 64  # each conversation's own opening
    user_tokens: int = 24  # each later turn's new text
    max_tokens: int = 8  # the answer
    vocab: tuple[int, int] = (5, 500)  # token ids drawn from [lo, hi)
    seed: int = 0
    concurrent: bool = True  # a round's turns (one per conversation) at once

    def working_set_tokens(self) -> int:
        """Prompt + answer tokens of every conversation's last turn (system prompt once)."""
        conv = self.first_user_tokens + (self.num_turns - 1) * self.user_tokens
        conv += self.num_turns * self.max_tokens
        return self.system_tokens + self.num_conversations * conv


@dataclass(slots=True)
class ChatResult:
    outputs: list[list[int]] = field(default_factory=list)  # per (turn, conversation), in order
    ttft_s: list[float] = field(default_factory=list)  # same order
    later_ttft_s: list[float] = field(default_factory=list)  # turns after the first
    errors: list[str] = field(default_factory=list)


def _turn(stub, prompt: list[int], max_tokens: int, seed: int | None, rid: str):
    params = dict(max_tokens=max_tokens, ignore_eos=True)
    params |= dict(temperature=0.0) if seed is None else dict(temperature=0.9, seed=seed)
    start = time.perf_counter()
    first: list[float] = []
    stream = stub.Generate(gen_request(prompt, request_id=rid, **params), timeout=600)

    def timed():
        for msg in stream:
            if not first and msg.token_ids:
                first.append(time.perf_counter() - start)
            yield msg

    res = collect(timed())
    return res, (first[0] if first else float("nan"))


def run_chat(stub: pb_grpc.SchedulerStub, w: ChatWorkload, tag: str = "") -> ChatResult:
    """Run every turn of every conversation (greedy for even conversations, seeded sampling
    for odd ones); a turn starts once its conversation's previous answer is back."""
    rng = random.Random(w.seed)
    lo, hi = w.vocab
    draw = lambda n: [rng.randrange(lo, hi) for _ in range(n)]  # noqa: E731
    system = draw(w.system_tokens)
    history = [system + draw(w.first_user_tokens) for _ in range(w.num_conversations)]
    later = [draw(w.user_tokens) for _ in range(w.num_conversations * w.num_turns)]
    out = ChatResult()
    for turn in range(w.num_turns):
        prompts = [
            h + (later[turn * w.num_conversations + c] if turn else [])
            for c, h in enumerate(history)
        ]
        fns = [
            lambda c=c, p=p, turn=turn: _turn(
                stub, p, w.max_tokens, None if c % 2 == 0 else 1000 + c, f"{tag}t{turn}c{c}"
            )
            for c, p in enumerate(prompts)
        ]
        results = run_in_threads(fns) if w.concurrent else [f() for f in fns]
        for c, (res, ttft) in enumerate(results):
            if res.error is not None:
                out.errors.append(f"turn {turn} conversation {c}: {res.error}")
            tokens = res.tokens.get(0, [])
            out.outputs.append(tokens)
            out.ttft_s.append(ttft)
            if turn:
                out.later_ttft_s.append(ttft)
            history[c] = prompts[c] + tokens
    return out
