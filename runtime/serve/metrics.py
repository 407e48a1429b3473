"""Prometheus metrics of a server: requests, queue depth, tokens/s, time to first token.

Each app has its own ``CollectorRegistry`` (two servers in one process, as in the tests, do not
share counters); ``GET /metrics`` writes it in the Prometheus text format. A scheduler reports
through ``ServeMetrics.observer(model)``, which implements ``scheduler.Observer``. The queue
depth and running rows are read from the scheduler when scraped (``ServeMetrics.watch``), so they
agree with ``/health`` and read 0 as soon as the last row has ended, however it ended.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Seconds; time to first token and latency span a loaded 2-core CPU to a GPU.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# tokens/s gauge: generated tokens over this many trailing seconds.
RATE_WINDOW_S = 10.0


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tfport_requests", "HTTP requests answered",
                                ["endpoint", "status"], registry=r)
        self.request_seconds = Histogram("tfport_request_seconds", "HTTP request latency",
                                         ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Gauge("tfport_queue_depth", "requests waiting for a row", ["model"], registry=r)
        self.running = Gauge("tfport_running_rows", "rows in the running batch", ["model"], registry=r)
        self.tokens = Counter("tfport_generated_tokens", "tokens generated", ["model"], registry=r)
        self.rate = Gauge("tfport_tokens_per_second",
                          f"tokens generated per second over the last {RATE_WINDOW_S:g} s",
                          ["model"], registry=r)
        self.ttft = Histogram("tfport_time_to_first_token_seconds",
                              "from submission to the first token", ["model"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.step_seconds = Histogram("tfport_decode_step_seconds", "one decode step of the batch",
                                      ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_rows = Histogram("tfport_decode_batch_rows", "live rows per decode step",
                                    ["model"], buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.finished = Counter("tfport_sequences_finished", "generated sequences by finish reason",
                                ["model", "reason"], registry=r)
        self.proposed = Counter("tfport_speculative_proposed_tokens", "draft tokens proposed "
                                "(speculative decoding)", ["model"], registry=r)
        self.accepted = Counter("tfport_speculative_accepted_tokens", "draft tokens the target "
                                "accepted (speculative decoding)", ["model"], registry=r)
        self.prefix_caches: dict = {}  # model -> its scheduler's PrefixCache, read when scraped
        r.register(PrefixCacheCollector(self.prefix_caches))
        self.batch_runners: dict = {}  # model -> its decoder runner when it has a batch export
        r.register(BatchExportCollector(self.batch_runners))

    def watch(self, model: str, scheduler) -> None:
        """Report ``model``'s queue depth and running rows as ``scheduler`` (its ``waiting`` and
        ``running``) has them when scraped, its prefix cache's counts if it has one, and its
        runs by export if it has a batch export."""
        self.queue.labels(model).set_function(lambda: scheduler.waiting)
        self.running.labels(model).set_function(lambda: scheduler.running)
        if scheduler.prefix is not None:
            self.prefix_caches[model] = scheduler.prefix
        if getattr(getattr(scheduler, "runner", None), "batch_session", None) is not None:
            self.batch_runners[model] = scheduler.runner

    def observer(self, model: str) -> "ModelObserver":
        return ModelObserver(self, model)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ModelObserver:
    """``scheduler.Observer`` for one model's scheduler."""

    def __init__(self, metrics: ServeMetrics, model: str):
        self.m = metrics
        self.model = model
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()
        metrics.rate.labels(model).set_function(self._rate)

    def _rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def _count(self, tokens: int) -> None:
        self.m.tokens.labels(self.model).inc(tokens)
        with self._lock:
            self._recent.append((time.monotonic(), tokens))

    def queue_depth(self, waiting: int, running: int) -> None:
        """Nothing: the gauges read the scheduler itself (``ServeMetrics.watch``); a count
        reported at a step boundary is stale once a row ends after it."""

    def first_token(self, seconds: float) -> None:
        self.m.ttft.labels(self.model).observe(seconds)
        self._count(1)

    def step(self, rows: int, tokens: int, seconds: float) -> None:
        self.m.step_seconds.labels(self.model).observe(seconds)
        self.m.batch_rows.labels(self.model).observe(rows)
        self._count(tokens)

    def finished(self, reason: str, seconds: float) -> None:
        self.m.finished.labels(self.model, reason).inc()

    def speculated(self, proposed: int, accepted: int) -> None:
        self.m.proposed.labels(self.model).inc(proposed)
        self.m.accepted.labels(self.model).inc(accepted)


class PrefixCacheCollector:
    """Each model's prefix cache (``decoding.prefix``) as read when scraped: hits, misses and
    evictions counted in tokens, and the bytes its blocks hold."""

    def __init__(self, caches: dict):
        self.caches = caches

    def collect(self):
        hits = CounterMetricFamily("tfport_prefix_cache_hits", "prompt tokens whose keys and "
                                   "values came from the prefix cache (chunked prefill's "
                                   "chunks included)", labels=["model"])
        misses = CounterMetricFamily("tfport_prefix_cache_misses", "prompt tokens looked up in "
                                     "the prefix cache and prefilled", labels=["model"])
        evicted = CounterMetricFamily("tfport_prefix_cache_evicted", "tokens of the blocks "
                                      "evicted from the prefix cache", labels=["model"])
        used = GaugeMetricFamily("tfport_prefix_cache_bytes", "bytes the prefix cache's blocks "
                                 "hold", labels=["model"])
        for model, cache in list(self.caches.items()):
            hits.add_metric([model], cache.hit_tokens)
            misses.add_metric([model], cache.miss_tokens)
            evicted.add_metric([model], cache.evicted_tokens)
            used.add_metric([model], cache.bytes)
        return [hits, misses, evicted, used]


class BatchExportCollector:
    """Each decoder with a batch export (``Model.load(batch_export=...)``): its graph runs by the
    export they went to, "own" (fewer rows than ``batch_rows``) or "batch", as read when scraped."""

    def __init__(self, runners: dict):
        self.runners = runners

    def collect(self):
        runs = CounterMetricFamily("tfport_batch_export_runs", "decoder runs (decode steps and "
                                   "prefills) by the export they ran on: own, or the batch export "
                                   "(runs of at least --batch-rows rows)", labels=["model", "export"])
        for model, runner in list(self.runners.items()):
            for export, count in runner.runs.items():
                runs.add_metric([model, export], count)
        return [runs]


class MetricsMiddleware:
    """ASGI middleware: counts every HTTP response by endpoint and status and times it (to the
    last byte) in the ``ServeMetrics`` that ``metrics()`` returns (None while loading)."""

    def __init__(self, app, metrics: Callable[[], ServeMetrics | None]):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = {"code": 500}

        async def send_status(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            metrics = self.metrics()
            if metrics is not None:
                route = scope.get("route")
                endpoint = getattr(route, "path", None) or "other"
                metrics.requests.labels(endpoint, str(status["code"])).inc()
                metrics.request_seconds.labels(endpoint).observe(time.perf_counter() - start)
