"""LoRA on the scheduler's hooks: a Generate call's ``lora_adapter`` (request fields), resolved
to the request's adapter, its entry ``RequestHandle.features["lora"]`` (submit), kept with the
stored request under the hash field "lora" as [name, path] (persist; restored when recovery
resumes it), the live-loaded adapters restored at start (recover), the core's side of each
request given its adapter as tag and prefix-cache root (admit), each core its step limit, at
most its executor's max_loras distinct adapters per step (scheduling), and each new sequence's
adapter to the executor (step message); GetServerInfo's adapters and max_loras (server info);
the Load/UnloadLoraAdapter RPCs (public RPC).

The scheduling core knows no adapter: ``ref.py`` (the tag and root) and ``scheduling.py`` (the
step limit) are what it sees of one, through its generic fields."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import structlog
from prometheus_client.core import Metric

from protos import executor_pb2 as epb
from protos import scheduler_pb2 as pb
from scheduler_svc.core.errors import Unavailable, ValidationError
from scheduler_svc.core.scheduler_output import SchedulerOutput
from scheduler_svc.features.base import Feature, RpcCall
from scheduler_svc.features.lora.durable import LoraAdapterStore, restore_live_adapters
from scheduler_svc.features.lora.flags import LoraSettings
from scheduler_svc.features.lora.ref import LoraRef, core_fields, stored_lora
from scheduler_svc.features.lora.registry import LoraRegistry, load_on_executors
from scheduler_svc.features.lora.scheduling import AdapterLimit, adapter_limit
from scheduler_svc.features.metric_families import counter, gauge
from scheduler_svc.state.store import RequestStore, StoreUnavailable

log = structlog.get_logger(__name__)

__all__ = ["Lora", "add_adapters"]


class Lora(Feature):
    name = "lora"
    rpcs = ("LoadLoraAdapter", "UnloadLoraAdapter")

    @classmethod
    def build(
        cls, config: Any, pool: Any, store: RequestStore, check_available: Callable[[], None]
    ) -> Lora:
        """Always on (a request may name an adapter loaded live); ``config``: the engine's, whose
        section ``features["lora"]`` (flags.py) names the adapters served from the start."""
        settings: LoraSettings = config.features.get("lora", LoraSettings())
        return cls(settings.modules, pool, store, check_available)

    def __init__(
        self,
        modules: list[tuple[str, str]],
        pool: Any,
        store: RequestStore,
        check_available: Callable[[], None],
    ) -> None:
        self.loras = LoraRegistry.of(modules)  # adapter names
        self.lora_store = LoraAdapterStore(store)  # live-loaded ones, kept in Redis
        self.pool = pool  # engine.fleet.executors.ExecutorPool: the executors' ranks
        self.check_available = check_available  # raises Unavailable (RequestFront)

    def scheduling(self, describe: epb.DescribeResponse) -> dict[str, Any]:
        return {"step_limit": adapter_limit(describe.max_loras)}  # distinct adapters per step

    def admit(self, handle: Any) -> None:
        lora = handle.features.get("lora")
        if lora is not None:  # the core's side of it: Request.of reads core_fields
            handle.core_fields = core_fields(lora)

    def step_message(self, msg: epb.ExecuteModelRequest, out: SchedulerOutput) -> None:
        add_adapters(msg, out)

    def from_request(self, msg: pb.GenerateRequest) -> str | None:
        return msg.lora_adapter or None  # "": the base model

    def handle_entry(self, inp: Any) -> LoraRef | None:
        name = inp.features.get("lora")
        if not name:
            return None
        lora = self.loras.resolve(name)  # NotFound when it is not loaded
        self._max_rank()
        return lora

    def stored_entry(self, handle: Any) -> list[str] | None:
        return stored_lora(handle.features.get("lora"))  # the hash's "lora": [name, path]

    def restore(self, stored: Any) -> LoraRef | None:
        return LoraRef(*stored) if stored else None

    async def serve(self, method: str, request: Any, call: RpcCall) -> Any:
        if method == "LoadLoraAdapter":
            name, path, rank = await self.load(request.name, request.path)
            return pb.LoadLoraAdapterResponse(
                adapter=pb.LoraAdapter(name=name, path=path, rank=rank)
            )
        await self.unload(request.name)  # NotFound if unknown
        return pb.UnloadLoraAdapterResponse()

    async def recover(self) -> None:
        # Adapters loaded live before a restart, before anything is served.
        await restore_live_adapters(self.lora_store, self.loras)

    async def load(self, name: str, path: str) -> tuple[str, str, int]:
        """Register an adapter (ValidationError / NotFound saying why not): name, path, rank.
        Every executor reads it and checks it against the model first."""
        self.check_available()
        self.loras.max_rank = self._max_rank()
        self.loras.base_model_names = tuple({ex.describe.model_name for ex in self.pool.executors})
        ref = self.loras.check(name, path).ref
        await load_on_executors(self.pool.executors, ref.name, ref.path)
        try:  # durable before it is served: a restarted scheduler serves it too
            await self.lora_store.save(ref.name, ref.path)
        except StoreUnavailable as e:
            raise Unavailable(
                "request store (Redis) is unavailable; the adapter was not loaded"
            ) from e
        info = self.loras.load(name, path)
        log.info("lora.loaded", name=name, path=info.ref.path, rank=info.rank)
        return info.ref.name, info.ref.path, info.rank

    def _max_rank(self) -> int:
        rank = max((ex.describe.max_lora_rank for ex in self.pool.executors), default=0)
        if not rank:
            raise ValidationError("the executors serve no LoRA (start them with --enable-lora)")
        return rank

    async def unload(self, name: str) -> None:
        self.loras.resolve(name)  # NotFound when it is not loaded
        try:
            await self.lora_store.delete(name)
        except StoreUnavailable as e:
            raise Unavailable("request store (Redis) is unavailable; the adapter stays") from e
        self.loras.unload(name)
        log.info("lora.unloaded", name=name)

    def metrics(self, model: str, cores: list[Any], stats: list[Any]) -> Iterator[Metric]:
        """How often the steps' adapters were not in an executor's device slots (scheduling.py)."""
        limits = [c.step_limit for c in cores if isinstance(c.step_limit, AdapterLimit)]
        yield counter(model, "llmserve:lora_loads", "LoRA adapters the steps had to load onto "
                      "an executor's device slots.", sum(x.num_loads for x in limits))  # fmt: skip
        yield gauge(model, "llmserve:lora_adapters_in_step", "Distinct LoRA adapters in the "
                    "latest step (summed over executors).",
                    sum(x.num_in_step for x in limits))  # fmt: skip

    def server_info(self, info: Any) -> None:
        info.features["lora_adapters"] = [
            {"name": a.ref.name, "path": a.ref.path, "rank": a.rank} for a in self.loras.adapters()
        ]
        info.features["max_loras"] = self.pool.executors[0].describe.max_loras  # their slots


def add_adapters(msg: epb.ExecuteModelRequest, out: SchedulerOutput) -> None:
    """A new sequence's adapter onto its NewSequence (one per ``out.new_seqs``, in order);
    running ones never carry it."""
    loras = [s.tag for s in out.new_seqs]  # the adapter (ref.core_fields) or None
    if loras.count(None) == len(loras):  # the base model's only: the message is not touched
        return
    for new, lora in zip(msg.new_sequences, loras, strict=True):
        if lora is not None:
            new.lora_name = lora.name
            new.lora_path = lora.path
