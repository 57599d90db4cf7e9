"""Speculative decoding's draft model: a smaller checkpoint with the target's vocabulary that
proposes the tokens a step then verifies (executor_svc/features/spec/verify.py).

The draft has its own paged KV cache with the target's number of device blocks and block size,
addressed by the same block tables and slot mapping: the scheduler allocates nothing more for
it, and the slots it writes past the accepted tokens are rewritten later, as the target's are.
A sequence's ``draft_num_computed`` (the feature's entry in the SeqState's ``features``) counts
the leading positions whose draft KV is valid; it is 0 whenever the executor builds a
sequence's state from a NewSequence (new, recomputed, swapped in, after a scheduler restart),
which is exactly when that KV may be stale, so the draft then catches up over the whole context.

One step, for the drafting sequences of a batch (``DraftModel.propose``):

1. catch-up and first proposal: the draft computes positions [draft_num_computed, p] (p: the
   last known token's position) in one varlen forward; the argmax of the last row is d1;
2. k - 1 batched one-position forwards: d2 .. dk (greedy; a sequence asked for fewer stops
   early);
3. the target verifies [t_p, d1 .. dk] as 1 + k query positions, exactly as for proposals sent
   by the scheduler: every draw is the token the plain path samples, so the output does not
   depend on the draft, which only changes how many proposals are accepted.

After verification the draft KV of t_p, d1 .. d_{k-1} is valid as far as those equal the final
tokens: draft_num_computed = p + min(accepted, k - 1) + 1 (``draft_computed_after``).

Writing a block the prefix cache shares is benign: a position's draft KV depends only on the
tokens up to it (step-invariant kernels), so another sequence writes the same bits there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from executor_svc.features.base import LoadContext, without_entry
from executor_svc.features.spec.view import NAME, spec_of

# model_runner's ScheduledSequence, BatchInputs and ModelInfo (features import no runner code:
# what the draft needs of the runner comes in the LoadContext).
ScheduledSequence = Any
ModelInfo = Any
PrepareInputs = Callable[[list[Any]], Any]

__all__ = ["DraftModel", "draft_computed_after", "draft_mismatch_error", "load_draft"]


def load_draft(model_dir: str | Path | None, ctx: LoadContext) -> DraftModel | None:
    """The draft for ``--speculative-model`` (None without one); ValueError when it cannot
    serve the target."""
    if model_dir is None:
        return None
    if ctx.tp is not None:
        raise ValueError("a draft model (--speculative-model) does not run with TP > 1")
    return DraftModel(model_dir, ctx)


def draft_mismatch_error(target: ModelInfo, draft: ModelInfo) -> str | None:
    """Why the draft cannot propose for the target (None: it can)."""
    if draft.vocab_size != target.vocab_size:
        return (
            f"the draft model's vocabulary ({draft.vocab_size}) differs from the target's "
            f"({target.vocab_size}); a draft needs the same tokenizer"
        )
    if draft.max_model_len < target.max_model_len:
        return (
            f"the draft model's max_model_len ({draft.max_model_len}) is below the target's "
            f"({target.max_model_len}); pass a smaller --max-model-len"
        )
    return None


def draft_computed_after(num_known: int, num_draft: int, accepted: int) -> int:
    """Leading positions with valid draft KV after a verifying step of a sequence that had
    ``num_known`` tokens before it and drafted ``num_draft`` proposals, ``accepted`` of them
    kept: the draft wrote t_p, d1 .. d_{k-1} at positions p .. p + k - 1."""
    return num_known + min(accepted, num_draft - 1)


class DraftModel:
    """The draft model, its KV cache, and the k-step proposal loop."""

    def __init__(self, model_dir: str | Path, ctx: LoadContext) -> None:
        target = ctx.info
        self.model, self.info = ctx.load_model(
            model_dir,
            ctx.backend,
            device=target.device,
            dtype=target.dtype,
            max_model_len=target.max_model_len,
        )
        error = draft_mismatch_error(target, self.info)
        if error is not None:
            raise ValueError(f"--speculative-model {model_dir}: {error}")
        self._new_kv_cache = ctx.new_kv_cache
        self._block_bytes = ctx.block_bytes
        self.kv_cache: Any = None  # runner.kv_cache.KVCache once allocated

    def block_bytes(self, block_size: int) -> int:
        """The draft's KV bytes per block (added to the target's when sizing the cache)."""
        i = self.info
        return self._block_bytes(i.num_layers, block_size, i.num_kv_heads, i.head_dim, i.dtype)

    def allocate(self, num_device_blocks: int, block_size: int) -> None:
        """Its cache: as many device blocks as the target's, no swap space (a swapped-in
        sequence comes back as a NewSequence and catches up)."""
        i = self.info
        self.kv_cache = self._new_kv_cache(
            num_layers=i.num_layers,
            num_kv_heads=i.num_kv_heads,
            head_dim=i.head_dim,
            block_size=block_size,
            num_device_blocks=num_device_blocks,
            num_cpu_blocks=0,
            dtype=i.dtype,
            device=i.device,
        )

    def copy(self, src_to_dst: list[tuple[int, int]]) -> None:
        """Copy-on-write moves a sequence's last block: its draft KV goes with it."""
        if src_to_dst and self.kv_cache is not None:
            self.kv_cache.copy(src_to_dst)

    def propose(self, seqs: Sequence[ScheduledSequence], prepare: PrepareInputs) -> None:
        """Draft proposals for every sequence with ``num_draft_tokens``; each gets its
        proposals appended to ``token_ids`` (a new list) and set as ``spec_token_ids``.
        ``prepare`` flattens sequences into a batch (ModelRunner.prepare_inputs)."""
        assert self.kv_cache is not None
        drafting = [s for s in seqs if spec_of(s).num_draft_tokens]
        known = [list(s.token_ids) for s in drafting]
        proposals: list[list[int]] = [[] for _ in drafting]
        # 1: catch-up over [draft_num_computed, p] and the first proposal.
        batch = [
            _draft_view(s, t, spec_of(s).draft_num_computed)
            for s, t in zip(drafting, known, strict=True)
        ]
        active = list(range(len(drafting)))
        for _ in range(max(spec_of(s).num_draft_tokens for s in drafting)):
            for j, token in zip(active, self._argmax(batch, prepare), strict=True):
                proposals[j].append(token)
            # 2: one position more for those that want more proposals.
            active = [
                j for j in active if len(proposals[j]) < spec_of(drafting[j]).num_draft_tokens
            ]
            if not active:
                break
            batch = []
            for j in active:
                t = known[j] + proposals[j]
                batch.append(_draft_view(drafting[j], t, len(t) - 1))
        for s, t, d in zip(drafting, known, proposals, strict=True):
            s.token_ids = t + d
            spec_of(s).spec_token_ids = d  # a drafting view has its entry

    def _argmax(self, batch: list[ScheduledSequence], prepare: PrepareInputs) -> list[int]:
        """The draft's greedy token after each sequence of the batch (its last row)."""
        assert self.kv_cache is not None
        inputs = prepare(batch)
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.kv_cache.layers, inputs.attn_metadata
        )
        logits = self.model.compute_logits(hidden.index_select(0, inputs.sample_rows))
        return logits.float().argmax(dim=-1).tolist()


def _draft_view(s: ScheduledSequence, token_ids: list[int], num_computed: int) -> Any:
    """The sequence as the draft computes it: ``token_ids`` from ``num_computed`` on, forward
    only. What other features add to a view is left as it is: the draft's batch is flattened
    and run with no feature's hooks (``prepare`` is ModelRunner.prepare_inputs without any)."""
    return dataclasses.replace(
        s,
        token_ids=token_ids,
        num_computed_tokens=num_computed,
        num_scheduled_tokens=len(token_ids) - num_computed,
        sampling_params=None,
        step_data=without_entry(s, NAME),
    )
