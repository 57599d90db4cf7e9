"""The real scheduler core against a real executor servicer, in one process, for speculative
decoding tests: every step goes through the step message, validation, the runner and the
sampler, and back through update_from_output, with the stop checks a request's output state
applies to token ids (max_tokens, stop token ids, EOS). Block-manager invariants are checked
after every step, and at the end every block must be free.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from executor_svc.api.service import ExecutorServicer
from executor_svc.runner.model_runner import ModelRunner
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.engine.fleet.step_message import execute_request
from scheduler_svc.features.lora.feature import add_adapters
from scheduler_svc.features.lora.ref import LoraRef, core_fields
from scheduler_svc.features.spec.decode import SpeculativeConfig, lookahead, take_draft_proposals
from scheduler_svc.features.spec.feature import add_proposals


@dataclass
class Run:
    outputs: dict[str, list[list[int]]]  # req_id -> per sequence output tokens
    logprobs: dict[str, list[float]] = field(default_factory=dict)  # req_id -> seq 0's
    steps: int = 0
    accepted: int = 0  # proposals accepted
    proposed: int = 0
    preemptions: int = 0
    # Steps in which every scheduled sequence decodes (plus proposals): their wall time and the
    # tokens they produced (what ms/token of a benchmark counts).
    decode_s: float = 0.0
    decode_cpu_s: float = 0.0  # the same steps' process CPU time (less sensitive to co-tenants)
    decode_tokens: int = 0


def run_requests(
    runner: ModelRunner,
    requests: list[tuple[list[int], SamplingParams]],
    spec: SpeculativeConfig | None,
    *,
    num_device_blocks: int = 256,
    max_num_batched_tokens: int = 256,
    max_num_seqs: int = 16,
    eos_token_ids: tuple[int, ...] = (),
    enable_prefix_caching: bool = True,
    preemption_mode: str = "recompute",
    num_cpu_blocks: int = 0,
    check: bool = True,
    loras: list[LoraRef | None] | None = None,
) -> Run:
    servicer = ExecutorServicer(runner)
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            block_size=runner.block_size,
            num_device_blocks=num_device_blocks,
            num_cpu_blocks=num_cpu_blocks,
            max_model_len=runner.info.max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            preemption_mode=preemption_mode,
            lookahead=lookahead(spec),
        )
    )
    reqs = {}
    for i, (prompt, params) in enumerate(requests):
        lora = loras[i] if loras is not None else None
        req = Request(f"r{i}", list(prompt), params, arrival_time=float(i), **core_fields(lora))
        reqs[req.req_id] = req
        sched.add_request(req)
    run = Run({})
    logprobs: dict[str, list[float]] = {r: [] for r in reqs}
    while sched.num_unfinished:
        t0, c0 = time.perf_counter(), time.process_time()
        out = sched.schedule()
        num_spec = {c.seq_id: len(c.spec_token_ids) or c.num_draft_tokens for c in out.cached_seqs}
        decoding = (
            all(n - num_spec.get(seq.seq_id, 0) == 1 for seq, n in out.scheduled)
            and not out.new_seqs
        )
        assert not out.is_empty, "a step with unfinished requests scheduled nothing"
        msg = execute_request(out, out.step_id)
        add_proposals(msg, out)  # the features' step_message hooks (features/spec, /lora)
        add_adapters(msg, out)
        resp = servicer._execute(msg)
        run.steps += 1
        tokens = dict(zip(out.decode_seq_ids, resp.decode_token_ids, strict=True))
        tokens.update({s.seq_id: s.token_id for s in resp.sampled})
        by_id = {s.seq_id: s for s in resp.sampled}
        drawn = {s.seq_id: [x.token_id for x in s.spec_sampled] for s in resp.sampled}
        take_draft_proposals(out, {s.seq_id: list(s.draft_token_ids) for s in resp.sampled})
        produced = 0
        for seq in sched.update_from_output(out, tokens, drawn):
            produced += out.spec_num_accepted.get(seq.seq_id, 0) + 1
            req = reqs[seq.req_id]
            p = req.sampling_params
            n = out.spec_num_accepted.get(seq.seq_id, 0) + 1
            run.proposed += len(out.spec_token_ids.get(seq.seq_id, ()))
            run.accepted += n - 1
            start = len(seq.token_ids) - n
            s = by_id.get(seq.seq_id)
            lps = [s.logprob, *(x.logprob for x in s.spec_sampled)] if s is not None else []
            for j in range(n):
                t = seq.token_ids[start + j]
                if seq.index == 0 and lps:
                    logprobs[req.req_id].append(lps[j])
                status = None
                if t in p.stop_token_ids or (not p.ignore_eos and t in eos_token_ids):
                    status = RequestStatus.FINISHED_STOPPED
                elif len(seq.token_ids) - seq.num_prompt_tokens - (n - 1 - j) >= p.max_tokens:
                    status = RequestStatus.FINISHED_LENGTH
                if status is not None:
                    del seq.token_ids[start + j + 1 :]
                    sched.finish_sequence(seq.seq_id, status)
                    break
        if decoding:
            run.decode_s += time.perf_counter() - t0
            run.decode_cpu_s += time.process_time() - c0
            run.decode_tokens += produced
        if check:
            sched.check_invariants()
    run.preemptions = sched.num_preemptions
    for req in reqs.values():
        run.outputs[req.req_id] = [list(s.output_token_ids) for s in req.seqs]
    run.logprobs = logprobs
    return run


def oracle(reference: Any, prompts: list[list[int]], rate: float, seed: int):
    """A proposer of the reference run's continuation of the prompt being decoded, each token
    corrupted at ``rate``: forces long accepted runs, rejections and prefixes whatever the model
    does (prompts are distinct, so the prefix names the request)."""
    rng = random.Random(seed)
    refs = [p + reference.outputs[f"r{i}"][0] for i, p in enumerate(prompts)]

    def propose(tokens: list[int], k: int) -> list[int]:
        for ref in refs:
            if ref[: len(tokens)] == tokens:
                out = ref[len(tokens) : len(tokens) + k]
                return [t if rng.random() >= rate else (t + 1) % 500 for t in out]
        return [rng.randrange(500) for _ in range(k)]

    return propose


def with_proposer(fn: Callable[[], Any], proposer: Callable[[list[int], int], list[int]]) -> Any:
    """``fn()`` with every SpecDecoder built meanwhile using ``proposer``."""
    import scheduler_svc.features.spec.decode as sd

    orig = sd.SpecDecoder.__init__

    def init(self, config):
        orig(self, config)
        self.proposer = proposer

    sd.SpecDecoder.__init__ = init
    try:
        return fn()
    finally:
        sd.SpecDecoder.__init__ = orig
