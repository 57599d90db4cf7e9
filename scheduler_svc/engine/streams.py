"""Per-request state of the engine: what was produced, what Redis acknowledged, who listens.

Each sequence has two views. `states[i]` (stop checks, detokenizer) runs ahead as tokens come
back from the executor; `acked[i]` holds only what Redis has acknowledged and is the single
source for client streams, so a client never sees a token that a crash could lose.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from scheduler_svc.core.errors import Unavailable
from scheduler_svc.core.request import FinishReason, RequestStatus
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.features.base import Taker, take_logprobs, take_token
from scheduler_svc.output.processor import OutputDelta, SequenceOutputState
from scheduler_svc.state.persister import StepRecord
from scheduler_svc.state.store import FinishRecord, StoredRequest, TokenAppend, tokens_key_bulk


@dataclass(slots=True)
class EngineEvent:
    """One delta of one sequence, ready to become a GenerateResponse."""

    index: int
    token_offset: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[str, Any]] | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    error: str = ""
    prompt_logprobs: list[dict[str, Any]] | None = None  # on a sequence's first delta, if asked


@dataclass(slots=True)
class SeqLog:
    """Acknowledged output of one sequence; `chunks[i]` is the text released with token i."""

    tokens: list[int] = field(default_factory=list)
    chunks: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    tail: str = ""  # text released at finish without a token (abort of held-back text)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


# The finished status each finish reason stands for (stored records hold the reason).
_STATUS_OF_REASON = {
    status.finish_reason(): status for status in RequestStatus if RequestStatus.is_finished(status)
}


def _lp_entry(delta: OutputDelta, i: int) -> dict[str, Any]:
    lp = delta.logprobs[i]
    return {
        "token_id": lp.token_id,
        "logprob": lp.logprob,
        "top": [[a.token_id, a.logprob, a.text] for a in lp.top],
    }


# What one step adds to one sequence's acknowledged log, published once Redis has it:
# (handle, index, token ids, text released with the last of them (or at finish, with none),
# logprob entries or None, finish reason or None, stop reason, error). A plain tuple with a
# typed shape, not a NamedTuple: one is made and unpacked per sequence per step, and a
# NamedTuple costs 45 us more per step at 256 sequences (measured: 23 vs 68 us to build and
# unpack 256), about 4 % of the whole step.
AckedDelta = tuple[
    "RequestHandle",
    int,
    list[int],
    str,
    "list[dict[str, Any]] | None",
    "FinishReason | None",
    "int | str | None",
    str,
]


@dataclass(slots=True)
class EngineStep(StepRecord):
    """What one engine step (or an abort) produced: the persister's record itself (Redis
    writes), plus what is published to clients once Redis has acknowledged it."""

    deltas: list[AckedDelta] = field(default_factory=list)
    after: list[Any] = field(default_factory=list)  # callables run once acknowledged
    first_tokens: list[tuple[RequestHandle, int]] = field(default_factory=list)  # for metrics

    def is_empty(self) -> bool:
        # Prompt logprobs always come with an `after` (their acknowledged copy).
        return not (self.appends or self.finishes or self.deltas or self.after)

    def acknowledged(self) -> None:
        if self.deltas or self.after:
            self.publish()

    def publish(self) -> None:
        for handle, index, tokens, text, lps, finish_reason, stop_reason, error in self.deltas:
            log = handle.acked[index]
            if tokens:
                # The text goes with the last token: a resume from any token index replays
                # exactly the text released from there on.
                if len(tokens) == 1:
                    log.tokens.append(tokens[0])
                    log.chunks.append(text)
                else:
                    log.tokens.extend(tokens)
                    log.chunks.extend([""] * (len(tokens) - 1))
                    log.chunks.append(text)
                if lps:
                    log.logprobs.extend(lps)
            elif text:
                log.tail += text
            if finish_reason is not None:
                log.finish_reason = finish_reason
                log.stop_reason = stop_reason
            if error:
                handle.error = error
            if handle._waiters:  # notify() inlined: most steps find a listener parked here
                handle.notify()
        for fn in self.after:
            fn()


class RequestHandle:
    # Tracing (scheduler_svc/tracing.py), class-level defaults that a traced request overrides:
    first_token_time: float | None = None  # when its first token came back
    trace_context = ""  # its request span's traceparent, stored with it ("" untraced)
    trace_span: Any = None  # that span while open here
    # The core Request's fields (Request.of); a feature's admit hook replaces, never changes it.
    core_fields: dict[str, Any] = {}

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int,
        arrival_time: float,
        timeout_s: float | None = None,
        features: dict[str, Any] | None = None,
    ) -> None:
        self.req_id = req_id
        self.features: dict[str, Any] = features or {}  # features' state, by name (base.py)
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.priority = priority
        self.arrival_time = arrival_time
        # Absolute time it ends by, 0.0 = none (features/deadlines; from_stored keeps the first).
        self.deadline = arrival_time + timeout_s if timeout_s is not None else 0.0
        self.n = params.n
        self.executor: Any = None
        self.states: list[SequenceOutputState] = []
        self.acked: list[SeqLog] = [SeqLog() for _ in range(self.n)]
        self.finished_in_engine = False
        # How each step's result for it is applied; features may choose another when the
        # request is admitted (scheduler_svc/features, `admit`).
        self.take: Taker = take_token if params.logprobs is None else take_logprobs
        self.error = ""
        self._closed: str | None = None
        self._waiters: list[asyncio.Future[None]] = []
        self._key_bulks = [tokens_key_bulk(req_id, i) for i in range(self.n)]
        # Prompt logprobs (prompt positions 1..), filled as steps compute them, when asked; the
        # acknowledged copy is set once Redis holds them and goes out with each first delta.
        self.prompt_logprobs: list[dict[str, Any] | None] | None = (
            None if params.prompt_logprobs is None else [None] * (len(prompt_token_ids) - 1)
        )
        self.scheduled_time: float | None = None  # first time a step computed it (metrics)
        self.acked_prompt_logprobs: list[dict[str, Any]] | None = (
            [] if self.prompt_logprobs == [] else None  # a one-token prompt: nothing to compute
        )
        self._prompt_logprobs_missing = len(prompt_token_ids) - 1

    # ------------------------------------------------------------ construction

    @classmethod
    def from_stored(cls, rec: StoredRequest, params: SamplingParams) -> RequestHandle:
        handle = cls(rec.req_id, rec.prompt_token_ids, params, rec.priority, rec.arrival_time)
        handle.deadline = rec.deadline  # the original one: a restart never extends it
        handle.trace_context = rec.trace_context
        return handle

    def to_stored(self, fields: dict[str, Any]) -> StoredRequest:
        """Its record in Redis; `fields`: what features keep with it (`stored_fields`)."""
        return StoredRequest(req_id=self.req_id, prompt_token_ids=self.prompt_token_ids,
                             params=self.params.to_dict(), priority=self.priority,
                             arrival_time=self.arrival_time, n=self.n,
                             trace_context=self.trace_context, **fields)  # fmt: skip

    def init_outputs(self, tokenizer: Any, eos_token_ids: list[int], max_model_len: int) -> None:
        self.states = [
            SequenceOutputState(
                tokenizer,
                self.params,
                self.prompt_token_ids,
                eos_token_ids=eos_token_ids,
                max_model_len=max_model_len,
            )
            for _ in range(self.n)
        ]

    def replay_outputs(
        self,
        tokenizer: Any,
        eos_token_ids: list[int],
        max_model_len: int,
        rec: StoredRequest,
    ) -> None:
        """Rebuild state from stored tokens, token by token, exactly as they were streamed."""
        self.init_outputs(tokenizer, eos_token_ids, max_model_len)
        self.error = rec.error
        if rec.prompt_logprobs is not None and self.prompt_logprobs is not None:
            self.prompt_logprobs = self.acked_prompt_logprobs = rec.prompt_logprobs
            self._prompt_logprobs_missing = 0
        for i, tokens in enumerate(rec.outputs):
            self._replay_seq(i, tokens, rec)
        self.finished_in_engine = rec.finished

    def _replay_seq(self, i: int, tokens: list[int], rec: StoredRequest) -> None:
        state, log = self.states[i], self.acked[i]
        want_lp = self.params.logprobs is not None
        stored_lp = rec.logprobs[i] if i < len(rec.logprobs) else []
        for pos, tok in enumerate(tokens):
            if state.finished:
                break
            if want_lp:
                e = stored_lp[pos] if pos < len(stored_lp) else {"logprob": 0.0, "top": []}
                top = [(t[0], t[1]) for t in e.get("top", [])]
                delta = state.append([tok], [e["logprob"]], [top])
            else:
                delta = state.append([tok])
            log.tokens.append(tok)
            log.chunks.append(delta.text)
            if want_lp:
                log.logprobs.append(_lp_entry(delta, 0))
            if delta.finished:
                log.finish_reason = delta.finish_status.finish_reason()
                log.stop_reason = delta.stop_reason
        stored_reason = rec.finish_reasons[i] if i < len(rec.finish_reasons) else None
        if stored_reason is not None and not state.finished:
            stop = rec.stop_reasons[i] if i < len(rec.stop_reasons) else None
            reason = FinishReason(stored_reason)
            delta = state.finish(_STATUS_OF_REASON[reason], stop)
            log.tail += delta.text
            log.finish_reason, log.stop_reason = reason, delta.stop_reason

    # ------------------------------------------------------------ engine side

    def add_prompt_logprobs(self, msg: Any, step: EngineStep) -> None:
        """One executor PromptLogprobs message. Positions already known (a recompute after
        preemption or restart computes them again) are kept as they were."""
        entries = self.prompt_logprobs
        if entries is None or not self._prompt_logprobs_missing:
            return
        k = self.params.prompt_logprobs or 0
        decode = self.states[0].detokenizer.decode_token
        prompt = self.prompt_token_ids
        for j, e in enumerate(msg.entries):
            pos = msg.first_position + j  # prompt position of the token; entries[pos - 1]
            if not 1 <= pos < len(prompt) or entries[pos - 1] is not None:
                continue
            entries[pos - 1] = {
                "token_id": prompt[pos],
                "logprob": e.logprob,
                "top": [[t.token_id, t.logprob, decode(t.token_id)] for t in e.top_logprobs[:k]],
            }
            self._prompt_logprobs_missing -= 1
        if not self._prompt_logprobs_missing:
            done: list[Any] = list(entries)
            step.prompt_logprobs.append((self.req_id, done))
            step.after.append(lambda: setattr(self, "acked_prompt_logprobs", done))

    def process_token(
        self,
        index: int,
        token_id: int,
        logprob: float,
        top_logprobs: Any,
        step: EngineStep,
    ) -> RequestStatus | None:
        """One sampled token of sequence `index`: stop checks, text, the step's records;
        returns the finish status when the token ended the sequence."""
        state = self.states[index]
        offset = len(state.output_token_ids)
        if not offset:
            step.first_tokens.append((self, index))
        if self.params.logprobs is None:
            text = state.append_token(token_id)
            tokens = [token_id]
            lps = None
        else:
            top = [(t.token_id, t.logprob) for t in top_logprobs]
            delta = state.append([token_id], [logprob], [top])
            text, tokens = delta.text, delta.token_ids
            lps = [_lp_entry(delta, i) for i in range(len(tokens))]
        step.appends.append(
            TokenAppend(self.req_id, index, offset, tokens, lps, self._key_bulks[index])
        )
        status = state.finish_status
        reason = None if status is None else status.finish_reason()
        step.deltas.append((self, index, tokens, text, lps, reason, state.stop_reason, ""))
        return status

    def finish_seq(
        self,
        index: int,
        status: RequestStatus,
        stop_reason: int | str | None,
        step: EngineStep,
        error: str = "",
    ) -> None:
        state = self.states[index]
        if state.finished:
            return
        delta = state.finish(status, stop_reason)
        if error:
            self.error = error
        step.deltas.append(
            (self, index, [], delta.text, None, status.finish_reason(), delta.stop_reason, error)
        )

    def seq_finished(self, index: int) -> bool:
        return self.states[index].finished

    @property
    def all_finished(self) -> bool:
        return all(s.finished for s in self.states)

    def finish_record(self) -> FinishRecord:
        return FinishRecord(
            self.req_id,
            self.n,
            self.finish_reasons(),
            [None if s.stop_reason is None else str(s.stop_reason) for s in self.states],
            self.error,
        )

    def finish_reasons(self) -> list[str | None]:
        return [s.finish_status.finish_reason() if s.finish_status else None for s in self.states]

    # ------------------------------------------------------------ acknowledged side

    def produced_outputs(self) -> list[list[int]]:
        """Every token processed so far per sequence (acknowledged by Redis or still queued)."""
        return [list(state.output_token_ids) for state in self.states]

    def acked_outputs(self) -> list[list[int]]:
        return [list(log.tokens) for log in self.acked]

    @property
    def num_acked(self) -> int:
        return sum(len(log.tokens) for log in self.acked)

    def notify(self) -> None:
        # Each waiting listener parks on its own future (a cancelled stream then cancels only
        # its own); a step with nobody waiting costs nothing here.
        if self._waiters:
            waiters, self._waiters = self._waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    def close(self, reason: str) -> None:
        """Wake every listener with `reason` (shutdown); the request itself stays stored."""
        self._closed = reason
        self.notify()

    async def events(self, from_index: int | list[int]) -> AsyncIterator[EngineEvent]:
        """Acknowledged output from token `from_index` on, one event per sequence and wake-up
        (a listener that falls behind gets several tokens in one event) until all finished.
        Runs per listener per step: one function, no calls per event (measured: see git log)."""
        n, acked, want_lp = self.n, self.acked, self.params.logprobs is not None
        cursors = [from_index] * n if isinstance(from_index, int) else list(from_index)
        done, remaining, loop = [False] * n, n, asyncio.get_running_loop()
        while True:
            yielded = False
            for i in range(n):
                if done[i]:
                    continue
                log, c = acked[i], cursors[i]
                # Snapshot before yielding: tokens published while suspended belong to the
                # next event, not to a cursor jump past them.
                end, finished = len(log.tokens), log.finish_reason is not None
                if c >= end and not finished:
                    continue
                if end > c:
                    cursors[i] = end
                if finished:
                    done[i], remaining = True, remaining - 1
                text = log.chunks[c] if end - c == 1 else "".join(log.chunks[c:end])
                if finished and log.tail:
                    text += log.tail
                yielded = True
                yield EngineEvent(i, c, log.tokens[c:end], text,
                                  log.logprobs[c:end] if want_lp else None, log.finish_reason,
                                  log.stop_reason, self.error if finished else "",
                                  self.acked_prompt_logprobs if c == 0 else None)  # fmt: skip
            if not remaining:
                return
            if self._closed is not None:
                raise Unavailable(self._closed)
            # After a yield look again before parking (a step may have published while the
            # caller wrote): only a pass that found nothing cannot miss a notify().
            if not yielded:
                waiter = loop.create_future()
                self._waiters.append(waiter)
                await waiter

    def _all_tokens_acked(self) -> bool:
        """Every token the engine produced is acknowledged by Redis."""
        pairs = zip(self.acked, self.states, strict=True)
        return all(len(log.tokens) == len(st.output_token_ids) for log, st in pairs)

    def view(self) -> RequestView:
        reasons = [log.finish_reason for log in self.acked]
        if all(r is not None for r in reasons):
            status = _STATUS_OF_REASON[reasons[0]]
        elif (
            self.finished_in_engine
            and self.states[0].finish_status is not None
            and self._all_tokens_acked()
        ):
            # Final in the engine, only its finish not yet acknowledged by Redis: already what
            # it will be; the core has let go of it, so asking it would say "waiting". Its
            # sequences' finish reasons come from the engine too, so a reader never sees a
            # finished request whose sequences have none.
            status = self.states[0].finish_status
            final = [st.finish_status for st in self.states]
            reasons = [
                r
                if r is not None or i >= len(final) or final[i] is None
                else final[i].finish_reason()
                for i, r in enumerate(reasons)
            ]
        elif self.finished_in_engine:
            # Its last tokens still on their way to Redis: running until they are stored.
            status = RequestStatus.RUNNING
        elif self.executor is not None and (req := self.executor.sched.get_request(self.req_id)):
            status = req.status
        else:
            status = RequestStatus.WAITING
        return RequestView(
            req_id=self.req_id,
            status=status,
            prompt_token_ids=self.prompt_token_ids,
            sequences=[
                SequenceView(log.tokens, "".join(log.chunks) + log.tail, reason, log.stop_reason)
                for log, reason in zip(self.acked, reasons, strict=True)
            ],
            arrival_time=self.arrival_time,
            error=self.error,
            priority=self.priority,
        )


@dataclass(slots=True)
class SequenceView:
    """One sequence's acknowledged output, as GetRequest returns it."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    stop_reason: int | str | None


@dataclass(slots=True)
class RequestView:
    """What GetRequest returns."""

    req_id: str
    # WAITING, RUNNING or SWAPPED, or a finished status (its first sequence's).
    status: RequestStatus
    prompt_token_ids: list[int]
    sequences: list[SequenceView]
    arrival_time: float
    error: str
    priority: int

    @classmethod
    def from_stored(
        cls,
        rec: StoredRequest,
        params: SamplingParams,
        tokenizer: Any,
        eos_ids: list[int],
        max_model_len: int,
    ) -> RequestView:
        handle = RequestHandle.from_stored(rec, params)
        handle.replay_outputs(tokenizer, eos_ids, max_model_len, rec)
        view = handle.view()
        if not rec.finished:
            # Stored but not running here (not resumed by this scheduler, or not yet).
            view.status = RequestStatus.WAITING
        return view
