"""Speculative decoding on the scheduler's hooks: executors checked for a draft model at
connect, each core given its proposer as its lookahead (``decode.SpecDecoder``), each step's proposals into the step message,
and on the reply the executor's draws after each proposal (and a draft model's proposals) go to
the core's verification, each speculating sequence's accepted run through the stop checks token
by token."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

from protos import executor_pb2 as epb
from scheduler_svc.core.request import RequestStatus, Sequence
from scheduler_svc.core.scheduler_output import SchedulerOutput
from scheduler_svc.features.base import Feature, StepReply
from scheduler_svc.features.metric_families import counter
from scheduler_svc.features.spec.decode import (
    SpecDecoder,
    SpeculativeConfig,
    draft_executor_error,
    lookahead,
    take_draft_proposals,
)

__all__ = ["SpecDecode", "add_proposals"]


class SpecDecode(Feature):
    name = "spec_decode"

    def __init__(self, config: SpeculativeConfig, pool: Any) -> None:
        self.config = config
        self.pool = pool  # engine.fleet.executors.ExecutorPool: each core's counters

    @classmethod
    def build(cls, config: Any, pool: Any) -> SpecDecode | None:
        """On only with ``--speculative-config`` (``config``: the engine's; its section
        ``features["spec_decode"]``, flags.py)."""
        spec = config.features.get("spec_decode")
        return cls(spec, pool) if spec is not None else None

    def check_executor(self, describe: epb.DescribeResponse) -> str | None:
        d = describe
        return draft_executor_error(
            self.config, d.draft_model_name, d.draft_vocab_size, d.vocab_size
        )

    def scheduling(self, describe: epb.DescribeResponse) -> dict[str, Any]:
        return {"lookahead": lookahead(self.config)}  # a SpecDecoder per core

    def step_message(self, msg: epb.ExecuteModelRequest, out: SchedulerOutput) -> None:
        add_proposals(msg, out)

    def metrics(self, model: str, cores: list[Any], stats: list[Any]) -> Iterator[Metric]:
        """Counters under vLLM's spec_decode names, summed over the executors' cores."""
        spec_stats = [c.lookahead.stats for c in cores if isinstance(c.lookahead, SpecDecoder)]
        if not spec_stats:
            return
        for name, doc, attr in (
            ("llmserve:spec_decode_num_drafts", "Verifying steps of a sequence.", "num_drafts"),
            ("llmserve:spec_decode_num_draft_tokens", "Tokens proposed.", "num_draft_tokens"),
            ("llmserve:spec_decode_num_accepted_tokens", "Proposed tokens accepted.",
             "num_accepted_tokens"),
        ):  # fmt: skip
            yield counter(model, name, doc, sum(getattr(s, attr) for s in spec_stats))
        per_pos = CounterMetricFamily(
            "llmserve:spec_decode_num_accepted_tokens_per_pos",
            "Proposed tokens accepted, by position in the proposal.",
            labels=["model_name", "position"],
        )
        for pos in range(max(len(s.accepted_per_pos) for s in spec_stats)):
            count = sum(
                s.accepted_per_pos[pos] for s in spec_stats if pos < len(s.accepted_per_pos)
            )
            per_pos.add_metric([model, str(pos)], count)
        yield per_pos

    def server_info(self, info: Any) -> None:
        """Counters summed over the executors' cores."""
        cores = [ex.sched for ex in self.pool.executors]
        stats = [c.lookahead.stats for c in cores if isinstance(c.lookahead, SpecDecoder)]
        drafted = sum(s.num_draft_tokens for s in stats)
        accepted = sum(s.num_accepted_tokens for s in stats)
        info.features.update(
            spec_decode_acceptance_rate=accepted / drafted if drafted else 0.0,
            num_speculative_tokens=self.config.num_speculative_tokens,
            spec_decode_num_draft_tokens=drafted,
            spec_decode_num_accepted_tokens=accepted,
        )

    def on_reply(self, requests: Mapping[str, Any], reply: StepReply) -> None:
        out = reply.out
        if not out.spec_token_ids:
            return
        sampled = reply.resp.sampled
        take_draft_proposals(out, {s.seq_id: list(s.draft_token_ids) for s in sampled})
        reply.drawn = {
            s.seq_id: [x.token_id for x in s.spec_sampled] for s in sampled if s.spec_sampled
        }
        reply.takers = dict.fromkeys(out.spec_token_ids, take_verified)


def add_proposals(msg: epb.ExecuteModelRequest, out: SchedulerOutput) -> None:
    """The proposals each speculating sequence verifies this step, or how many its draft
    proposes, onto the step message's running sequences (one per ``out.cached_seqs``, in order);
    a step that speculates on nothing costs one test."""
    if not out.spec_token_ids:
        return
    for cached, c in zip(msg.cached_sequences, out.cached_seqs, strict=True):
        if c.spec_token_ids:
            cached.spec_token_ids.extend(c.spec_token_ids)
        if c.num_draft_tokens:
            cached.num_draft_tokens = c.num_draft_tokens


def take_verified(handle: Any, seq: Sequence, reply: StepReply) -> RequestStatus | None:
    """A speculating sequence's accepted run, token by token through the stop checks; tokens
    after one that ends it are dropped from the core's copy too (they never reach a client)."""
    s = reply.sampled(seq.seq_id)
    n = reply.out.spec_num_accepted[seq.seq_id] + 1
    tokens = seq.token_ids
    start = len(tokens) - n
    entries = [s, *s.spec_sampled[: n - 1]]
    with_logprobs = handle.params.logprobs is not None
    record = reply.record
    for j in range(n):
        e = entries[j]
        if with_logprobs:
            status = handle.process_token(
                seq.index, tokens[start + j], e.logprob, e.top_logprobs, record
            )
        else:
            status = handle.process_token(seq.index, tokens[start + j], 0.0, (), record)
        if status is not None:
            del tokens[start + j + 1 :]
            return status
    return None
