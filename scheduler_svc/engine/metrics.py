"""Prometheus metrics of the scheduler, with vLLM V1's names under the `llmserve:` prefix.

A dashboard or autoscaler written for vLLM needs only the prefix changed. Everything is kept in
plain ints and bucket lists that the engine bumps (a few per step, a few per request) and turned
into metric families only when Prometheus scrapes: the step path pays no locking, no label
lookups and no per-token histogram calls. The inter-token latency of a step is one interval for
every sequence that decoded in it, recorded once with its count.

Gauges (running, waiting, swapped, KV usage) and the scheduler cores' own counters (prefix
cache, preemptions) are read from the engine at scrape time. Scrapes run on the HTTP server's
thread; they only read numbers and copy small lists, never iterate the request table.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from scheduler_svc.features.metric_families import counter, gauge

if TYPE_CHECKING:
    from scheduler_svc.engine.fleet.executors import ExecutorPool
    from scheduler_svc.engine.streams import RequestHandle
    from scheduler_svc.state.persister import Persister

__all__ = ["BulkHistogram", "EngineMetrics", "serve_metrics"]

# Bucket bounds as vLLM's (seconds, tokens).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
REDIS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class BulkHistogram:
    """Cumulative-bucket histogram; observe(value, n) records n equal observations at once."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        # bisect_left: a value equal to a bound belongs to that bucket (le is inclusive).
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.total += value * n

    def family(self, name: str, doc: str, labels: dict[str, str]) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(name, doc, labels=list(labels))
        cumulative, buckets = 0, []
        for bound, count in zip((*self.bounds, float("inf")), list(self.counts), strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        fam.add_metric(list(labels.values()), buckets, self.total)
        return fam


class EngineMetrics:
    """The engine's counters and histograms, and a collector that exports them with the live
    gauges (read from the executor pool and the persister at scrape time). The engine calls the
    on_* hooks; `registry` is what /metrics serves."""

    def __init__(self, pool: ExecutorPool, persister: Persister, preemption_mode: str) -> None:
        self.pool = pool
        self.persister = persister
        self.preemption_mode = preemption_mode
        # The optional features' metric families, after the cores' own: (model name, the cores,
        # their stats) -> families (scheduler_svc/features, ``metrics``; set by the engine).
        self.feature_families: tuple[Callable[[str, list, list], Iterable[Metric]], ...] = ()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success: dict[str, int] = {}
        self.recovered = 0
        self.failovers = 0
        # Tokens (prompt and output so far) of started requests queued to be computed again
        # because their executor was lost, reset, drained or the scheduler restarted; and
        # requests that moved with their KV cache instead (live migration on drain).
        self.recomputed_tokens = 0
        self.migrated = 0
        self.handed_off = 0  # prefill/decode disaggregation: requests handed to a decode executor
        self.ttft = BulkHistogram(TTFT_BUCKETS)
        self.itl = BulkHistogram(ITL_BUCKETS)
        self.e2e = BulkHistogram(LATENCY_BUCKETS)
        self.queue = BulkHistogram(LATENCY_BUCKETS)
        self.request_prompt = BulkHistogram(TOKEN_BUCKETS)
        self.request_generation = BulkHistogram(TOKEN_BUCKETS)
        self.iteration_tokens = BulkHistogram(TOKEN_BUCKETS)
        self.redis_write = BulkHistogram(REDIS_BUCKETS)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    # ------------------------------------------------------------ hooks (engine side)

    def on_step(
        self, now: float, interval: float | None, num_tokens: int, num_sampled: int, first: list
    ) -> None:
        """One finished step: tokens it computed, tokens it sampled, and the handles that got
        their first token (for TTFT); the rest decoded, `interval` after the previous step."""
        self.iteration_tokens.observe(num_tokens)
        self.generation_tokens += num_sampled
        num_decodes = num_sampled - len(first)
        if interval is not None and num_decodes > 0:
            self.itl.observe(interval, num_decodes)
        for handle, index in first:
            if index == 0:
                handle.first_token_time = now
                self.prompt_tokens += len(handle.prompt_token_ids)
                self.ttft.observe(now - handle.arrival_time)

    def on_finish(self, handle: RequestHandle, now: float) -> None:
        reasons = handle.finish_reasons()
        reason = str(reasons[0]) if reasons and reasons[0] is not None else "abort"
        self.success[reason] = self.success.get(reason, 0) + 1
        self.e2e.observe(now - handle.arrival_time)
        if handle.scheduled_time is not None:
            self.queue.observe(max(0.0, handle.scheduled_time - handle.arrival_time))
        self.request_prompt.observe(len(handle.prompt_token_ids))
        self.request_generation.observe(sum(len(s.output_token_ids) for s in handle.states))

    # ------------------------------------------------------------ collector (scrape side)

    def collect(self) -> Iterator[Metric]:
        executors = list(self.pool.executors)
        model = executors[0].describe.model_name if executors else ""
        yield from self._core_gauges(model, [ex.sched for ex in executors])
        yield from self._request_families(model)
        yield from self._executor_families(model, executors)

    def _core_gauges(self, model: str, cores: list) -> Iterator[Metric]:
        """What the scheduler cores hold now, and their own counters."""
        yield gauge(model, "llmserve:num_requests_running", "Requests in model execution "
                    "batches.", sum(c.num_running for c in cores))  # fmt: skip
        yield gauge(model, "llmserve:num_requests_waiting", "Requests waiting to be scheduled.",
                    sum(c.num_waiting for c in cores))  # fmt: skip
        yield gauge(model, "llmserve:num_requests_swapped", "Requests whose KV cache is swapped "
                    "out to CPU memory.", sum(c.num_swapped for c in cores))  # fmt: skip
        total = sum(c.num_device_blocks for c in cores)
        free = sum(c.num_free_blocks for c in cores)
        yield gauge(model, "llmserve:kv_cache_usage_perc", "KV cache usage; 1 means 100 percent.",
                    1.0 - free / total if total else 0.0)  # fmt: skip
        stats = [c.get_stats() for c in cores]
        yield counter(model, "llmserve:prefix_cache_queries", "Prompt tokens looked up in the "
                      "prefix cache.", sum(s.prefix_cache_queries for s in stats))  # fmt: skip
        yield counter(model, "llmserve:prefix_cache_hits", "Prompt tokens found in the prefix "
                      "cache.", sum(s.prefix_cache_hits for s in stats))  # fmt: skip
        yield counter(model, "llmserve:prefix_cache_host_hits", "Of those, tokens found in "
                      "the host-memory prefix tier (copied in, not recomputed).",
                      sum(s.prefix_cache_host_hits for s in stats))  # fmt: skip
        preemptions = CounterMetricFamily(
            "llmserve:num_preemptions",
            "Preemptions of running requests.",
            labels=["model_name", "mode"],
        )
        preemptions.add_metric([model, self.preemption_mode],
                               sum(s.num_preemptions for s in stats))  # fmt: skip
        yield preemptions
        for families in self.feature_families:  # the optional features' own (features/)
            yield from families(model, cores, stats)

    def _request_families(self, model: str) -> Iterator[Metric]:
        """The engine's own counters and histograms."""
        base = {"model_name": model}
        yield counter(model, "llmserve:prompt_tokens", "Prefill tokens of requests.",
                      self.prompt_tokens)  # fmt: skip
        yield counter(model, "llmserve:generation_tokens", "Generated tokens.",
                      self.generation_tokens)  # fmt: skip
        success = CounterMetricFamily(
            "llmserve:request_success",
            "Finished requests, by finish reason.",
            labels=["model_name", "finished_reason"],
        )
        for reason, count in sorted(self.success.items()):
            success.add_metric([model, reason], count)
        yield success
        for hist, name, doc in (
            (self.ttft, "time_to_first_token_seconds", "Time to first token."),
            (self.itl, "inter_token_latency_seconds", "Time between consecutive tokens."),
            (self.e2e, "e2e_request_latency_seconds", "Arrival to finish of requests."),
            (self.queue, "request_queue_time_seconds", "Time requests spent waiting."),
            (self.request_prompt, "request_prompt_tokens", "Prompt tokens per finished request."),
            (self.request_generation, "request_generation_tokens",
             "Generated tokens per finished request."),
            (self.iteration_tokens, "iteration_tokens_total", "Tokens computed per engine step."),
        ):  # fmt: skip
            yield hist.family(f"llmserve:{name}", doc, base)
        # Ours beyond vLLM's set.
        yield counter(model, "llmserve:requests_recovered", "Requests resumed from Redis after "
                      "a scheduler restart.", self.recovered)  # fmt: skip
        yield from self._fault_families(model)
        yield self.redis_write.family(
            "llmserve:redis_write_seconds", "Duration of the persister's Redis writes.", base
        )
        yield gauge(model, "llmserve:redis_backlog_steps", "Engine steps waiting to be written "
                    "to Redis.", self.persister.backlog)  # fmt: skip
        if self.persister.store.min_replicas:  # --redis-min-replicas: the write barrier
            yield from self._replication_families(model)

    def _fault_families(self, model: str) -> Iterator[Metric]:
        """What executor losses and drains cost: requests moved, tokens computed again."""
        yield counter(model, "llmserve:executor_failovers", "Times an executor's requests moved "
                      "to another executor.", self.failovers)  # fmt: skip
        yield counter(model, "llmserve:prompt_tokens_recomputed", "Tokens (prompt and output "
                      "so far) of started requests computed again after a recovery, fail-over "
                      "or drain.", self.recomputed_tokens)  # fmt: skip
        yield counter(model, "llmserve:requests_migrated", "Running requests moved with their "
                      "KV cache to another executor (live migration on drain).",
                      self.migrated)  # fmt: skip
        yield counter(model, "llmserve:requests_handed_off", "Requests handed over with their "
                      "KV cache from a prefill executor to a decode executor after their first "
                      "token (prefill/decode disaggregation).", self.handed_off)  # fmt: skip

    def _replication_families(self, model: str) -> Iterator[Metric]:
        """How the replicas answer the per-step write barrier (issue 42)."""
        yield gauge(model, "llmserve:redis_replicas_acked", "Redis replicas that acknowledged "
                    "the last write barrier.", self.persister.replicas_acked or 0)  # fmt: skip
        yield counter(model, "llmserve:redis_unreplicated_writes", "Write barriers fewer than "
                      "--redis-min-replicas replicas acknowledged in time.",
                      self.persister.stats.num_unreplicated)  # fmt: skip

    def _executor_families(self, model: str, executors: list) -> Iterator[Metric]:
        """Per executor: steps, busy time, steps planned ahead, prefix cache."""
        families = [
            (CounterMetricFamily(name, doc, labels=["model_name", "executor"]), value)
            for name, doc, value in (
                ("llmserve:executor_steps", "Engine steps sent to each executor.",
                 lambda ex: ex.num_steps),
                ("llmserve:executor_step_seconds", "Seconds each executor spent on steps (its "
                 "busy fraction is the rate of this).", lambda ex: ex.step_seconds),
                ("llmserve:executor_steps_planned_ahead", "Of those, steps planned and sent "
                 "while the step before was still running (async scheduling).",
                 lambda ex: ex.num_steps_ahead),
                ("llmserve:executor_prefix_cache_queries", "Prompt tokens looked up in each "
                 "executor's prefix cache (routing shows in these).",
                 lambda ex: ex.sched.block_manager.prefix_cache_queries),
                ("llmserve:executor_prefix_cache_hits", "Of those, tokens found in the "
                 "executor's prefix cache.", lambda ex: ex.sched.block_manager.prefix_cache_hits),
                ("llmserve:executor_prefix_cache_host_hits", "Of those, tokens found in the "
                 "executor's host-memory prefix tier.",
                 lambda ex: ex.sched.block_manager.prefix_cache_host_hits),
            )
        ]  # fmt: skip
        for family, value in families:
            for ex in executors:
                family.add_metric([model, ex.address], value(ex))
            yield family


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 -- stdlib name
        pass  # one line per scrape would flood the log


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


def serve_metrics(metrics: EngineMetrics, host: str, port: int) -> int:
    """Serve /metrics over HTTP on a daemon thread; returns the bound port (port 0: any).

    Always the classic text format: prometheus_client (0.26) writes OpenMetrics sample names
    with `:` turned into `_` (llmserve_generation_tokens_total under a llmserve:... family), and
    Prometheus asks for OpenMetrics when it can, so dashboards would not find vLLM's names.
    Dropping the Accept header makes it answer in the format that keeps them.
    """
    app = make_wsgi_app(metrics.registry)

    def classic(environ: dict, start_response: Callable) -> Iterable[bytes]:
        environ.pop("HTTP_ACCEPT", None)
        return app(environ, start_response)

    server = make_server(host, port, classic, _ThreadingServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return int(server.server_port)
