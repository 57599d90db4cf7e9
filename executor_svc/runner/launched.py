"""A step's draws once launched: already on the host, or still on their way from the device.

``ModelRunner.launch(..., defer=True)`` leaves the sampler's outputs where they were computed.
On CUDA one non-blocking copy on the step's stream brings them into pinned host memory and an
event marks its end, so the host goes on (the servicer takes the next step) while the GPU
finishes; ``results()`` waits on that event only when the host needs the tokens. The next step
does not wait for them: its input ids for the sequences that sampled here are gathered from
``device_tokens`` on the device (``runner.inputs``). On a CPU the draws are computed when
launched and ``results()`` only converts them (the same code path, for tests).

A leaf of the runner (it imports none of its modules; the sequences are the runner's
``ScheduledSequence`` views and ``out`` the sampler's ``SamplerOutput``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# What a sequence's token list holds where a token was sampled but has not reached the host
# yet (api/step.py reserves it, the launched step's results fill it).
PENDING = -1


@dataclass(slots=True)
class SampleResult:
    seq_id: str
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]  # most likely first, len == num_logprobs
    # features/spec: the draw after each proposal (verify.py), else None.
    spec: list[SampleResult] | None = None


class Launched:
    """The draws of one launched step, in sampling-row order (``seq_ids``)."""

    __slots__ = (
        "seq_ids",
        "device_tokens",
        "_seqs",
        "_host",
        "_event",
        "_gpu_span",
        "_results",
        "_lock",
        "_phases",
    )

    def __init__(
        self,
        seq_ids: list[str],
        device_tokens: torch.Tensor | None,
        results: list[SampleResult] | None = None,
    ) -> None:
        self.seq_ids = seq_ids
        # [num_samples] int64 where the sampler left them; None once only the host has them.
        self.device_tokens = device_tokens
        self._seqs: Sequence[Any] = ()
        self._host: tuple[torch.Tensor | None, ...] = ()
        self._event: torch.cuda.Event | None = None
        self._gpu_span: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._results = results
        self._lock = threading.Lock()
        self._phases: dict[str, float] | None = None

    @classmethod
    def ready(cls, results: list[SampleResult]) -> Launched:
        """Draws the host already has (a synchronous step, or one whose features used them)."""
        return cls([r.seq_id for r in results], None, results)

    @classmethod
    def of(
        cls,
        seqs: Sequence[Any],
        out: Any,
        phases: dict[str, float],
        gpu_start: torch.cuda.Event | None = None,
    ) -> Launched:
        """The sampler's outputs for ``seqs`` (one row each); on CUDA their copy to the host is
        started here and ``phases`` gets the host's wait ("wait") and, from ``gpu_start`` to
        the end of the copy, the step's span on the device ("gpu")."""
        launched = cls([s.seq_id for s in seqs], out.token_ids)
        launched._seqs = seqs
        tensors = (out.token_ids, out.logprobs, out.top_token_ids, out.top_logprobs)
        if out.token_ids.device.type == "cuda":
            launched._host = tuple(
                t.to("cpu", non_blocking=True) if t is not None else None for t in tensors
            )
            event = torch.cuda.Event(enable_timing=gpu_start is not None)
            event.record()
            launched._event = event
            launched._phases = phases
            if gpu_start is not None:
                launched._gpu_span = (gpu_start, event)
        else:
            launched._host = tensors
        return launched

    @property
    def deferred(self) -> bool:
        """Whether the host may not have the draws yet (the next step can use them on the
        device before ``results()``)."""
        return self.device_tokens is not None

    def results(self) -> list[SampleResult]:
        """One result per sampling row; waits for the device's copy the first time (any thread;
        later calls return the same list)."""
        if self._results is None:
            with self._lock:
                if self._results is None:
                    self._results = self._collect()
        return self._results

    def _collect(self) -> list[SampleResult]:
        if self._event is not None:
            t0 = time.perf_counter()
            self._event.synchronize()  # releases the GIL while it waits
            if self._phases is not None:
                self._phases["wait"] += time.perf_counter() - t0
                if self._gpu_span is not None:
                    start, end = self._gpu_span
                    self._phases["gpu"] += start.elapsed_time(end) / 1e3
        results = sample_results(self._seqs, *self._host)
        self._seqs, self._host, self._event, self._gpu_span = (), (), None, None
        return results


def sample_results(
    seqs: Sequence[Any],
    token_t: torch.Tensor,
    logprob_t: torch.Tensor,
    top_ids_t: torch.Tensor | None,
    top_lps_t: torch.Tensor | None,
) -> list[SampleResult]:
    """One result per sampling row of ``seqs`` from the sampler's outputs on the host (what
    ``Launched.results`` gives, and a step run through on a CPU, which makes no ``Launched``)."""
    token_ids = token_t.tolist()
    logprobs = logprob_t.tolist()
    top_ids = top_ids_t.tolist() if top_ids_t is not None else None
    top_lps = top_lps_t.tolist() if top_lps_t is not None else None
    results = []
    for j, s in enumerate(seqs):
        k = s.sampling_params.num_logprobs
        top = (
            list(zip(top_ids[j][:k], top_lps[j][:k], strict=True))
            if k > 0 and top_ids is not None and top_lps is not None
            else []
        )
        results.append(SampleResult(s.seq_id, int(token_ids[j]), float(logprobs[j]), top))
    return results
