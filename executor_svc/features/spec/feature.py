"""Speculative decoding on the executor: proposals the scheduler sends (``spec_token_ids``) or
the executor's draft model makes (``num_draft_tokens``, ``draft.py``), verified in one step as
extra query positions (``verify.py``); only accepted tokens are kept."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from executor_svc.features.base import (
    Feature,
    InvalidStep,
    LoadContext,
    Step,
    check_len,
    check_tokens,
    sampled_pb,
    step_entry,
)
from executor_svc.features.spec import flags as cli_flags
from executor_svc.features.spec import verify
from executor_svc.features.spec.draft import DraftModel, draft_computed_after, load_draft
from executor_svc.features.spec.view import spec_entry, spec_of

__all__ = ["SpecDecode", "record_verified"]


@dataclass(slots=True)
class _StepSpec:
    """One step's speculation, by seq_id (``plan.extras["spec"]``)."""

    spec: dict[str, list[int]]  # proposals verified this step
    draft: dict[str, int]  # proposals the draft makes this step (they join `spec` once made)
    views: dict[str, Any] = field(default_factory=dict)  # drafting sequences' runner views


class SpecDecode(Feature):
    """Hooks: load (the draft, its KV bytes per block, its cache), validate, prepare inputs
    (proposals onto the views; the draft proposes in ``before_inputs``; ``sample_rows``), cache
    ops (the draft's copies), sample (a view per row, results grouped), record (accepted
    tokens). ``handle``: the ``DraftModel`` (None without ``--speculative-model``)."""

    name = "spec"
    flags = cli_flags

    def __init__(self, draft_model: str | Path | None = None) -> None:
        self._draft_dir = draft_model
        self.handle: DraftModel | None = None
        self._prepare: Any = None

    @classmethod
    def build(cls, options: dict[str, Any]) -> SpecDecode:
        """Always on (verification); the draft with the runner's ``speculative_model``. Runs
        after structured outputs in the registry: ``check_step`` refuses a constrained
        sequence that verifies proposals, its mask having been checked first."""
        return cls(options.get("speculative_model"))

    # ------------------------------------------------------------------ load

    def load(self, ctx: LoadContext) -> None:
        self.handle = load_draft(self._draft_dir, ctx)
        self._prepare = ctx.prepare_inputs

    def block_bytes(self, block_size: int) -> int:
        # Both caches hold every block: the draft's bytes count when sizing them (not swap).
        return self.handle.block_bytes(block_size) if self.handle is not None else 0

    def allocate(self, num_device_blocks: int, block_size: int) -> None:
        if self.handle is not None:
            self.handle.allocate(num_device_blocks, block_size)

    def describe(self) -> dict[str, Any]:
        if self.handle is None:
            return {}
        i = self.handle.info
        return {
            "draft_model_name": i.model_name,
            "draft_num_layers": i.num_layers,
            "draft_vocab_size": i.vocab_size,
        }

    # ------------------------------------------------------------------ validate

    def check_cached(self, field: str, c: Any, state: Any, num_tokens: int, limits: Any) -> int:
        if not (c.spec_token_ids or c.num_draft_tokens):
            return num_tokens
        return _check_spec(field, c, state.num_computed_tokens, num_tokens, limits)

    def check_step(self, request: Any, plan: Any, limits: Any) -> bool:
        cached = request.cached_sequences
        spec = {c.seq_id: list(c.spec_token_ids) for c in cached if c.spec_token_ids}
        draft = {c.seq_id: c.num_draft_tokens for c in cached if c.num_draft_tokens}
        if not spec and not draft:
            return False
        masks = plan.extras.get("structured", {})  # structured outputs check first (registry)
        if spec and not spec.keys().isdisjoint(masks):
            raise InvalidStep("token_masks: a constrained sequence cannot verify spec_token_ids")
        if draft and self.handle is None:
            raise InvalidStep(
                "num_draft_tokens: this executor has no draft model (--speculative-model)"
            )
        if draft and not draft.keys().isdisjoint(masks):
            raise InvalidStep("token_masks: a constrained sequence cannot verify draft proposals")
        plan.extras[self.name] = _StepSpec(spec, draft)
        return True

    # ------------------------------------------------------------------ prepare inputs

    def prepare(self, plan: Any, seqs: list[Any]) -> None:
        data: _StepSpec = plan.extras[self.name]
        for seq in seqs:
            k = data.draft.get(seq.seq_id)
            if k:  # the draft proposes in the runner (before_inputs)
                entry = spec_entry(seq)
                entry.num_draft_tokens = k
                entry.draft_num_computed = draft_computed(plan.states[seq.seq_id])
                data.views[seq.seq_id] = seq
            spec = data.spec.get(seq.seq_id)
            if spec:  # proposals ride after the known tokens
                seq.token_ids = seq.token_ids + spec
                spec_entry(seq).spec_token_ids = spec

    def active(self, seqs: Sequence[Any]) -> bool:
        return any(step_entry(s, self.name) is not None for s in seqs)

    def before_inputs(self, step: Step) -> None:
        if self.handle is not None and any(spec_of(s).num_draft_tokens for s in step.seqs):
            self.handle.propose(step.seqs, self._prepare)  # fills their spec_token_ids

    def sample_rows(
        self, seqs: Sequence[Any], sample_seq_indices: list[int], query_start_loc: Any
    ) -> tuple[list[int], Any]:
        return verify.sample_rows(seqs, sample_seq_indices, query_start_loc)

    def copy_blocks(self, src_to_dst: list[tuple[int, int]]) -> None:
        if self.handle is not None:  # copy-on-write moves the draft's KV too
            self.handle.copy(src_to_dst)

    # ------------------------------------------------------------------ sample and record

    def before_sample(
        self, step: Step, sample_seq_indices: list[int], rows: list[Any], logits: Any
    ) -> list[Any]:
        # Every position of a proposal run samples, each as the plain path would see it.
        return verify.row_views(step.seqs, sample_seq_indices)

    def after_sample(self, step: Step, sample_seq_indices: list[int], results: list[Any]) -> list:
        return verify.group_results(results, sample_seq_indices)

    def record(self, plan: Any, state: Any, result: Any, sampled: Any) -> bool:
        if result.spec is None:
            return False
        data: _StepSpec = plan.extras[self.name]
        k = data.draft.get(state.seq_id, 0)
        if k:  # verified like the scheduler's proposals from here on
            data.spec[state.seq_id] = list(spec_of(data.views[state.seq_id]).spec_token_ids)
        num_known = len(state.token_ids)
        accepted = record_verified(state, data.spec[state.seq_id], result, plan.block_size)
        if k:
            if state.features is None:
                state.features = {}
            state.features[self.name] = draft_computed_after(num_known, k, accepted)
        sampled.spec_sampled.extend(sampled_pb(x) for x in result.spec)
        if k:
            sampled.draft_token_ids.extend(data.spec[state.seq_id])
        return True


def draft_computed(state: Any) -> int:
    """A SeqState's leading positions whose draft KV is valid (its entry in ``features``, kept
    by ``record``); 0 for a state built from a NewSequence (its draft KV may be stale: the draft
    catches up)."""
    return state.features.get(SpecDecode.name, 0) if state.features else 0


def record_verified(s: Any, proposed: list[int], r: Any, block_size: int) -> int:
    """A verifying sequence keeps the draws up to the first rejected proposal; the KV of the
    rejected positions is left behind (overwritten later) and the blocks past what its known
    tokens need go back to the scheduler, which drops the same ones. Returns the number of
    proposals accepted."""
    assert r.spec is not None
    drawn = [r.token_id, *(x.token_id for x in r.spec)]
    accepted = verify.accept(proposed, drawn)
    s.num_computed_tokens -= len(proposed) - accepted
    s.token_ids.extend(drawn[: accepted + 1])
    keep = verify.blocks_to_keep(len(s.block_table), len(s.token_ids), block_size)
    if keep < len(s.block_table):
        s.block_table[:] = s.block_table.tolist()[:keep]
    return accepted


def _check_spec(field: str, c: Any, num_computed: int, num_tokens: int, limits: Any) -> int:
    """A verifying sequence decodes its last known token plus every proposal; returns the
    tokens the step then covers."""
    k = len(c.spec_token_ids) or c.num_draft_tokens
    if c.spec_token_ids and c.num_draft_tokens:
        raise InvalidStep(f"{field}: spec_token_ids and num_draft_tokens exclude each other")
    if num_computed + 1 != num_tokens or c.num_scheduled_tokens != 1 + k:
        raise InvalidStep(
            f"{field}.spec_token_ids: a verifying sequence computes its last known token and "
            f"the {k} proposals ({1 + k} tokens); got {c.num_scheduled_tokens} scheduled with "
            f"{num_computed} of {num_tokens} computed"
        )
    check_tokens(f"{field}.spec_token_ids", c.spec_token_ids, limits.vocab_size)
    check_len(f"{field}.spec_token_ids", num_tokens + k, limits.max_model_len)
    return num_tokens + k
