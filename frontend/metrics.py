"""Prometheus metrics of one API server, named like vLLM's with the prefix `fleet:`."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from fleet.core.messages import SchedulerStats
from fleet.frontend.output_processor import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry

        def per_engine(metric):
            return lambda engine: metric.labels(model_name=model_name, engine=str(engine))

        self.num_running = per_engine(Gauge("fleet:num_requests_running", "Requests in the running batch.", ["model_name", "engine"], registry=r))
        self.num_waiting = per_engine(Gauge("fleet:num_requests_waiting", "Requests waiting to run.", ["model_name", "engine"], registry=r))
        self.kv_usage = per_engine(Gauge("fleet:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", ["model_name", "engine"], registry=r))
        self.prefix_queries = per_engine(Counter("fleet:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", ["model_name", "engine"], registry=r))
        self.prefix_hits = per_engine(Counter("fleet:prefix_cache_hits", "Prompt tokens found in the prefix cache.", ["model_name", "engine"], registry=r))
        self.preemptions = per_engine(Counter("fleet:num_preemptions", "Requests preempted for lack of KV blocks.", ["model_name", "engine"], registry=r))
        self.prompt_tokens = per_engine(Counter("fleet:prompt_tokens", "Prompt tokens received.", ["model_name", "engine"], registry=r))
        self.generation_tokens = per_engine(Counter("fleet:generation_tokens", "Tokens generated.", ["model_name", "engine"], registry=r))
        self.request_success = Counter("fleet:request_success", "Finished requests by finish reason.", ["model_name", "engine", "finished_reason"], registry=r)
        self.time_to_first_token = Histogram("fleet:time_to_first_token_seconds", "Time to first token.", ["model_name"], buckets=LATENCY_BUCKETS, registry=r).labels(**labels)
        self.inter_token_latency = Histogram("fleet:inter_token_latency_seconds", "Time between tokens.", ["model_name"], buckets=LATENCY_BUCKETS, registry=r).labels(**labels)
        self.e2e_latency = Histogram("fleet:e2e_request_latency_seconds", "Request latency, arrival to finish.", ["model_name"], buckets=LATENCY_BUCKETS, registry=r).labels(**labels)
        self.tracked_requests = Gauge(
            "fleet:api_server_tracked_requests", "Engine requests this API server holds state for.", registry=r
        )
        self.model_name = model_name

    def observe_scheduler(self, stats: SchedulerStats, engine: int) -> None:
        self.num_running(engine).set(stats.num_running)
        self.num_waiting(engine).set(stats.num_waiting)
        self.kv_usage(engine).set(stats.kv_cache_usage)
        self.prefix_queries(engine).inc(stats.prefix_cache_queries)
        self.prefix_hits(engine).inc(stats.prefix_cache_hits)
        self.preemptions(engine).inc(stats.num_preemptions)

    def observe_finished(self, output: RequestOutput, latency: float, engine: int) -> None:
        for sequence in output.outputs:
            reason = sequence.finish_reason or "unknown"
            self.request_success.labels(model_name=self.model_name, engine=str(engine), finished_reason=reason).inc()
        self.e2e_latency.observe(latency)

    def render(self) -> bytes:
        return generate_latest(self.registry)
