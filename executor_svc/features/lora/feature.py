"""Multi-LoRA as an executor feature: the adapter table (``manager.py``) installed on the model
at load, a step's adapters checked before anything changes (``check.py``), and each step's
adapter rows set on the model just before the forward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from executor_svc.features.base import Feature, InvalidStep, LoadContext, Step
from executor_svc.features.lora.check import check_step_loras
from executor_svc.features.lora.manager import LoraConfig, LoraManager, no_lora_error, row_groups

__all__ = ["Lora"]


class Lora(Feature):
    """Hooks: load (slots on the projections), describe, validate (a new sequence's adapter into
    its state; the step's adapters), prepare inputs (adapters onto the views, and to tensor-
    parallel workers), before/after forward (the step's rows per adapter). Without a config it
    only refuses sequences that name an adapter. ``handle``: the ``LoraManager``."""

    name = "lora"

    def __init__(self, config: LoraConfig | None) -> None:
        self.config = config
        self.handle: LoraManager | None = None

    def load(self, ctx: LoadContext) -> None:
        if self.config is not None:
            self.handle = LoraManager(ctx.model, self.config, ctx.device, ctx.info.dtype)

    def describe(self) -> dict[str, Any]:
        if self.config is None:
            return {}
        return {"max_loras": self.config.max_loras, "max_lora_rank": self.config.max_lora_rank}

    def check_new(self, field: str, n: Any, state: Any) -> None:
        state.lora_name = n.lora_name or None
        state.lora_path = n.lora_path or None

    def check_step(self, request: Any, plan: Any, limits: Any) -> bool:
        error, used = check_step_loras((s for s, _ in plan.scheduled), self.handle)
        if error is not None:
            raise InvalidStep(error)
        return used

    def prepare(self, plan: Any, seqs: list[Any]) -> None:
        for seq, (state, _) in zip(seqs, plan.scheduled, strict=True):
            seq.lora_name, seq.lora_path = state.lora_name, state.lora_path

    def active(self, seqs: Sequence[Any]) -> bool:
        # With LoRA on, every step sets the rows (none: the base model), so that a failed
        # forward's groups never outlive it; with LoRA off, only a step naming an adapter.
        return self.handle is not None or any(s.lora_name for s in seqs)

    def to_workers(self, step: Step, fields: dict[str, Any]) -> None:
        if self.handle is not None:
            fields["lora_rows"] = row_groups(step.seqs)

    def before_forward(self, step: Step) -> None:
        if self.handle is None:
            no_lora_error(step.seqs)
            return
        self.handle.begin_step(step.seqs)
        # The adapter groups change from step to step: never from a CUDA graph.
        step.eager = step.eager or bool(self.handle.step.groups)

    def after_forward(self, step: Step, hidden: Any) -> None:
        if self.handle is not None:
            self.handle.end_step()
