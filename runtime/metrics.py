"""Prometheus metrics of `kiln serve`, under vLLM's names so existing dashboards work unchanged.

prometheus_client accepts ':' in metric names (checked with 0.26), so the names are vLLM's own:

    vllm:time_to_first_token_seconds     histogram  arrival → first generated token
    vllm:inter_token_latency_seconds     histogram  gap between successive generated tokens
    vllm:e2e_request_latency_seconds     histogram  arrival → finish
    vllm:request_prompt_tokens           histogram  prompt length per finished request
    vllm:request_generation_tokens       histogram  generated tokens per finished request
    vllm:num_requests_running            gauge      requests in the engine's running batch
    vllm:num_requests_waiting            gauge      requests queued in the engine, not yet admitted
    vllm:prompt_tokens_total             counter
    vllm:generation_tokens_total         counter
    vllm:request_success_total           counter    label finished_reason (stop | length | abort)

Latencies are measured where the server sees the engine's outputs, i.e. as a client would see them
(minus the network). The gauges read the engine's own `num_running` / `num_waiting` when it has them;
otherwise the server counts a request as waiting until its first token.

Every metric carries the `model_name` label, as in vLLM. Each `ServerMetrics` owns its registry, so
several apps can live in one process (tests) without name clashes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

CONTENT_TYPE = CONTENT_TYPE_LATEST

# No `*_created` series (as vLLM): process-wide, it only drops the creation-timestamp samples.
disable_created_metrics()


class ServerMetrics:
    """The server's metric families, bound to one model name."""

    def __init__(
        self,
        model_name: str,
        num_running: Callable[[], float] | None = None,
        num_waiting: Callable[[], float] | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token in seconds.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Inter-token latency in seconds.",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency in seconds.",
            labels,
            buckets=E2E_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.req_prompt = Histogram(
            "vllm:request_prompt_tokens",
            "Prompt tokens per finished request.",
            labels,
            buckets=TOKEN_COUNT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.req_gen = Histogram(
            "vllm:request_generation_tokens",
            "Generated tokens per finished request.",
            labels,
            buckets=TOKEN_COUNT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.running = Gauge(
            "vllm:num_requests_running", "Requests in the running batch.", labels, registry=r
        ).labels(model_name)
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests queued, not yet admitted to the batch.", labels, registry=r
        ).labels(model_name)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generation tokens produced.", labels, registry=r
        ).labels(model_name)
        self.success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.model_name = model_name
        self.engine_gauges = num_running is not None and num_waiting is not None
        if num_running is not None and num_waiting is not None:
            self.running.set_function(num_running)
            self.waiting.set_function(num_waiting)

    def track(self) -> RequestTracker:
        """Start tracking one request (counts it as waiting until its first token)."""
        if not self.engine_gauges:
            self.waiting.inc()
        return RequestTracker(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class RequestTracker:
    """Per-request timing; call `tokens()` for every engine output and `finish()` exactly once."""

    metrics: ServerMetrics
    arrival: float = field(default_factory=time.perf_counter)
    last_token_at: float | None = None
    num_prompt_tokens: int = 0
    num_generated: int = 0
    done: bool = False

    def prompt(self, num_prompt_tokens: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens

    def tokens(self, count: int) -> None:
        if count <= 0 or self.done:
            return
        now = time.perf_counter()
        m = self.metrics
        if self.last_token_at is None:
            m.ttft.observe(now - self.arrival)
            if not m.engine_gauges:
                m.waiting.dec()
                m.running.inc()
            m.prompt_tokens.inc(self.num_prompt_tokens)
        else:
            gap = (now - self.last_token_at) / count
            for _ in range(count):
                m.itl.observe(gap)
        self.last_token_at = now
        self.num_generated += count
        m.generation_tokens.inc(count)

    def finish(self, reason: str | None) -> None:
        if self.done:
            return
        self.done = True
        m = self.metrics
        if m.engine_gauges:
            pass
        elif self.last_token_at is None:
            m.waiting.dec()
        else:
            m.running.dec()
        m.e2e.observe(time.perf_counter() - self.arrival)
        m.req_prompt.observe(self.num_prompt_tokens)
        m.req_gen.observe(self.num_generated)
        m.success.labels(m.model_name, reason or "abort").inc()
