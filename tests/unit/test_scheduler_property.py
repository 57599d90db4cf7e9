"""Property test: random workloads against a model of what the executor knows and stores.

The model replays each step's diff the way the executor must (drops, swap-out, swap-in, copies,
new and cached sequences) and keeps, for every KV slot, a tag of the token prefix it was computed
from. Every computed position a sequence attends to must carry its own prefix's tag, so a wrong
prefix-cache hit, a missed copy-on-write, a bad swap mapping or a block reused while still read
all show up as a mismatch.

With `ahead`, the engine's async scheduling is played too: after each step is sent, the next is
planned with schedule_ahead() before the first one's result is applied, and the executor runs
every step the moment it is sent, so a planned-ahead step sees the state its predecessor left
while the scheduler's stop checks and aborts for that predecessor come only afterwards.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.scheduler_output import SchedulerOutput

MAX_STEPS = 600
VOCAB = 3  # small, so prompts share prefixes and the cache gets hits


@dataclass
class ExecSeq:
    tokens: list[int]
    table: list[int]
    num_computed: int


@dataclass
class FakeExecutor:
    num_device_blocks: int
    num_cpu_blocks: int
    block_size: int
    max_model_len: int
    seqs: dict[str, ExecSeq] = field(default_factory=dict)
    kv: dict[tuple[int, int], int] = field(default_factory=dict)  # (block, offset) -> tag
    cpu_kv: dict[tuple[int, int], int] = field(default_factory=dict)

    def reset(self) -> None:
        self.seqs.clear()
        self.kv.clear()
        self.cpu_kv.clear()

    def _move(self, src: dict, dst: dict, s: int, d: int) -> None:
        for off in range(self.block_size):
            if (s, off) in src:
                dst[(d, off)] = src[(s, off)]
            else:
                dst.pop((d, off), None)

    def execute(self, out: SchedulerOutput, sample) -> dict[str, int]:
        bs = self.block_size
        for sid in out.finished_seq_ids:
            assert sid in self.seqs, f"drop of {sid}, which the executor does not hold"
            del self.seqs[sid]
        for pairs in (out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy):
            dsts = [d for _, d in pairs]
            assert len(set(dsts)) == len(dsts), f"a block written twice in one step: {pairs}"
        for dev, cpu in out.blocks_to_swap_out:
            assert 0 <= dev < self.num_device_blocks and 0 <= cpu < self.num_cpu_blocks
            self._move(self.kv, self.cpu_kv, dev, cpu)
        for cpu, dev in out.blocks_to_swap_in:
            self._move(self.cpu_kv, self.kv, cpu, dev)
        for src, dst in out.blocks_to_copy:
            self._move(self.kv, self.kv, src, dst)
        batch: list[tuple[str, int]] = []
        for new in out.new_seqs:
            assert new.seq_id not in self.seqs, f"{new.seq_id} sent as new twice"
            assert len(set(new.block_table)) == len(new.block_table)
            self.seqs[new.seq_id] = ExecSeq(
                list(new.token_ids), list(new.block_table), new.num_computed_tokens
            )
            batch.append((new.seq_id, new.num_scheduled_tokens))
        for c in out.cached_seqs:
            assert c.seq_id in self.seqs, f"{c.seq_id} sent as a difference but never as new"
            e = self.seqs[c.seq_id]
            assert e.num_computed == c.num_computed_tokens, c.seq_id
            for idx, bid in c.replaced_blocks:
                e.table[idx] = bid
            e.table.extend(c.new_block_ids)
            batch.append((c.seq_id, c.num_scheduled_tokens))
        for sid, nc in zip(out.decode_seq_ids, out.decode_num_computed_tokens, strict=True):
            # The decode lane: exactly the last token, the block table as it is.
            assert sid in self.seqs, f"{sid} in the decode lane but never sent as new"
            e = self.seqs[sid]
            assert e.num_computed == nc == len(e.tokens) - 1, sid
            batch.append((sid, 1))
        assert len({sid for sid, _ in batch}) == len(batch), "a sequence sent twice in a step"
        assert out.total_num_scheduled_tokens == sum(n for _, n in batch)
        assert {sid: n for sid, n in batch} == out.num_scheduled_tokens
        written: set[tuple[int, int]] = set()
        sampled = {}
        for sid, num in batch:
            e = self.seqs[sid]
            assert num >= 1 and e.num_computed + num <= len(e.tokens), sid
            assert e.num_computed + num <= self.max_model_len, f"{sid}: past max_model_len"
            assert len(e.table) * bs >= e.num_computed + num, f"{sid}: table too short"
            for pos in range(e.num_computed):  # what attention reads
                slot = (e.table[pos // bs], pos % bs)
                assert self.kv.get(slot) == tag(e.tokens, pos), f"{sid}: stale KV at {pos}"
            for pos in range(e.num_computed, e.num_computed + num):
                slot = (e.table[pos // bs], pos % bs)
                assert slot not in written, f"{sid}: slot {slot} written twice in one step"
                written.add(slot)
                self.kv[slot] = tag(e.tokens, pos)
            e.num_computed += num
            if e.num_computed == len(e.tokens):
                sampled[sid] = sample(sid, len(e.tokens))
                e.tokens.append(sampled[sid])
        return sampled


def tag(tokens: list[int], pos: int) -> int:
    return hash(tuple(tokens[: pos + 1]))


request_st = st.fixed_dictionaries(
    {
        "arrival": st.integers(0, 12),
        "prompt": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=14),
        "n": st.sampled_from([1, 1, 2, 3]),
        "max_tokens": st.integers(1, 8),
        "priority": st.integers(0, 2),
        "abort_at": st.one_of(st.none(), st.integers(0, 30)),
        "abort_in_flight": st.booleans(),
        "eos_stop": st.booleans(),
    }
)

config_st = st.fixed_dictionaries(
    {
        "block_size": st.sampled_from([1, 2, 4]),
        "num_device_blocks": st.integers(4, 24),
        "num_cpu_blocks": st.integers(0, 12),
        # Of those, the host prefix tier's (clamped to num_cpu_blocks).
        "num_host_cache_blocks": st.sampled_from([0, 0, 1, 3, 8]),
        "max_num_seqs": st.integers(1, 6),
        "extra_budget": st.integers(0, 20),
        "policy": st.sampled_from(["fcfs", "priority"]),
        "preemption_mode": st.sampled_from(["recompute", "swap"]),
        "enable_prefix_caching": st.booleans(),
        "watermark": st.sampled_from([0.0, 0.1]),
        "long_prefill_token_threshold": st.one_of(st.none(), st.integers(1, 6)),
        "max_model_len": st.sampled_from([64, 64, 12]),
    }
)


def run_workload(
    cfg: dict, requests: list[dict], reset_at: int | None, ahead: bool = False
) -> None:
    cfg = dict(cfg)
    cfg["max_num_batched_tokens"] = cfg["max_num_seqs"] + cfg.pop("extra_budget")
    cfg["num_host_cache_blocks"] = min(cfg.get("num_host_cache_blocks", 0), cfg["num_cpu_blocks"])
    sched = Scheduler(SchedulerConfig(max_waiting=100, **cfg))
    ex = FakeExecutor(
        cfg["num_device_blocks"], cfg["num_cpu_blocks"], cfg["block_size"], cfg["max_model_len"]
    )
    reqs: dict[str, Request] = {}
    spec = {f"q{i}": r for i, r in enumerate(requests)}

    def sample(sid: str, length: int) -> int:
        return zlib.crc32(f"{sid}:{length}".encode()) % VOCAB  # deterministic across runs

    def maybe_finish(seq) -> None:
        s = spec[seq.req_id]
        # As the engine's output processor: max_tokens, or the model length reached.
        if seq.num_output_tokens >= s["max_tokens"] or seq.num_tokens >= cfg["max_model_len"]:
            sched.finish_sequence(seq.seq_id, RequestStatus.FINISHED_LENGTH)
        elif s["eos_stop"] and seq.token_ids[-1] == 0:
            sched.finish_sequence(seq.seq_id, RequestStatus.FINISHED_STOPPED, 0)

    in_flight: list[tuple[SchedulerOutput, dict[str, int]]] = []  # sent: (step, its samples)
    num_ahead = 0
    for step_no in range(MAX_STEPS):
        for rid, s in spec.items():
            if s["arrival"] == step_no:
                params = SamplingParams(n=s["n"], max_tokens=s["max_tokens"], seed=1)
                reqs[rid] = Request(
                    rid, s["prompt"], params, priority=s["priority"], arrival_time=step_no
                )
                sched.add_request(reqs[rid])
            if s["abort_at"] == step_no and not s["abort_in_flight"]:
                sched.abort_request(rid)
        if step_no == reset_at:
            sched.reset_executor()
            ex.reset()
            in_flight.clear()
        if not in_flight:
            out = sched.schedule()
            in_flight.append((out, ex.execute(out, sample)))
        for rid, s in spec.items():
            if s["abort_at"] == step_no and s["abort_in_flight"]:
                sched.abort_request(rid)
        if ahead and len(in_flight) == 1:
            nxt = sched.schedule_ahead()
            if nxt is not None:
                num_ahead += 1
                in_flight.append((nxt, ex.execute(nxt, sample)))
        out, sampled = in_flight.pop(0)
        got = sched.update_from_output(out, sampled)
        assert {s.seq_id for s in got} <= set(sampled)
        for seq in got:
            # The executor may be a step ahead (and has then sampled one token more).
            assert ex.seqs[seq.seq_id].tokens[: len(seq.token_ids)] == seq.token_ids
            maybe_finish(seq)
        sched.check_invariants()
        for e in ex.seqs.values():  # every held sequence agrees with the scheduler's view
            assert len(e.table) * cfg["block_size"] >= e.num_computed
        if step_no > 12 and sched.num_unfinished == 0:
            break
    else:
        raise AssertionError(f"livelock: unfinished after {MAX_STEPS} steps: {sched.get_stats()}")
    for out, sampled in in_flight:  # a step planned ahead for sequences that have ended since
        assert sched.update_from_output(out, sampled) == []
    if not ahead:
        assert num_ahead == 0

    for r in reqs.values():
        assert r.is_finished and all(s.is_finished for s in r.seqs), r.req_id
        if r.status == RequestStatus.FINISHED_ERROR:
            assert r.error
    finished = {r.req_id for r in sched.take_finished_requests()}
    assert finished == set(reqs)
    # No leak: every block free once everything ended, and the last drops reach the executor.
    sched.check_invariants()
    assert sched.num_free_blocks == cfg["num_device_blocks"]
    ex.execute(sched.schedule(), sample)
    assert ex.seqs == {}


@settings(max_examples=400, deadline=None)
@given(
    cfg=config_st,
    requests=st.lists(request_st, min_size=1, max_size=8),
    reset_at=st.one_of(st.none(), st.integers(1, 20)),
    ahead=st.booleans(),
)
def test_random_workloads_finish_without_leaks_and_keep_the_executor_consistent(
    cfg, requests, reset_at, ahead
):
    run_workload(cfg, requests, reset_at, ahead)
