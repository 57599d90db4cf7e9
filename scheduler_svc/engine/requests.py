"""The engine's request front: what the servicer calls (submit, attach, abort, get, info,
tokenize), implementing `client.EngineClient`.

Nothing here runs a step. Everything that reads engine state first asks the lifecycle whether
the engine serves: until recovery is done the tokenizer, the model's limits and the set of
resumed requests are incomplete.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import structlog

from protos import scheduler_pb2 as pb
from scheduler_svc import tracing
from scheduler_svc.core.errors import NotFound, QueueFull, Unavailable, ValidationError
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.engine.aborts import Aborts
from scheduler_svc.engine.config import (
    MAX_REQUEST_ID_LEN,
    AbortOutcome,
    EngineConfig,
    GenerateInput,
    ServerInfo,
    public_id,
    scoped_id,
)
from scheduler_svc.engine.faults.lifecycle import Lifecycle
from scheduler_svc.engine.fleet.executors import ExecutorPool
from scheduler_svc.engine.model import ModelInfo
from scheduler_svc.engine.moves import RequestMoves
from scheduler_svc.engine.request_table import RequestTable
from scheduler_svc.engine.server_info import server_info
from scheduler_svc.engine.streams import EngineStep, RequestHandle, RequestView
from scheduler_svc.features.base import NO_FEATURES, Features
from scheduler_svc.output.tokenizer import encode_chat, encode_infill, encode_prompt
from scheduler_svc.state.persister import Persister
from scheduler_svc.state.store import (
    Created,
    RequestStore,
    StoredRequest,
    StoreFenced,
    StoreUnavailable,
)

log = structlog.get_logger(__name__)

__all__ = ["RequestFront"]


class RequestFront:
    def __init__(
        self,
        config: EngineConfig,
        lifecycle: Lifecycle,
        table: RequestTable,
        pool: ExecutorPool,
        store: RequestStore,
        persister: Persister,
        aborts: Aborts,
        model: ModelInfo,
    ) -> None:
        self.config = config
        self.lifecycle = lifecycle
        self.table = table
        self.pool = pool
        self.store = store
        self.persister = persister
        self.aborts = aborts
        self.model = model
        # The optional features' hooks (scheduler_svc/features); the engine sets them once built.
        self.features: Features = NO_FEATURES
        # The admin move (engine/moves.py), set by the engine.
        self.moves: RequestMoves | None = None

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    async def submit(self, inp: GenerateInput) -> tuple[RequestHandle, bool]:
        """The request's handle, and whether this call created it (False: attached to an
        existing request with the same id)."""
        self.check_available()
        req_id = scoped_id(inp.owner, _given_id(inp))
        existing = self.table.get(req_id)
        if existing is not None:
            return existing, False  # same id again: attach, never a second generation
        prompt = self._prompt_token_ids(inp)
        inp.params.validate(max_logprobs=self.config.max_logprobs, vocab_size=self.model.vocab_size)
        await self.features.validate(inp)
        if sum(ex.sched.num_waiting for ex in self.pool.executors) >= self.config.max_waiting:
            raise QueueFull(f"waiting queue is full ({self.config.max_waiting} requests)")
        if inp.owner:
            self.table.usage.check(inp.owner, len(prompt))
        fields = self.features.handle_fields(inp)
        handle = RequestHandle(
            req_id, prompt, inp.params, inp.priority, arrival_time=time.time(), **fields
        )
        tracing.request_started(handle, inp.trace_parent)  # before it is stored: its context is
        return await self._create(handle)

    async def _create(self, handle: RequestHandle) -> tuple[RequestHandle, bool]:
        req_id = handle.req_id
        # Held until the handle is registered: an abort of this id waits for that rather than
        # finding neither a handle nor a stored request (engine/aborts.py).
        with self.aborts.creating.hold(req_id):
            created = await self._claim(handle)
            if created is Created.EXISTS:
                # Stored by an earlier call (possibly finished): attach to what is stored.
                return await self.attach(req_id), False
            if req_id in self.table:  # a concurrent duplicate won the race in memory
                return self.table.handles[req_id], False
            m = self.model
            handle.init_outputs(m.tokenizer, m.eos_token_ids, m.max_model_len)
            if created is Created.ABORTED:
                return _aborted_ahead(handle), True
            self._admit(handle)
        log.info("request.admitted", req_id=req_id, num_prompt_tokens=len(handle.prompt_token_ids),
                 n=handle.n)  # fmt: skip
        return handle, True

    async def _claim(self, handle: RequestHandle) -> Created:
        """Store the request in Redis (first: nothing unstored ever runs)."""
        record = handle.to_stored(self.features.stored_fields(handle))
        try:
            return await self.store.create(record)
        except StoreFenced as e:
            self.lifecycle.lose_leadership(f"a write was refused: {e}")
            raise Unavailable("this scheduler is no longer the leader; retry") from e
        except StoreUnavailable as e:
            raise Unavailable(
                "request store (Redis) is unavailable; the request was not accepted, retry later"
            ) from e

    def _admit(self, handle: RequestHandle) -> None:
        self.table.add(handle)
        self.table.usage.admitted(handle)
        req = Request.of(handle)
        handle.executor = self.pool.place(req)

    async def abort(self, req_id: str, *, missing_ok: bool = False) -> AbortOutcome:
        """Returns once the outcome is final and in Redis (see engine/aborts.py)."""
        return await self.aborts.abort(req_id, missing_ok=missing_ok)

    async def tokenize(self, inp: GenerateInput) -> list[int]:
        """The prompt's token ids exactly as submit() would compute them (no length check)."""
        self.lifecycle.check()
        return self._encode(inp)

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool) -> tuple[str, list[str]]:
        """The text of `token_ids`, and each token's own text."""
        self.lifecycle.check()
        self._check_vocab(token_ids, "token_ids")
        tok = self.model.tokenizer
        text = tok.decode(token_ids, skip_special_tokens=skip_special_tokens)
        pieces = [tok.decode([t], skip_special_tokens=False) for t in token_ids]
        return text, pieces

    def _check_vocab(self, token_ids: list[int], what: str) -> None:
        vocab_size = self.model.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValidationError(
                f"{what} contains {bad}, outside the vocabulary [0, {vocab_size})"
            )

    def _encode(self, inp: GenerateInput) -> list[int]:
        if inp.token_ids is not None:
            prompt = list(inp.token_ids)
            self._check_vocab(prompt, "prompt.token_ids")
        elif inp.chat is not None:
            try:
                prompt = encode_chat(
                    self.model.tokenizer, inp.chat, add_generation_prompt=inp.add_generation_prompt
                )
            except ValueError as e:
                raise ValidationError(f"prompt.chat: {e}") from e
        elif inp.infill is not None:
            try:
                prompt = encode_infill(self.model.tokenizer, *inp.infill)
            except ValueError as e:
                raise ValidationError(f"prompt.infill: {e}") from e
        else:
            prompt = encode_prompt(self.model.tokenizer, inp.text or "")
        return prompt

    def _prompt_token_ids(self, inp: GenerateInput) -> list[int]:
        prompt = self._encode(inp)
        if not prompt or (inp.text is not None and not inp.text):
            raise ValidationError("prompt must not be empty")
        if len(prompt) >= self.model.max_model_len:
            raise ValidationError(
                f"prompt is {len(prompt)} tokens; the maximum model length is "
                f"{self.model.max_model_len} (prompt + at least one output token)"
            )
        return prompt

    def check_available(self) -> None:
        """New work needs a serving engine, an executor and a Redis that takes writes."""
        self.lifecycle.check()
        if not any(ex.healthy for ex in self.pool.executors):
            raise Unavailable("no executor is reachable")
        if not self.persister.healthy:
            raise Unavailable("request store (Redis) is unavailable; retry later")

    async def attach(self, req_id: str) -> RequestHandle:
        self.lifecycle.check()
        handle = self.table.get(req_id)
        if handle is not None:
            return handle
        rec = await self._stored(req_id)
        if rec is None:
            raise NotFound(f"request {public_id(req_id)!r} not found (unknown or expired)")
        handle = RequestHandle.from_stored(rec, SamplingParams.from_dict(rec.params))
        m = self.model
        handle.replay_outputs(m.tokenizer, m.eos_token_ids, m.max_model_len, rec)
        if not rec.finished:
            # Stored but not (yet) resumed in this process: nothing new will arrive here.
            handle.close(
                f"request {public_id(req_id)!r} is not running on this scheduler yet; retry"
            )
        return handle

    async def _stored(self, req_id: str) -> StoredRequest | None:
        try:
            return await self.store.get(req_id)
        except StoreUnavailable as e:
            raise Unavailable("request store (Redis) is unavailable; retry later") from e

    async def get_request(self, req_id: str) -> RequestView:
        self.lifecycle.check()
        try:
            rec = await self.store.get(req_id)
        except StoreUnavailable as e:
            handle = self.table.get(req_id)
            if handle is None:
                raise Unavailable("request store (Redis) is unavailable") from e
            return handle.view()
        if rec is None:
            raise NotFound(f"request {public_id(req_id)!r} not found (unknown or expired)")
        handle = self.table.get(req_id)
        if handle is not None:
            return handle.view()
        params = SamplingParams.from_dict(rec.params)
        m = self.model
        return RequestView.from_stored(rec, params, m.tokenizer, m.eos_token_ids, m.max_model_len)

    def feature(self, name: str) -> Any:
        """The named feature (None when it is not built), for the RPCs only it serves."""
        return self.features.get(name)

    def request_features(self, msg: pb.GenerateRequest) -> dict[str, Any]:
        """A Generate call's ``GenerateInput.features`` (each feature reads its fields)."""
        return self.features.from_request(msg)

    async def move_request(self, req_id: str, to_executor: str) -> tuple[str, str]:
        self.lifecycle.check()
        assert self.moves is not None
        return await self.moves.move(req_id, to_executor)

    def server_info(self) -> ServerInfo:
        self.lifecycle.check()
        info = server_info(self.pool.executors, self.config, self.model)
        for hook in self.features.server_info:
            hook(info)
        return info


def _given_id(inp: GenerateInput) -> str:
    given = inp.req_id or uuid.uuid4().hex
    if len(given) > MAX_REQUEST_ID_LEN or not given.isprintable():
        raise ValidationError(
            f"request_id must be printable and at most {MAX_REQUEST_ID_LEN} characters"
        )
    return given


def _aborted_ahead(handle: RequestHandle) -> RequestHandle:
    """A request an earlier abort ended before it began: Redis stored it finished as aborted
    (no tokens), so its stream ends at once and nothing of it is ever scheduled."""
    record = EngineStep()
    for index in range(handle.n):
        handle.finish_seq(index, RequestStatus.FINISHED_ABORTED, None, record)
    record.publish()  # Redis holds the finish already: the claim wrote it
    handle.finished_in_engine = True
    log.info("request.aborted_before_start", req_id=handle.req_id)
    return handle
