"""Multi-LoRA as an executor feature: the adapter table (``manager.py``) installed on the model
at load, a step's adapters checked before anything changes (``check.py``), and each step's
adapter rows set on the model just before the forward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from executor_svc.features.base import Feature, InvalidStep, LoadContext, NotFound, Step
from executor_svc.features.lora import flags as cli_flags
from executor_svc.features.lora.check import check_step_loras
from executor_svc.features.lora.manager import (
    LoraConfig,
    LoraManager,
    adapter_of,
    no_lora_error,
    row_groups,
    set_adapter,
)
from executor_svc.features.lora.peft import LoraError
from protos import executor_pb2 as pb

__all__ = ["Lora"]


class Lora(Feature):
    """Hooks: load (slots on the projections' ``delta``), describe, validate (a new sequence's
    adapter into its state's ``features``; the step's adapters), prepare inputs (the adapters'
    rows to tensor-parallel workers, whose worker hooks set them), before/after forward (the
    step's rows per adapter), and the LoadLoraAdapter RPC. Without a config it only refuses
    sequences that name an adapter. ``handle``: the ``LoraManager``."""

    name = "lora"
    rpcs = ("LoadLoraAdapter",)
    flags = cli_flags

    def __init__(self, config: LoraConfig | None) -> None:
        self.config = config
        self.handle: LoraManager | None = None

    @classmethod
    def build(cls, options: dict[str, Any]) -> Lora:
        """From the runner's ``lora`` option: a LoraConfig, its fields (as tensor-parallel
        workers get it, JSON), or None."""
        config = options.get("lora")
        return cls(LoraConfig(**config) if isinstance(config, dict) else config)

    def serve(self, method: str, request: Any) -> Any:
        """LoadLoraAdapter: read and check the adapter now (the scheduler's live load)."""
        if self.handle is None:
            raise InvalidStep("this executor serves no LoRA (start it with --enable-lora)")
        try:
            adapter = self.handle.load(request.name, request.path)
        except LoraError as e:
            raise (NotFound if e.not_found else InvalidStep)(str(e)) from None
        return pb.LoadLoraAdapterResponse(rank=adapter.rank)

    def load(self, ctx: LoadContext) -> None:
        if self.config is not None:
            self.handle = LoraManager(ctx.model, self.config, ctx.device, ctx.info.dtype)

    def describe(self) -> dict[str, Any]:
        if self.config is None:
            return {}
        return {"max_loras": self.config.max_loras, "max_lora_rank": self.config.max_lora_rank}

    def check_new(self, field: str, n: Any, state: Any) -> None:
        if n.lora_name:
            set_adapter(state, n.lora_name, n.lora_path or None)

    def check_step(self, request: Any, plan: Any, limits: Any) -> bool:
        error, used = check_step_loras((s for s, _ in plan.scheduled), self.handle)
        if error is not None:
            raise InvalidStep(error)
        return used

    def active(self, seqs: Sequence[Any]) -> bool:
        # With LoRA on, every step sets the rows (none: the base model), so that a failed
        # forward's groups never outlive it; with LoRA off, only a step naming an adapter.
        return self.handle is not None or any(adapter_of(s) is not None for s in seqs)

    def to_workers(self, step: Step, fields: dict[str, Any]) -> None:
        if self.handle is not None:
            rows = row_groups(step.seqs)
            if rows:  # JSON: [[name, path, rows], ...]
                data = [[n, p, r] for (n, p), r in rows.items()]
                fields.setdefault("feature_data", {})[self.name] = data

    def worker_before_forward(self, data: Any) -> None:
        if self.handle is not None:  # rank 0 checked and named the adapters
            self.handle.begin_groups({(n, p): r for n, p, r in data or ()})

    def worker_after_forward(self) -> None:
        if self.handle is not None:
            self.handle.end_step()

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
