"""The executor's hook points for optional features, and the ordered set of them one executor
runs.

A feature is a folder under ``features/`` with one ``Feature`` subclass that overrides the hooks
it uses; ``features/registry.py`` builds the list once at start-up from the configuration. The
step path (``runner/model_runner.py``, ``api/validation.py``, ``api/step.py``) only iterates
hooks and names no feature. Hooks by phase, and who calls them:

| phase | hook | called by |
| --- | --- | --- |
| load | ``load``, ``block_bytes``, ``allocate``, ``describe`` | ``ModelRunner.__init__``, Describe |
| validate | ``check_params``, ``check_new``, ``check_cached``, ``check_step`` | ``validate_step`` |
| prepare inputs | ``prepare`` (api), ``active``, ``before_inputs``, ``sample_rows``, ``to_workers`` | ``StepWork.of``, ``ModelRunner.execute`` / ``prepare_inputs`` |
| workers | ``worker_before_forward``, ``worker_after_forward`` | ``tp_worker.run_steps`` |
| cache ops | ``copy_blocks`` | ``ModelRunner.execute`` |
| forward | ``before_forward``, ``after_forward`` | ``ModelRunner.execute`` |
| sample | ``before_sample``, ``after_sample`` | ``ModelRunner.execute`` |
| record | ``record``, ``reply`` | ``record_samples``, ``build_reply`` |
| rpc | ``serve`` (the feature's ``rpcs``) | the servicer's method of that name (api/service.py) |

What a feature keeps per sequence is its entry in ``SeqState.features`` (the runner's view
shares the dict); what it adds to a model's projections is their ``delta`` (models/llama.py
``Linear``: ``delta.apply(x, y)`` returns the output plus the feature's part of the step's
rows); what tensor-parallel workers need of a step is its entry in the step message's
``feature_data``; its flags and its own settings section are declared in its folder, in the
module its ``flags`` names (features/flags.py collects them).

Cost: the runner asks each feature once a step whether the step uses it (``active``, one pass
over the step's sequences at most) and calls the per-step hooks of those only; a plain decode
step calls none. The API side likewise keeps the features whose ``check_step`` found work in
``StepPlan.active``. Hooks that must run every step whatever it holds (``copy_blocks``,
validation) are collected per hook at start-up (``Features``), so an unused one costs nothing.

This module imports nothing of the executor (only ``protos``): features and the step path both
depend on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

from protos import executor_pb2 as pb

__all__ = [
    "Feature",
    "Features",
    "InvalidStep",
    "LoadContext",
    "NotFound",
    "Step",
    "check_len",
    "check_tokens",
    "sampled_pb",
    "set_step_entry",
    "step_entry",
    "without_entry",
]

# The runner's and the servicer's records, named loosely here: this leaf imports none of them.
ScheduledSequence = Any  # runner.model_runner.ScheduledSequence: the step's view of a SeqState
SeqState = Any  # api.seq_state.SeqState: the one owner of a sequence's state
SampleResult = Any  # runner.model_runner.SampleResult
StepPlan = Any  # api.validation.StepPlan


class InvalidStep(ValueError):
    """A request the executor refuses; the message names the field and is safe for clients."""


class NotFound(InvalidStep):
    """A refusal because something the request names cannot be found (NOT_FOUND)."""


@dataclass(slots=True)
class LoadContext:
    """What a feature may use while the runner loads (the runner's own parts, passed in so that
    features import nothing of the runner)."""

    model: Any  # the loaded target model
    info: Any  # runner.loader.ModelInfo of the target
    device: Any  # torch.device the model runs on
    backend: Any  # the attention backend
    tp: Any  # parallel.group.TPGroup of this rank, None without tensor parallelism
    load_model: Callable[..., tuple[Any, Any]]  # runner.loader.load_model
    new_kv_cache: Callable[..., Any]  # runner.kv_cache.KVCache
    block_bytes: Callable[..., int]  # runner.kv_cache.block_bytes
    prepare_inputs: Callable[[list[Any]], Any]  # ModelRunner.prepare_inputs


@dataclass(slots=True)
class Step:
    """One runner step as the features see it."""

    seqs: list[ScheduledSequence]
    active: Sequence[Feature]  # the features this step uses, in registry order
    # Lists the caller gave for what features return beside the samples, by feature name
    # (None: the caller does not want it).
    outputs: dict[str, list[Any] | None]
    # Set by a feature that changes the model for this step (adapter rows, say): the forward
    # then runs eagerly, never from a captured CUDA graph.
    eager: bool = False


class Feature:
    """An optional capability of the executor. Every hook here does nothing; a feature overrides
    the ones it uses. ``name`` keys its per-step data and outputs; ``handle`` is what tools and
    tests reach as ``runner.features.handle(name)`` (its manager or model), None when off."""

    name: ClassVar[str] = ""
    # The executor RPCs (executor.proto method names) the feature serves, through ``serve``.
    rpcs: ClassVar[tuple[str, ...]] = ()
    # The key of the list the runner's caller gives for what the feature returns beside the
    # samples (ModelRunner.execute's keyword of that name), "" for none.
    output: ClassVar[str] = ""
    # The module in the feature's folder that declares its command-line flags, read by
    # features/flags.py (``add_flags``, ``usage_error``, ``server_options``, optionally
    # ``SECTION``); None: the feature has none.
    flags: ClassVar[ModuleType | None] = None
    handle: Any = None

    @classmethod
    def build(cls, options: dict[str, Any]) -> Feature:
        """The feature from the runner's feature options (features/registry.py)."""
        return cls()

    def serve(self, method: str, request: Any) -> Any:
        """One of the feature's ``rpcs`` (under the servicer's lock); its response message."""
        raise NotImplementedError(method)

    # ------------------------------------------------------------------ load

    def load(self, ctx: LoadContext) -> None:
        """After the target model is loaded, before the KV cache is sized."""

    def block_bytes(self, block_size: int) -> int:
        """Extra device bytes the feature keeps per KV block (counted when sizing the cache)."""
        return 0

    def allocate(self, num_device_blocks: int, block_size: int) -> None:
        """Once the number of KV blocks is known."""

    def describe(self) -> dict[str, Any]:
        """DescribeResponse fields this feature fills."""
        return {}

    # ------------------------------------------------------------------ validate (api)

    def check_params(self, field: str, params: Any, limits: Any) -> None:
        """A new sequence's ``pb.SamplingParams``; raise InvalidStep naming ``field``."""

    def check_new(self, field: str, n: Any, state: SeqState) -> None:
        """A checked ``pb.NewSequence`` and the state it starts; may fill the state's fields."""

    def check_cached(
        self, field: str, c: Any, state: SeqState, num_tokens: int, limits: Any
    ) -> int:
        """A ``pb.CachedSequence`` diff of ``state``; returns the tokens the step then covers
        (``num_tokens`` unless the feature adds some)."""
        return num_tokens

    def check_step(self, request: Any, plan: StepPlan, limits: Any) -> bool:
        """The whole step once every sequence is checked; True when the step uses the feature
        (it may keep its per-step data in ``plan.extras[name]``)."""
        return False

    # ------------------------------------------------------------------ prepare inputs

    def prepare(self, plan: StepPlan, seqs: list[ScheduledSequence]) -> None:
        """API side, for a step that uses the feature: its per-step fields onto the runner's
        views of the scheduled sequences (``seqs[i]`` is ``plan.scheduled[i]``)."""

    def active(self, seqs: Sequence[ScheduledSequence]) -> bool:
        """Runner side: does this step use the feature (then its step hooks below run)."""
        return False

    def before_inputs(self, step: Step) -> None:
        """Before the batch is flattened (a feature may add tokens to the views here)."""

    def sample_rows(
        self, seqs: Sequence[ScheduledSequence], sample_seq_indices: list[int], query_start_loc: Any
    ) -> tuple[list[int], Any] | None:
        """Which rows of the forward sample, when the feature changes them (else None)."""
        return None

    def to_workers(self, step: Step, fields: dict[str, Any]) -> None:
        """Tensor-parallel rank 0: what the other ranks need of the step (StepMessage fields;
        the feature's own JSON-able data goes in ``fields["feature_data"][name]``)."""

    def worker_before_forward(self, data: Any) -> None:
        """Tensor-parallel workers, every step with a batch: before the forward, given what
        rank 0's ``to_workers`` put in ``feature_data`` for the feature (None: nothing)."""

    def worker_after_forward(self) -> None:
        """Tensor-parallel workers: after the forward (also when it raised)."""

    # ------------------------------------------------------------------ cache ops and forward

    def copy_blocks(self, src_to_dst: list[tuple[int, int]]) -> None:
        """Every step's block copies (after the target cache's), whether or not it is active."""

    def before_forward(self, step: Step) -> None:
        """Just before the forward."""

    def after_forward(self, step: Step, hidden: Any) -> None:
        """The forward's hidden states [num_tokens, hidden], rows in step order."""

    # ------------------------------------------------------------------ sample

    def before_sample(
        self, step: Step, sample_seq_indices: list[int], rows: list[Any], logits: Any
    ) -> list[Any]:
        """The sequence each logits row samples as (may return other views), and the logits
        [num_rows, vocab] float32, which the feature may change in place."""
        return rows

    def after_sample(
        self, step: Step, sample_seq_indices: list[int], results: list[SampleResult]
    ) -> list[SampleResult]:
        """The sampler's results, one per row; returns one per sequence."""
        return results

    # ------------------------------------------------------------------ record (api)

    def record(self, plan: StepPlan, state: SeqState, result: SampleResult, sampled: Any) -> bool:
        """Apply a sampled sequence's result to its state and its ``pb.SampledToken``; True
        when the feature did (else the plain path appends the token)."""
        return False

    def reply(self, outputs: dict[str, list[Any]], response: Any) -> None:
        """Fill ``pb.ExecuteModelResponse`` from what the runner put in ``outputs[name]``."""


def _overrides(feature: Feature, hook: str) -> bool:
    return getattr(type(feature), hook) is not getattr(Feature, hook)


class Features:
    """The executor's features in registry order, with the ones overriding each always-called
    hook listed once at start-up."""

    def __init__(self, features: Iterable[Feature] = ()) -> None:
        self.all: tuple[Feature, ...] = tuple(features)
        self.by_name = {f.name: f for f in self.all}
        self.by_rpc = {m: f for f in self.all for m in f.rpcs}
        self.output_names = frozenset(f.output for f in self.all if f.output)

        def having(hook: str) -> tuple[Feature, ...]:
            return tuple(f for f in self.all if _overrides(f, hook))

        self.check_params = having("check_params")
        self.check_new = having("check_new")
        self.check_cached = having("check_cached")
        self.check_step = having("check_step")
        self.copy_blocks = having("copy_blocks")
        self.on_workers = having("worker_before_forward")
        self.reply = having("reply")
        self._active = having("active")

    def __iter__(self) -> Any:
        return iter(self.all)

    def handle(self, name: str) -> Any:
        """The named feature's handle (its manager or model); None when it is not loaded."""
        f = self.by_name.get(name)
        return f.handle if f is not None else None

    def serve(self, method: str, request: Any) -> Any:
        """A feature's RPC (``Feature.rpcs``)."""
        return self.by_rpc[method].serve(method, request)

    def active(self, seqs: Sequence[ScheduledSequence]) -> list[Feature]:
        """The features this step of the runner uses."""
        return [f for f in self._active if f.active(seqs)]

    def outputs(self) -> dict[str, list[Any]]:
        """An empty list for each feature's output, by its key (ModelRunner.execute keywords)."""
        return {f.output: [] for f in self.all if f.output}

    def describe(self) -> dict[str, Any]:
        """DescribeResponse fields of every feature."""
        fields: dict[str, Any] = {}
        for f in self.all:
            fields.update(f.describe())
        return fields


def step_entry(seq: ScheduledSequence, name: str) -> Any:
    """The named feature's data on a runner view for this step (None: none)."""
    d = seq.step_data
    return d.get(name) if d else None


def set_step_entry(seq: ScheduledSequence, name: str, value: Any) -> None:
    if seq.step_data is None:
        seq.step_data = {}
    seq.step_data[name] = value


def without_entry(seq: ScheduledSequence, name: str) -> dict[str, Any] | None:
    """The view's step data less the named feature's (a new dict; None when nothing is left),
    for a derived view that must not carry it."""
    d = seq.step_data
    if not d or name not in d:
        return d
    rest = {k: v for k, v in d.items() if k != name}
    return rest or None


def sampled_pb(r: SampleResult) -> pb.SampledToken:
    """A SampleResult as the reply carries it."""
    return pb.SampledToken(
        seq_id=r.seq_id,
        token_id=r.token_id,
        logprob=r.logprob,
        top_logprobs=[pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in r.top_logprobs],
    )


def check_len(field: str, num_tokens: int, max_model_len: int) -> None:
    if num_tokens > max_model_len:
        raise InvalidStep(
            f"{field}: sequence of {num_tokens} tokens exceeds max_model_len {max_model_len}"
        )


def check_tokens(field: str, token_ids: Sequence[int], vocab_size: int) -> None:
    # max() runs in C; the loop that finds the offending index only runs on bad input.
    if not token_ids or max(token_ids) < vocab_size:
        return
    for j, t in enumerate(token_ids):
        if t >= vocab_size:
            raise InvalidStep(f"{field}[{j}]: token id {t} out of range [0, {vocab_size})")
