"""gRPC servicer of llmserve.executor.v1.Executor: per-sequence state, diffs, transactions.

Every ExecuteModel is a transaction: the whole request is validated (validation.py) against the
current state before anything changes, so a rejected step leaves the executor exactly as it was;
a forward that fails is undone from a small undo log (token lists only grow, block tables are
short).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field as dc_field
from pathlib import Path
from typing import Any

import grpc
import structlog

from executor_svc.api import tracing
from executor_svc.api.compute import Runner, direct
from executor_svc.api.kv_rpcs import KVTransferRpcs
from executor_svc.api.rpc_errors import (
    Fenced,
    NotReady,
    OutOfOrder,
    StepFailed,
    WrongInstance,
    rpc,
)
from executor_svc.api.seq_state import SeqState
from executor_svc.api.step import (
    Flight,
    StepOutput,
    StepWork,
    build_reply,
    record_samples,
    run_step,
)
from executor_svc.api.validation import StepPlan, validate_step
from executor_svc.config import envs
from executor_svc.features.registry import feature_rpcs
from executor_svc.kernels import library
from executor_svc.kv_transfer.push import TLS
from executor_svc.runner.loader import tokenizer_class_name
from executor_svc.runner.model_runner import ModelRunner
from protos import executor_pb2 as pb
from protos import executor_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)

DEFAULT_MAX_LOGPROBS = 20
_ROLES = {
    "both": pb.EXECUTOR_ROLE_BOTH,
    "prefill": pb.EXECUTOR_ROLE_PREFILL,
    "decode": pb.EXECUTOR_ROLE_DECODE,
}

# Files a tokenizer (and the scheduler's chat templating / EOS handling) may need, in the order
# they are returned. Only those present in the model directory are sent.
TOKENIZER_FILE_NAMES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
)


@dataclass(slots=True)
class _CachedUndo:
    # Enough to restore a cached sequence after a failed forward: its token list only grows, so
    # its old length suffices; the block table is copied because entries may be replaced.
    state: SeqState
    num_tokens: int
    block_table: list[int]
    num_computed_tokens: int


class ExecutorServicer(KVTransferRpcs, pb_grpc.ExecutorServicer):
    """Holds per-sequence state between steps and drives one ModelRunner, one step at a time."""

    def __init__(
        self,
        runner: ModelRunner | None = None,
        *,
        model_dir: str | Path | None = None,
        model_name: str | None = None,
        attention_backend: str | None = None,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        peer_tls: TLS | None = None,
    ) -> None:
        # New per process start (and per servicer): a change tells the scheduler its view of
        # the KV cache is gone.
        self.instance_id = uuid.uuid4().hex
        self.max_logprobs = max_logprobs
        self._seqs: dict[str, SeqState] = {}
        # One step at a time: steps mutate the KV cache and the per-sequence state.
        self._lock = threading.Lock()
        # Where steps, KV copies and feature calls run (api/compute.py): the caller's thread,
        # or a CPU executor process's one compute thread. Whatever holds the lock there must
        # not wait for the compute thread (it takes the lock itself).
        self.compute: Runner = direct
        self._runner: ModelRunner | None = None
        self._model_dir: Path | None = None
        self._tokenizer_class: str | None = None  # resolved on the first GetTokenizer
        self.on_step: Callable[[float], None] | None = None  # seconds of each step (metrics)
        self._model_name = ""
        self._attention_backend = ""
        # Set by a graceful shutdown: Describe and every step reply say so, and schedulers send
        # no new sequences.
        self.draining = False
        # Prefill/decode disaggregation (--role): "both", "prefill" or "decode", in Describe.
        self.role = "both"
        self.last_step_time = 0.0  # time.monotonic() of the last ExecuteModel call
        # Newest scheduler leadership epoch seen in a Reset: older ones are fenced off.
        self.leader_epoch = 0
        # Step order for async scheduling: (step_id, succeeded) of the last ExecuteModel that
        # ended, and a counter Reset bumps; a step sent with after_step_id waits on them.
        self._order = threading.Condition()
        self._last_step: tuple[int, bool] = (0, False)
        self._generation = 0
        # Overlapped steps (api/step.py Flight): a step ends its turn once launched, and the
        # next one may be launched before its draws reach the host. Steps launched and not yet
        # settled, oldest first.
        self.overlap = False
        self._flights: list[Flight] = []
        self.init_kv_transfer(peer_tls)  # ExportKV, ImportKV, PushKV (api/kv_rpcs.py)
        if runner is not None:
            self.attach(
                runner,
                model_dir=model_dir,
                model_name=model_name,
                attention_backend=attention_backend,
            )

    def attach(
        self,
        runner: ModelRunner,
        *,
        model_dir: str | Path | None = None,
        model_name: str | None = None,
        attention_backend: str | None = None,
    ) -> None:
        """Make the servicer usable; until then every RPC answers UNAVAILABLE."""
        self._model_dir = Path(model_dir) if model_dir is not None else None
        self._model_name = model_name or str(getattr(runner.info, "model_name", ""))
        self._attention_backend = attention_backend or runner.backend.name
        wanted = envs.overlap_steps()
        # Tensor-parallel ranks take the host's inputs: no draws kept on the device there.
        self.overlap = runner.tp is None and (
            wanted if wanted is not None else runner.device.type == "cuda"
        )
        self._runner = runner

    @property
    def runner(self) -> ModelRunner:
        if self._runner is None:
            raise NotReady()
        return self._runner

    @property
    def loaded_runner(self) -> ModelRunner | None:
        """The model runner once loaded (None before); never raises, for metrics scrapes."""
        return self._runner

    @property
    def step_lock(self) -> threading.Lock:
        """Held for the whole of every step (tensor-parallel shutdown waits on it)."""
        return self._lock

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def num_live_sequences(self) -> int:
        return len(self._seqs)

    # ---------------------------------------------------------------- RPCs

    @rpc
    def Describe(self, request: pb.DescribeRequest, context: grpc.ServicerContext) -> Any:
        runner = self.runner
        info = runner.info
        return pb.DescribeResponse(
            instance_id=self.instance_id,
            model_name=self._model_name,
            architecture=str(info.architecture),
            dtype=_dtype_name(info.dtype),
            device=str(info.device),
            block_size=runner.block_size,
            num_device_blocks=runner.num_device_blocks,
            num_cpu_blocks=runner.num_cpu_blocks,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=list(info.eos_token_ids),
            attention_backend=self._attention_backend,
            max_logprobs=self.max_logprobs,
            tensor_parallel_size=getattr(info, "tensor_parallel_size", 1),
            draining=self.draining,
            role=_ROLES[self.role],
            kv_push=True,
            hidden_size=getattr(info, "hidden_size", 0),
            cpu_kernel_isa=library.variant() if runner.device.type == "cpu" else "",
            **runner.features.describe(),
        )

    @rpc
    def GetTokenizer(self, request: pb.GetTokenizerRequest, context: grpc.ServicerContext) -> Any:
        self.runner  # noqa: B018 -- the model directory is only known once loaded
        files = []
        if self._model_dir is not None:
            for name in TOKENIZER_FILE_NAMES:
                path = self._model_dir / name
                if path.is_file():
                    files.append(pb.TokenizerFile(name=name, content=path.read_bytes()))
            if self._tokenizer_class is None:
                # Without tokenizer.json there is nothing for the scheduler to build (some
                # classes would still make an empty tokenizer from config.json alone).
                has_files = (self._model_dir / "tokenizer.json").is_file()
                self._tokenizer_class = tokenizer_class_name(self._model_dir) if has_files else ""
        return pb.GetTokenizerResponse(files=files, tokenizer_class=self._tokenizer_class or "")

    @rpc
    def Reset(self, request: pb.ResetRequest, context: grpc.ServicerContext) -> Any:
        with self._lock:
            self._check_epoch(request.leader_epoch)
            self.leader_epoch = request.leader_epoch
            num_dropped = len(self._seqs)
            self._seqs.clear()
        with self._order:
            self._generation += 1
            self._last_step = (0, False)
            self._order.notify_all()
        log.info("executor.reset", num_dropped=num_dropped)
        return pb.ResetResponse(num_dropped=num_dropped)

    @rpc
    def ExecuteModel(self, request: pb.ExecuteModelRequest, context: grpc.ServicerContext) -> Any:
        if request.after_step_id:
            self._wait_for_step(request.after_step_id, context)
        turn = _Turn(self, request.step_id)
        try:
            if tracing.ENABLED:  # a step the scheduler sampled gets a span
                metadata = context.invocation_metadata()
                return tracing.traced_step(metadata, request, lambda r: self._execute(r, turn))
            return self._execute(request, turn)
        finally:
            turn.end(ok=False)  # (no-op once the step's launch ended it)

    def _end_turn(self, step_id: int, ok: bool) -> None:
        with self._order:
            self._last_step = (step_id, ok)
            self._order.notify_all()

    def _wait_for_step(self, step_id: int, context: grpc.ServicerContext) -> None:
        """Block until step `step_id` has ended; raise unless it succeeded (and no Reset came
        in between): a step planned to follow it would act on a state that does not exist."""

        def wake() -> None:
            with self._order:
                self._order.notify_all()

        context.add_callback(wake)  # a caller that gives up (cancel, deadline) frees us
        active = context.is_active
        with self._order:
            generation = self._generation
            arrived = self._order.wait_for(
                lambda: (
                    self._last_step[0] == step_id or self._generation != generation or not active()
                ),
                timeout=context.time_remaining(),
            )
            if not active():
                raise OutOfOrder(f"the caller went away while step {step_id} was awaited")
            if self._generation != generation:
                raise OutOfOrder(f"the executor was reset before step {step_id} ran")
            if not arrived:
                raise OutOfOrder(f"step {step_id}, which this step follows, never ran")
            if not self._last_step[1]:
                raise OutOfOrder(f"step {step_id}, which this step follows, failed")

    def _execute(
        self, request: pb.ExecuteModelRequest, turn: _Turn | None = None
    ) -> pb.ExecuteModelResponse:
        """One step as a transaction: validate the whole request, apply its diffs, run it, and
        record what it sampled; a forward that fails is rolled back (module doc). Overlapped,
        the next step's turn comes once this one is launched (``turn``), before its draws."""
        flight = self.compute(self._launch, request)
        if turn is not None:
            turn.end(ok=True)
        samples = flight.settle()
        elapsed = time.perf_counter() - flight.t0
        if self.on_step is not None:
            self.on_step(elapsed)
        plan = flight.plan
        log.debug(
            "step.done",
            step_id=request.step_id,
            num_seqs=len(plan.scheduled),
            num_tokens=sum(n for _, n in plan.scheduled),
            num_sampled=samples.num_sampled,
            ms=round(elapsed * 1e3, 3),
        )
        features = self.runner.features
        return build_reply(request.step_id, samples, flight.out, elapsed, self.draining, features)

    def _launch(self, request: pb.ExecuteModelRequest) -> Flight:
        """Validate, apply and launch one step under the lock; its draws are recorded (a step
        run through) or reserved (an overlapped one, ``Flight``)."""
        runner = self.runner
        self._check_instance(request.instance_id)
        self.last_step_time = time.monotonic()
        with self._lock:
            self._check_epoch(request.leader_epoch)
            t0 = time.perf_counter()
            plan = validate_step(request, self._seqs, runner, self.max_logprobs)
            defer = self.overlap and not plan.active and not _reads_tokens(plan)
            # Only the newest launched step's tokens may be missing from the host when a step
            # is launched on top of it; none when this one reads token values on the host.
            if self._flights:  # (none where steps do not overlap)
                flights, self._flights = self._flights, []
                for f in flights[:-1] if defer else flights:
                    f.settle()
                self._flights = [f for f in flights if not f.settled]
            undo = self._apply(request, plan)
            work = StepWork.of(request, plan)
            out = self._run_or_roll_back(runner, work, plan, undo, request.step_id, defer)
            flight = Flight(plan, out, t0)
            if out.launched is not None and out.launched.deferred:
                flight.reserve()
                self._flights.append(flight)
            else:
                flight.done(record_samples(plan, out.by_id))
        return flight

    def _run_or_roll_back(
        self,
        runner: ModelRunner,
        work: StepWork,
        plan: StepPlan,
        undo: _Undo,
        step_id: int,
        defer: bool,
    ) -> StepOutput:
        try:
            return run_step(runner, work, plan, defer)
        except Exception:
            self._rollback(undo)
            log.exception("step.failed", step_id=step_id, num_seqs=len(work.seqs))
            raise StepFailed() from None

    def _check_instance(self, instance_id: str) -> None:
        if instance_id and instance_id != self.instance_id:
            raise WrongInstance(
                f"step planned for executor instance {instance_id}, this is "
                f"{self.instance_id} (restarted: its KV cache is gone); Describe and Reset first"
            )

    def _check_epoch(self, epoch: int) -> None:
        if epoch < self.leader_epoch:
            raise Fenced(
                f"scheduler leadership epoch {epoch} is older than {self.leader_epoch}: another "
                "scheduler leads now"
            )

    # ---------------------------------------------------------------- state changes

    def _apply(self, request: pb.ExecuteModelRequest, plan: StepPlan) -> _Undo:
        """Apply a validated request; returns what is needed to undo it."""
        undo = _Undo()
        # Finished ids go first so a sequence may be dropped and re-sent as new in one step
        # (preemption by recompute, or swap-in of a sequence swapped out earlier).
        for seq_id in request.finished_seq_ids:
            undo.dropped.append(self._seqs.pop(seq_id))
        for c in request.cached_sequences:
            s = self._seqs[c.seq_id]
            undo.cached.append(
                _CachedUndo(s, len(s.token_ids), s.block_table.tolist(), s.num_computed_tokens)
            )
            for r in c.replaced_blocks:
                s.block_table[r.logical_index] = r.block_id
            s.block_table.extend(c.new_block_ids)
            s.token_ids.extend(c.new_token_ids)
        for state in plan.new_states:
            self._seqs[state.seq_id] = state
            undo.added.append(state.seq_id)
        return undo

    def _rollback(self, undo: _Undo) -> None:
        for seq_id in undo.added:
            del self._seqs[seq_id]
        for u in undo.cached:
            del u.state.token_ids[u.num_tokens :]
            u.state.block_table[:] = u.block_table
            u.state.num_computed_tokens = u.num_computed_tokens
        for s in undo.dropped:
            self._seqs[s.seq_id] = s


def _feature_rpc(method: str) -> Callable[..., Any]:
    """A servicer method for an RPC a feature serves (``Feature.rpcs``), run under the
    servicer's lock: what it changes (an adapter cache, say) the steps use too."""

    def handler(self: ExecutorServicer, request: Any, context: grpc.ServicerContext) -> Any:
        runner = self.runner

        def serve() -> Any:
            with self._lock:
                return runner.features.serve(method, request)

        return self.compute(serve)

    handler.__name__ = handler.__qualname__ = method
    return rpc(handler)


for _method in feature_rpcs():
    setattr(ExecutorServicer, _method, _feature_rpc(_method))


class _Turn:
    """A step's place in the order of steps: ended once it is launched (or failed), which is
    when a step planned to follow it may start."""

    __slots__ = ("_servicer", "_step_id", "_ended")

    def __init__(self, servicer: ExecutorServicer, step_id: int) -> None:
        self._servicer = servicer
        self._step_id = step_id
        self._ended = False

    def end(self, ok: bool) -> None:
        if not self._ended:
            self._ended = True
            self._servicer._end_turn(self._step_id, ok)


def _reads_tokens(plan: StepPlan) -> bool:
    """Whether the step reads its sequences' token values on the host (penalties do), so the
    tokens of a step still in flight must be there first."""
    return any(
        p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
        for p in (s.sampling_params for s, _ in plan.scheduled)
    )


@dataclass(slots=True)
class _Undo:
    dropped: list[SeqState] = dc_field(default_factory=list)
    added: list[str] = dc_field(default_factory=list)
    cached: list[_CachedUndo] = dc_field(default_factory=list)


def _dtype_name(dtype: object) -> str:
    # ModelInfo may carry a torch.dtype or a string; the wire wants "float32" etc.
    return str(dtype).removeprefix("torch.")
