"""The scheduler's hook points for optional features, and the set of them one engine runs.

A feature is a folder under ``scheduler_svc/features/`` with one ``Feature`` subclass that
overrides the hooks it uses; ``features/registry.py`` builds the list once at start-up from the
engine's configuration. The request path (``engine/requests.py``, ``engine/step_loop.py``,
``engine/step_results.py``, ``engine/request_table.py``) only iterates hooks and names no
feature. The hooks, and who calls them:

| point | hook | called by |
| --- | --- | --- |
| connect | ``check_executor`` | the fleet's handshake with each executor |
| scheduling budget | ``scheduling`` | the fleet's ``new_scheduler`` (the core's configuration) |
| request fields | ``from_request`` | the servicer's Generate (``EngineClient.request_features``) |
| validate/submit | ``validate`` (async), ``handle_fields``, ``handle_entry`` | ``RequestFront.submit`` |
| admit (submit and recovery) | ``admit`` | ``RequestTable.add`` |
| between steps | ``between_steps``, ``holds_ahead`` | ``StepLoop`` (the executor's lock held) |
| step message | ``step_message`` | the fleet's ``ExecutorHandle.send`` |
| apply reply | ``on_reply`` (before the tokens), ``after_reply`` | ``process_step_outputs``, ``StepLoop`` |
| persist/recover | ``stored_fields``, ``stored_entry``, ``restore``, ``recover`` (async) | ``RequestFront``/``Recovery``, ``Engine`` start |
| metrics, server info | ``metrics``, ``server_info`` | ``EngineMetrics.collect``, ``RequestFront.server_info`` |
| public RPC | ``serve`` (async; the feature's ``rpcs``) | the servicer's method of that name (api/servicer.py) |

A feature's per-request state is its entry in ``RequestHandle.features`` (by the feature's
name): ``from_request`` reads its fields of the Generate call into ``GenerateInput.features``,
``handle_entry`` turns that into the handle's entry (resolving, checking), ``stored_entry`` is
the JSON value stored with the request under the feature's name (a field of its Redis hash,
``StoredRequest.features``) and ``restore`` the entry again from it when recovery resumes the
request. Its configuration is its section of ``EngineConfig.features`` (declared and filled by
its folder's ``flags.py``), and what it adds to GetServerInfo goes into ``ServerInfo.features``
under the proto's field names.

The scheduling core imports nothing outside itself; what a feature changes in a step reaches
it through the core's generic extension points, which the feature implements in its folder and
hands each core through ``scheduling`` (core/config.py's fields: a per-step admission limit,
core/step_budget.py ``StepLimit``; decodes with lookahead positions, core/lookahead.py), and
through ``admit``, which may set the fields of the request's core side
(``RequestHandle.core_fields``: ``Request.tag``, ``Request.cache_root``).

Cost: ``Features`` lists, per hook, only the features that override it, once; a hook nobody
uses is an empty tuple. Per sequence, the reply loop calls one ``Taker`` per sampled sequence:
chosen once per request when it is admitted (``RequestHandle.take``), or for this step only by
a feature (``StepReply.takers``: a run of several tokens verified in one step).

This module imports nothing of the engine (the core and protos only): features and the engine's
request state both depend on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from protos import executor_pb2 as epb
from protos import scheduler_pb2 as pb
from scheduler_svc.core.request import Request, RequestStatus, Sequence
from scheduler_svc.core.scheduler_output import SchedulerOutput

__all__ = [
    "NO_FEATURES",
    "Feature",
    "Features",
    "RpcCall",
    "StepReply",
    "Taker",
    "take_logprobs",
    "take_token",
]

# The engine's records, named loosely: this leaf imports none of them.
RequestHandle = Any  # engine.streams.RequestHandle: the one owner of a request's engine state
EngineStep = Any  # engine.streams.EngineStep: what one step produced (writes, deltas)
GenerateInput = Any  # engine.config.GenerateInput
ExecutorHandle = Any  # engine.fleet.executor_handle.ExecutorHandle
ServerInfo = Any  # engine.config.ServerInfo


@dataclass(frozen=True, slots=True)
class RpcCall:
    """Who makes a public RPC a feature serves (``Feature.serve``)."""

    owner: str  # the API key's name when keys are on ("" otherwise): ids are scoped to it
    metadata: Any  # the call's invocation metadata (tracing reads the caller's traceparent)


class StepReply:
    """One ExecuteModel reply as the reply loop and the features see it."""

    __slots__ = ("_by_id", "drawn", "out", "record", "resp", "takers", "tokens")

    def __init__(
        self, out: SchedulerOutput, resp: epb.ExecuteModelResponse, record: EngineStep
    ) -> None:
        self.out = out
        self.resp = resp
        self.record = record
        # seq_id -> its sampled token. The decode lane's come back as one packed list in the
        # lane's order; the others as SampledToken messages.
        self.tokens = dict(zip(out.decode_seq_ids, resp.decode_token_ids, strict=True))
        self.tokens.update({s.seq_id: s.token_id for s in resp.sampled})
        # seq_id -> the draws after each proposal, for update_from_output (set by a feature).
        self.drawn: dict[str, list[int]] | None = None
        # seq_id -> the Taker that applies it this step instead of its request's own.
        self.takers: dict[str, Taker] = {}
        self._by_id: dict[str, epb.SampledToken] | None = None

    def sampled(self, seq_id: str) -> epb.SampledToken:
        """The full SampledToken (only needed for logprobs; indexed on first use)."""
        if self._by_id is None:
            self._by_id = {s.seq_id: s for s in self.resp.sampled}
        return self._by_id[seq_id]


# Applies one sequence's result of a step to its request: returns the finish status when the
# sequence ended.
Taker = Callable[[RequestHandle, Sequence, StepReply], "RequestStatus | None"]


def take_token(handle: RequestHandle, seq: Sequence, reply: StepReply) -> RequestStatus | None:
    """A sampled token without logprobs (the common case)."""
    return handle.process_token(seq.index, reply.tokens[seq.seq_id], 0.0, (), reply.record)


def take_logprobs(handle: RequestHandle, seq: Sequence, reply: StepReply) -> RequestStatus | None:
    s = reply.sampled(seq.seq_id)
    return handle.process_token(seq.index, s.token_id, s.logprob, s.top_logprobs, reply.record)


class Feature:
    """An optional capability of the scheduler. Every hook here does nothing; a feature
    overrides the ones it uses."""

    name: ClassVar[str] = ""
    # Public RPCs of llmserve.v1.Scheduler only this feature serves (``serve``): the servicer
    # has a method for each (api/servicer.py), with the others' key check and error statuses.
    rpcs: ClassVar[tuple[str, ...]] = ()

    # ------------------------------------------------------------------ connect, budget

    def check_executor(self, describe: epb.DescribeResponse) -> str | None:
        """Why an executor, as its Describe reports it, cannot serve the feature (None: it
        can); the scheduler refuses it before resetting it."""
        return None

    def scheduling(self, describe: epb.DescribeResponse) -> dict[str, Any]:
        """The fields of each executor's scheduling core's configuration (core/config.py
        ``SchedulerConfig``) the feature sets (``describe``: that executor's Describe)."""
        return {}

    # ------------------------------------------------------------------ request fields

    def from_request(self, msg: pb.GenerateRequest) -> Any:
        """The feature's entry of a Generate call's ``GenerateInput.features``, read from its
        fields of the message (None: the call does not use the feature)."""
        return None

    # ------------------------------------------------------------------ validate/submit

    async def validate(self, inp: GenerateInput) -> None:
        """A new request's input, before it is stored; raise ValidationError/NotFound."""

    def handle_fields(self, inp: GenerateInput) -> dict[str, Any]:
        """Keyword arguments the feature adds to the request's RequestHandle."""
        return {}

    def handle_entry(self, inp: GenerateInput) -> Any:
        """The feature's entry of the request's ``RequestHandle.features`` (None: none), from
        its input (``inp.features``); raise ValidationError/NotFound."""
        return None

    def admit(self, handle: RequestHandle) -> None:
        """A request entering the table (new, or resumed by recovery): the feature may choose
        its ``take`` (how each step's result for it is applied) and set ``core_fields`` (what
        ``Request.of`` gives its core side; replace the dict, never change it in place)."""

    # ------------------------------------------------------------------ between steps

    def between_steps(self, ex: ExecutorHandle) -> None:
        """Before each step of ``ex``, its lock held (no step of it in flight): the feature may
        end requests of ``ex`` (a deadline passed), writing through the persister."""

    def holds_ahead(self, ex: ExecutorHandle) -> bool:
        """True when ``ex`` must not plan its next step before this one is back (the feature
        has something to do in ``between_steps`` first)."""
        return False

    # ------------------------------------------------------------------ step message

    def step_message(self, msg: epb.ExecuteModelRequest, out: SchedulerOutput) -> None:
        """Add the feature's fields to a step's ExecuteModelRequest."""

    # ------------------------------------------------------------------ apply reply

    def on_reply(self, requests: Mapping[str, RequestHandle], reply: StepReply) -> None:
        """Before the step's tokens are applied (may set ``reply.drawn`` / ``reply.takers``)."""

    def after_reply(self, ex: ExecutorHandle, resp: epb.ExecuteModelResponse) -> None:
        """After the tokens were applied: what else the reply carries."""

    # ------------------------------------------------------------------ persist/recover

    def stored_fields(self, handle: RequestHandle) -> dict[str, Any]:
        """StoredRequest fields the feature keeps for the request."""
        return {}

    def stored_entry(self, handle: RequestHandle) -> Any:
        """The JSON value the feature stores with the request under its name (a field of the
        request's hash: ``StoredRequest.features``); None: nothing."""
        return None

    def restore(self, stored: Any) -> Any:
        """The request's entry (``RequestHandle.features``) again from what ``stored_entry``
        stored, when recovery resumes it."""
        return stored

    async def recover(self) -> None:
        """At start, before stored requests resume (the feature's own durable state)."""

    def resumed(self, handle: RequestHandle, req: Request, record: EngineStep) -> None:
        """A stored request that recovery resumes, before it is queued (``req``: its core
        side, from the acknowledged outputs): the feature may end sequences whose stored output
        already completes them, writing their finish to ``record``."""

    # ------------------------------------------------------------------ metrics, server info

    def metrics(self, model: str, cores: list[Any], stats: list[Any]) -> Iterable[Any]:
        """Prometheus metric families of the feature (``cores``: each executor's scheduling
        core; ``stats``: their ``get_stats()``), labelled with ``model``."""
        return ()

    def server_info(self, info: ServerInfo) -> None:
        """Fill the feature's fields of GetServerInfo's answer (``info.features``: by the proto's
        field names, plain values; a message as a dict of its fields)."""

    # ------------------------------------------------------------------ public RPC

    async def serve(self, method: str, request: Any, call: RpcCall) -> Any:
        """One of the feature's ``rpcs``: its response message; raise the engine's errors
        (the servicer maps them to statuses)."""
        raise NotImplementedError(method)


def _overrides(feature: Feature, hook: str) -> bool:
    return getattr(type(feature), hook) is not getattr(Feature, hook)


class Features:
    """The engine's features in registry order, and per hook the ones that override it, listed
    once at start-up (a hook no feature uses costs an empty loop)."""

    def __init__(self, features: Iterable[Feature] = ()) -> None:
        self.all: tuple[Feature, ...] = tuple(features)
        self.by_name = {f.name: f for f in self.all}

        def named(hook: str) -> tuple[tuple[str, Any], ...]:
            return tuple((f.name, getattr(f, hook)) for f in self.all if _overrides(f, hook))

        def having(hook: str) -> tuple[Any, ...]:
            return tuple(getattr(f, hook) for f in self.all if _overrides(f, hook))

        self.check_executor: tuple[Callable[[epb.DescribeResponse], str | None], ...] = having(
            "check_executor"
        )
        self._scheduling = having("scheduling")
        self._validate = having("validate")
        self._handle_fields = having("handle_fields")
        self._from_request = named("from_request")
        self._handle_entry = named("handle_entry")
        self._stored_entry = named("stored_entry")
        self._restore = {f.name: f.restore for f in self.all}
        self.admit: tuple[Callable[[RequestHandle], None], ...] = having("admit")
        self.between_steps: tuple[Callable[[ExecutorHandle], None], ...] = having("between_steps")
        self.holds_ahead: tuple[Callable[[ExecutorHandle], bool], ...] = having("holds_ahead")
        self.on_reply: tuple[Callable[[Mapping[str, Any], StepReply], None], ...] = having(
            "on_reply"
        )
        self.after_reply: tuple[Callable[[ExecutorHandle, Any], None], ...] = having("after_reply")
        self._stored_fields = having("stored_fields")
        self._recover = having("recover")
        self.resumed: tuple[Callable[[RequestHandle, Request, EngineStep], None], ...] = having(
            "resumed"
        )
        self.server_info: tuple[Callable[[ServerInfo], None], ...] = having("server_info")
        self.metrics: tuple[Callable[[str, list, list], Iterable[Any]], ...] = having("metrics")
        # What adds the features' fields to a step message (None: no feature does), passed to
        # the fleet's ExecutorHandle.send.
        self.step_message = _chain(having("step_message"))

    def get(self, name: str) -> Any:
        """The named feature (None when it is not built)."""
        return self.by_name.get(name)

    def scheduling(self, describe: epb.DescribeResponse) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        for hook in self._scheduling:
            fields.update(hook(describe))
        return fields

    async def validate(self, inp: GenerateInput) -> None:
        for hook in self._validate:
            await hook(inp)

    def from_request(self, msg: pb.GenerateRequest) -> dict[str, Any]:
        """A Generate call's ``GenerateInput.features``."""
        return _entries(self._from_request, msg)

    def handle_fields(self, inp: GenerateInput) -> dict[str, Any]:
        """The RequestHandle's keyword arguments the features add (``features``: their
        entries, when any)."""
        fields: dict[str, Any] = {}
        for hook in self._handle_fields:
            fields.update(hook(inp))
        entries = _entries(self._handle_entry, inp)
        if entries:
            fields["features"] = entries
        return fields

    def stored_fields(self, handle: RequestHandle) -> dict[str, Any]:
        """The StoredRequest's fields the features keep (``features``: their JSON entries)."""
        fields: dict[str, Any] = {}
        for hook in self._stored_fields:
            fields.update(hook(handle))
        entries = _entries(self._stored_entry, handle)
        if entries:
            fields["features"] = entries
        return fields

    def restore(self, handle: RequestHandle, stored: Mapping[str, Any]) -> None:
        """A stored request's handle, resumed by recovery: its entries from the stored ones
        (``StoredRequest.features``; a stored field no feature built here reads is left)."""
        handle.features = {
            name: self._restore[name](value)
            for name, value in stored.items()
            if name in self._restore
        }

    async def recover(self) -> None:
        for hook in self._recover:
            await hook()


def _entries(hooks: tuple[tuple[str, Any], ...], arg: Any) -> dict[str, Any]:
    """Each feature's non-None answer, by its name."""
    entries = {}
    for name, hook in hooks:
        entry = hook(arg)
        if entry is not None:
            entries[name] = entry
    return entries


StepMessageHook = Callable[[epb.ExecuteModelRequest, SchedulerOutput], None]


def _chain(hooks: tuple[StepMessageHook, ...]) -> StepMessageHook | None:
    if len(hooks) <= 1:
        return hooks[0] if hooks else None

    def add(msg: epb.ExecuteModelRequest, out: SchedulerOutput) -> None:
        for hook in hooks:
            hook(msg, out)

    return add


NO_FEATURES = Features()
