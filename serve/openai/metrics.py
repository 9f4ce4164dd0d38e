"""The OpenAI server's Prometheus metrics (GET /metrics), in vLLM's spirit, on prometheus_client.

Counters of requests by endpoint and finish reason, of refusals by status, of prompt, generated and cached
prompt tokens; histograms of queue time, time to first token, inter-token latency and request latency
(each observed once per request when it has ended, from the times the frontend and the runtime kept);
gauges of requests in flight and KV regions in use, read when scraped. One registry per server, so that
servers in one process (the tests) keep apart.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from refusion.runtime.request import Request
from refusion.serve.frontend import Final, Frontend

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5.0, 10.0, 20.0, 40.0,
                    80.0, 160.0, 320.0)
_TOKEN_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True)
class Arrival:
    """A request's handle in the frontend: which endpoint took it, and when (time.perf_counter())."""

    endpoint: str
    at: float = field(default_factory=time.perf_counter)


class ServerMetrics:
    def __init__(self) -> None:
        disable_created_metrics()  # no `_created` series beside each counter (vLLM leaves them out too)
        r = self.registry = CollectorRegistry()
        self.requests = Counter("refusion_requests", "Requests ended, by endpoint and the runtime's finish reason "
                                "(eos, length, stop, timeout, cancelled: a client gone or the drain; error: failed)",
                                ["endpoint", "finish_reason"], registry=r)
        self.refused = Counter("refusion_requests_refused", "Requests refused before generating, by HTTP status "
                               "(400 invalid, 401 key, 413 too large, 429 full, 503 draining, ...)", ["status"],
                               registry=r)
        self.prompt_tokens = Counter("refusion_prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.generation_tokens = Counter("refusion_generation_tokens", "Tokens generated (through the first EOS)",
                                         registry=r)
        self.cached_prompt_tokens = Counter("refusion_cached_prompt_tokens", "Prompt tokens whose KV came from the "
                                            "prefix cache", registry=r)
        self.queue_time = Histogram("refusion_queue_time_seconds", "Arrival to the scheduler starting the request "
                                    "(tokenizing and waiting for a KV region)", registry=r, buckets=_LATENCY_BUCKETS)
        self.ttft = Histogram("refusion_time_to_first_token_seconds", "Arrival to the request's first committed "
                              "tokens", registry=r, buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("refusion_inter_token_latency_seconds", "Per request, first commit to the end over the "
                             "tokens after the first (genai-perf's inter-token latency)", registry=r,
                             buckets=_TOKEN_BUCKETS)
        self.e2e = Histogram("refusion_e2e_request_latency_seconds", "Arrival to the request's end", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.in_flight = Gauge("refusion_requests_in_flight", "Requests admitted and not yet ended", registry=r)
        self.kv_regions = Gauge("refusion_kv_slots_in_use", "KV-cache regions held by running requests", registry=r)

    def watch(self, frontend: Frontend[Arrival]) -> None:
        """The gauges read the frontend when scraped."""
        self.in_flight.set_function(lambda: frontend.metrics().requests_in_flight)
        self.kv_regions.set_function(lambda: frontend.metrics().kv_regions_in_use)

    def ended(self, request: Request, arrival: Arrival, final: Final) -> None:
        """A request has ended (Frontend's on_end): count it and observe its times."""
        end = time.perf_counter()
        result = final.result
        if result is None:
            self.requests.labels(arrival.endpoint, "error").inc()
            return
        self.requests.labels(arrival.endpoint, result.finish_reason).inc()
        s = result.stats
        self.prompt_tokens.inc(s.prompt_tokens)
        self.generation_tokens.inc(s.tokens)
        self.cached_prompt_tokens.inc(s.cached_prompt_tokens)
        self.e2e.observe(end - arrival.at)
        if request.started:
            self.queue_time.observe(max(0.0, request.started - arrival.at))
        first = request.first_commit_at
        if first is not None:
            self.ttft.observe(max(0.0, first - arrival.at))
            if s.tokens > 1:
                self.itl.observe((end - first) / (s.tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
