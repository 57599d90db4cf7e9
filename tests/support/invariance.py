"""Step-invariance harness: the same positions computed under different groupings into steps.

A workload is a few sequences with fixed (teacher-forced) token lists. A *plan* computes them
through a real ``ModelRunner`` (its ``prepare_inputs``, KV cache, attention backend, model and
sampler) in some grouping: one token a step, whole prefills, chunked prefills, random batches
of co-runners with swap-out/swap-in, recompute and prefix-cache hits. Every step records, for
each (sequence, position) it computed, the logits row (lm_head over all the step's rows, and
again over the sampling rows alone, as the runner does) and the token the sampler draws from it
when the whole step's rows are sampled together. ``mismatches`` compares a plan's records with
the reference plan's bit for bit.

Teacher forcing keeps the token lists fixed whatever is sampled, so two plans compute exactly
the same positions from exactly the same inputs: any difference is numerics.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from executor_svc.runner.model_runner import ModelRunner, ScheduledSequence
from executor_svc.runner.sampler import Sampler, SamplingParams

Key = tuple[str, int]  # (seq_id, position)


@dataclass
class Seq:
    seq_id: str
    tokens: list[int]  # the whole teacher-forced list
    num_prompt: int  # tokens before the first "output" (the seeded position counts from here)
    params: SamplingParams
    table: list[int] = field(default_factory=list)
    computed: int = 0
    cpu_table: list[int] = field(default_factory=list)  # while swapped out


@dataclass
class Record:
    logits: torch.Tensor  # [vocab] fp32, lm_head over every row of the step
    token: int  # sampled with every row of the step in one sampler call
    logprob: float
    sample_logits: torch.Tensor | None = None  # lm_head over the sampling rows only


class Plan:
    """Block bookkeeping for one grouping over a runner's cache; ``step`` runs one step."""

    def __init__(self, runner: ModelRunner, seqs: Iterable[Seq]) -> None:
        self.runner = runner
        self.bs = runner.block_size
        self.free = list(range(runner.num_device_blocks))
        self.cpu_free = list(range(runner.num_cpu_blocks))
        self.ref_cnt: dict[int, int] = {}
        self.seqs = {s.seq_id: s for s in seqs}
        self.records: dict[Key, Record] = {}
        self.sampler = Sampler()

    # -- blocks

    def _take(self, free: list[int]) -> int:
        # Random block ids: a plan's physical layout never matches another's.
        return free.pop(random.randrange(len(free)))

    def _grow(self, s: Seq, num_tokens: int) -> None:
        while len(s.table) * self.bs < num_tokens:
            b = self._take(self.free)
            self.ref_cnt[b] = 1
            s.table.append(b)

    def release(self, s: Seq) -> None:
        """Drop the sequence's blocks (recompute: it starts again from position 0)."""
        for b in s.table:
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                del self.ref_cnt[b]
                self.free.append(b)
        s.table, s.computed = [], 0

    def share_prefix(self, s: Seq, donor: Seq, num_blocks: int) -> None:
        """A prefix-cache hit: s starts on donor's first num_blocks blocks (same tokens)."""
        assert (
            not s.table and s.tokens[: num_blocks * self.bs] == donor.tokens[: num_blocks * self.bs]
        )
        assert donor.computed >= num_blocks * self.bs
        s.table = donor.table[:num_blocks]
        for b in s.table:
            self.ref_cnt[b] += 1
        # At least one token is always computed (the engine's rule for a full-prompt hit).
        s.computed = min(num_blocks * self.bs, len(s.tokens) - 1)

    def swap_out(self, s: Seq) -> None:
        assert all(self.ref_cnt[b] == 1 for b in s.table), "shared blocks are not swapped here"
        pairs = [(b, self._take(self.cpu_free)) for b in s.table]
        self.runner.kv_cache.swap_out(pairs)
        for b, _ in pairs:
            del self.ref_cnt[b]
            self.free.append(b)
        s.cpu_table, s.table = [c for _, c in pairs], []

    def swap_in(self, s: Seq) -> None:
        pairs = [(c, self._take(self.free)) for c in s.cpu_table]
        self.runner.kv_cache.swap_in(pairs)
        for c, b in pairs:
            self.ref_cnt[b] = 1
            self.cpu_free.append(c)
        s.table, s.cpu_table = [b for _, b in pairs], []

    # -- one step

    @torch.inference_mode()
    def step(self, work: list[tuple[Seq, int]]) -> None:
        """Compute the next n tokens of each (sequence, n) in one forward."""
        runner = self.runner
        sched = []
        for s, n in work:
            assert not s.cpu_table and 0 < n <= len(s.tokens) - s.computed
            self._grow(s, s.computed + n)
            end = s.computed + n
            sched.append(
                ScheduledSequence(
                    seq_id=s.seq_id,
                    token_ids=s.tokens[:end],
                    num_prompt_tokens=min(s.num_prompt, end),
                    block_table=list(s.table),
                    num_computed_tokens=s.computed,
                    num_scheduled_tokens=n,
                    sampling_params=s.params,
                )
            )
        batch = runner.prepare_inputs(sched)
        hidden = runner.model(
            batch.input_ids, batch.positions, runner.kv_cache.layers, batch.attn_metadata
        )
        logits = runner.model.compute_logits(hidden).float()  # every row
        sample_idx, sample_logits = runner._sample_logits(batch, hidden)  # the runner's rows
        keys: list[Key] = []
        params, prompts, outputs = [], [], []
        for s, n in work:
            for pos in range(s.computed, s.computed + n):
                keys.append((s.seq_id, pos))
                params.append(s.params)
                prompts.append(s.tokens[: s.num_prompt])
                # The row at pos draws token pos + 1: its output index decides the seeded noise.
                outputs.append(s.tokens[s.num_prompt : pos + 1])
        out = self.sampler(logits, params, prompts, outputs)
        tokens, logprobs = out.token_ids.tolist(), out.logprobs.tolist()
        for row, key in enumerate(keys):
            self.records[key] = Record(logits[row].clone(), tokens[row], logprobs[row])
        for j, i in enumerate(sample_idx):
            s, _ = work[i]
            self.records[(s.seq_id, s.computed + work[i][1] - 1)].sample_logits = sample_logits[
                j
            ].clone()
        for s, n in work:
            s.computed += n

    def done(self) -> bool:
        return all(s.computed == len(s.tokens) for s in self.seqs.values())


def fresh(seqs: Iterable[Seq]) -> list[Seq]:
    return [Seq(s.seq_id, s.tokens, s.num_prompt, s.params) for s in seqs]


def run_plan(
    runner: ModelRunner, seqs: Iterable[Seq], schedule: Callable[[Plan], None]
) -> dict[Key, Record]:
    plan = Plan(runner, fresh(seqs))
    schedule(plan)
    assert plan.done(), "the schedule left positions uncomputed"
    for s in plan.seqs.values():
        plan.release(s)
    return plan.records


def mismatches(ref: dict[Key, Record], got: dict[Key, Record]) -> list[str]:
    """Every (sequence, position) of ``got`` whose logits, token or logprob differ from ref."""
    bad = []
    for key, rec in got.items():
        want = ref[key]
        if not torch.equal(rec.logits, want.logits):
            diff = (rec.logits - want.logits).abs().max().item()
            bad.append(f"{key}: logits differ (max {diff:.3g})")
        elif rec.sample_logits is not None and not torch.equal(rec.sample_logits, want.logits):
            bad.append(f"{key}: sampling-row logits differ")
        elif (rec.token, rec.logprob) != (want.token, want.logprob):
            bad.append(f"{key}: sampled {rec.token} ({rec.logprob}) != {want.token}")
    return bad


# -- schedules -------------------------------------------------------------------------------


def one_token_steps(plan: Plan) -> None:
    """(a) each sequence alone, one position a step."""
    for s in plan.seqs.values():
        while s.computed < len(s.tokens):
            plan.step([(s, 1)])


def whole_prefills(plan: Plan) -> None:
    """(b) each sequence alone, all its positions in one step."""
    for s in plan.seqs.values():
        plan.step([(s, len(s.tokens))])


def split_at(boundaries: list[int]) -> Callable[[Plan], None]:
    """(c) each sequence alone, chunked at the given positions."""

    def schedule(plan: Plan) -> None:
        for s in plan.seqs.values():
            cuts = sorted({b for b in boundaries if 0 < b < len(s.tokens)} | {len(s.tokens)})
            for end in cuts:
                plan.step([(s, end - s.computed)])

    return schedule


def random_batches(
    rng: random.Random,
    *,
    max_batch: int = 64,
    p_swap: float = 0.0,
    p_recompute: float = 0.0,
    shared: dict[str, tuple[str, int]] | None = None,
) -> Callable[[Plan], None]:
    """(d)-(f), (h): random co-runners and batch sizes, each sequence a random chunk (1 = a
    decode) a step; sequences swapped out and back in, or dropped and recomputed from 0; the
    sequences named in ``shared`` start on a donor's computed blocks (seq -> (donor, blocks))."""
    shared = shared or {}

    def schedule(plan: Plan) -> None:
        swapped: list[Seq] = []
        started: set[str] = set()
        while not plan.done() or swapped:
            for s in list(swapped):
                if rng.random() < 0.5:
                    plan.swap_in(s)
                    swapped.remove(s)
            ready = [
                s
                for s in plan.seqs.values()
                if s.computed < len(s.tokens) and not s.cpu_table
                and (s.seq_id not in shared or _donor_ready(plan, s, shared, started))
            ]  # fmt: skip
            if not ready:
                continue
            rng.shuffle(ready)
            work = []
            for s in ready[: rng.randint(1, max_batch)]:
                if s.seq_id in shared and s.seq_id not in started:
                    donor, blocks = shared[s.seq_id]
                    plan.share_prefix(s, plan.seqs[donor], blocks)
                started.add(s.seq_id)
                left = len(s.tokens) - s.computed
                n = 1 if rng.random() < 0.5 else rng.randint(1, left)
                work.append((s, min(n, left)))
            plan.step(work)
            for s, _ in work:
                if s.computed == len(s.tokens) or _is_donor(s, shared):
                    continue  # a donor's blocks stay put: others read them
                if rng.random() < p_recompute:
                    plan.release(s)
                elif rng.random() < p_swap and s.seq_id not in shared:
                    plan.swap_out(s)
                    swapped.append(s)

    return schedule


def _is_donor(s: Seq, shared: dict[str, tuple[str, int]]) -> bool:
    return any(donor == s.seq_id for donor, _ in shared.values())


def _donor_ready(plan: Plan, s: Seq, shared: dict[str, tuple[str, int]], started: set) -> bool:
    if s.seq_id in started:
        return True
    donor, blocks = shared[s.seq_id]
    return plan.seqs[donor].computed >= blocks * plan.bs
