"""The compute thread: where a CPU executor process that has cores of its own (`--cpu-cores`)
loads, runs every step, and makes every other call into the model's kernels.

Why one thread. OpenMP's runtime (libgomp, which torch and the kernel library share) keeps a
pool of worker threads for each thread that opens a parallel region, for as long as that
thread lives. gRPC hands each call to whichever of its worker threads is free, so steps run on
several of them, each with a pool of its own (and the loading thread has one more). Once a
process holds more OpenMP threads than it has CPUs, libgomp stops letting idle workers spin
(GOMP_SPINCOUNT's throttled count): after each parallel region they sleep at once, and each of
a step's hundreds of regions starts by waking them. One thread that runs all of it keeps one
pool, whose workers spin through a step's regions.

Why only on cores of its own. Spinning workers are right where nothing else needs those
cores, and wrong where something does: two executors sharing two cores, each with one pool of
spinning workers, ran their steps 1.65-1.89x slower than with the throttled pools
(docs/benchmarks.md, "Seventh session"). A process started without `--cpu-cores` keeps the steps on gRPC's threads
and libgomp's throttling; `--cpu-cores` says the cores are the executor's.

A CUDA executor never uses it (its steps are kernel launches; the hop would sit on the
critical path of the overlapped steps).
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

Runner = Callable[..., Any]


def direct(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn`` in the calling thread (no compute thread: CUDA, in-process servicers)."""
    return fn(*args)


class ComputeThread:
    """One long-lived thread that runs what ``run`` is given, one call at a time, in the
    caller's context variables (logging and tracing context); the caller waits for it."""

    def __init__(self, name: str = "executor-compute") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._ident: int | None = None
        self.thread_name = ""  # once it has run something

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the compute thread (directly when called from it); its result, or
        its exception raised here."""
        if threading.get_ident() == self._ident:
            return fn(*args)
        context = contextvars.copy_context()
        return self._pool.submit(self._call, context, fn, args).result()

    def _call(self, context: contextvars.Context, fn: Callable[..., T], args: tuple) -> T:
        self._ident = threading.get_ident()
        self.thread_name = threading.current_thread().name
        return context.run(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
