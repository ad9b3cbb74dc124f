"""Prometheus metrics of one API server, named like vLLM's with the prefix `fleet:`."""
from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from fleet.core.messages import SchedulerStats
from fleet.core.sampling_params import SamplingParams
from fleet.frontend.output_processor import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                        480.0, 960.0, 1920.0, 7680.0)
"""vLLM's buckets for the phases of a request (queue, prefill, decode, inference)."""
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
N_BUCKETS = (1, 2, 5, 10, 20)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry

        def per_engine(metric):
            # engine -> its child, looked up once: labels() takes a lock and builds the key on every
            # call, and every step's stats (every streamed token's) set eleven of them.
            return functools.cache(lambda engine: metric.labels(model_name=model_name, engine=str(engine)))

        self.num_running = per_engine(Gauge("fleet:num_requests_running", "Requests in the running batch.", ["model_name", "engine"], registry=r))
        self.num_waiting = per_engine(Gauge("fleet:num_requests_waiting", "Requests waiting to run.", ["model_name", "engine"], registry=r))
        self.kv_usage = per_engine(Gauge("fleet:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", ["model_name", "engine"], registry=r))
        self.prefix_queries = per_engine(Counter("fleet:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", ["model_name", "engine"], registry=r))
        self.prefix_hits = per_engine(Counter("fleet:prefix_cache_hits", "Prompt tokens found in the prefix cache.", ["model_name", "engine"], registry=r))
        self.preemptions = per_engine(Counter("fleet:num_preemptions", "Requests preempted for lack of KV blocks.", ["model_name", "engine"], registry=r))
        self.kv_transfer_tokens = per_engine(Counter("fleet:kv_transfer_tokens", "Prompt tokens whose KV came from a prefill instance (--kv-transfer-config).", ["model_name", "engine"], registry=r))
        self.kv_transfer_failures = per_engine(Counter("fleet:kv_transfer_failures", "KV transfers that failed, so that the prompt was computed here.", ["model_name", "engine"], registry=r))
        def engine_counter(name: str, text: str):
            return per_engine(Counter(name, text, ["model_name", "engine"], registry=r))

        self.spec_drafts = engine_counter("fleet:spec_decode_num_drafts", "Requests' steps that verified draft "
                                          "tokens (--speculative-config).")
        self.spec_draft_tokens = engine_counter("fleet:spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted_tokens = engine_counter("fleet:spec_decode_num_accepted_tokens", "Draft tokens the model "
                                                   "agreed with (output without a step of their own).")
        self.prompt_tokens = per_engine(Counter("fleet:prompt_tokens", "Prompt tokens received.", ["model_name", "engine"], registry=r))
        self.generation_tokens = per_engine(Counter("fleet:generation_tokens", "Tokens generated.", ["model_name", "engine"], registry=r))
        self.request_success = Counter("fleet:request_success", "Finished requests by finish reason.", ["model_name", "engine", "finished_reason"], registry=r)
        self.time_to_first_token = Histogram("fleet:time_to_first_token_seconds", "Time to first token.", ["model_name"], buckets=LATENCY_BUCKETS, registry=r).labels(**labels)
        self.inter_token_latency = Histogram("fleet:inter_token_latency_seconds", "Time between tokens.", ["model_name"], buckets=LATENCY_BUCKETS, registry=r).labels(**labels)
        self.e2e_latency = Histogram("fleet:e2e_request_latency_seconds", "Request latency, arrival to finish.", ["model_name"], buckets=LATENCY_BUCKETS, registry=r).labels(**labels)
        def histogram(name: str, text: str, buckets: tuple) -> Histogram:
            return Histogram(name, text, ["model_name"], buckets=buckets, registry=r).labels(**labels)

        self.queue_time = histogram("fleet:request_queue_time_seconds", "Time waiting in the engine before the "
                                    "first scheduling.", REQUEST_TIME_BUCKETS)
        self.prefill_time = histogram("fleet:request_prefill_time_seconds", "Time from the first scheduling to the "
                                      "first token.", REQUEST_TIME_BUCKETS)
        self.decode_time = histogram("fleet:request_decode_time_seconds", "Time from the first token to the last.",
                                     REQUEST_TIME_BUCKETS)
        self.inference_time = histogram("fleet:request_inference_time_seconds", "Time from the first scheduling to "
                                        "the last token.", REQUEST_TIME_BUCKETS)
        self.time_per_output_token = histogram("fleet:time_per_output_token_seconds", "Decode time of a request per "
                                               "output token after the first.", LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("fleet:request_prompt_tokens", "Prompt tokens per request.",
                                               TOKEN_COUNT_BUCKETS)
        self.request_generation_tokens = histogram("fleet:request_generation_tokens", "Generated tokens per "
                                                   "request (all n sequences).", TOKEN_COUNT_BUCKETS)
        self.request_max_tokens = histogram("fleet:request_params_max_tokens", "max_tokens of requests.",
                                            TOKEN_COUNT_BUCKETS)
        self.request_n = histogram("fleet:request_params_n", "n of requests.", N_BUCKETS)
        def per_replica(metric):
            return lambda replica: metric.labels(model_name=model_name, replica=str(replica))

        self.replica_up = per_replica(Gauge("fleet:replica_up", "1 while the data-parallel replica serves, 0 while "
                                            "it is down (being restarted).", ["model_name", "replica"], registry=r))
        self.replica_restarts = per_replica(Counter("fleet:replica_restarts", "Times the replica came back after "
                                                    "it died.", ["model_name", "replica"], registry=r))
        self.requests_retried = Counter("fleet:requests_retried", "Requests sent to another replica because theirs "
                                        "died before they had a token.", ["model_name"], registry=r).labels(**labels)
        self._routing_decisions = Counter(
            "fleet:routing_decisions", "Replicas this API server picked, by why (--data-parallel-routing): prefix "
            "(it holds the longest prefix of the prompt), least_loaded, imbalance (the one holding the prefix was "
            "too busy), round_robin.", ["model_name", "reason"], registry=r)
        self.tracked_requests = Gauge(
            "fleet:api_server_tracked_requests", "Engine requests this API server holds state for.", registry=r
        )
        self.model_name = model_name

    def routing_decision(self, reason: str) -> None:
        self._routing_decisions.labels(model_name=self.model_name, reason=reason).inc()

    def observe_scheduler(self, stats: SchedulerStats, engine: int) -> None:
        """Every step's stats (each streamed token's): a counter is incremented only by what is not zero."""
        self.num_running(engine).set(stats.num_running)
        self.num_waiting(engine).set(stats.num_waiting)
        self.kv_usage(engine).set(stats.kv_cache_usage)
        spec = stats.spec_decode
        for counter, amount in ((self.prefix_queries, stats.prefix_cache_queries),
                                (self.prefix_hits, stats.prefix_cache_hits),
                                (self.preemptions, stats.num_preemptions),
                                (self.kv_transfer_tokens, stats.kv_transfer_tokens),
                                (self.kv_transfer_failures, stats.kv_transfer_failures),
                                (self.spec_drafts, spec.num_drafts),
                                (self.spec_draft_tokens, spec.num_draft_tokens),
                                (self.spec_accepted_tokens, spec.num_accepted_tokens)):
            child = counter(engine)  # made at the first step: /metrics lists it from then on, at 0
            if amount:
                child.inc(amount)

    def observe_finished(self, output: RequestOutput, params: SamplingParams, latency: float, engine: int) -> None:
        for sequence in output.outputs:
            reason = sequence.finish_reason or "unknown"
            self.request_success.labels(model_name=self.model_name, engine=str(engine), finished_reason=reason).inc()
        self.e2e_latency.observe(latency)
        generated = sum(len(sequence.token_ids) for sequence in output.outputs)
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(generated)
        if params.max_tokens is not None:
            self.request_max_tokens.observe(params.max_tokens)
        self.request_n.observe(params.n)
        self._observe_phases(output, generated)

    def _observe_phases(self, output: RequestOutput, generated: int) -> None:
        timing = output.metrics
        if timing is None or timing.time_in_queue is None:
            return  # no token came (an error before the first)
        self.queue_time.observe(timing.time_in_queue)
        self.prefill_time.observe(timing.prefill_time)
        self.decode_time.observe(timing.decode_time)
        self.inference_time.observe(timing.prefill_time + timing.decode_time)
        sequences = len(output.outputs)
        if generated > sequences:
            self.time_per_output_token.observe(timing.decode_time / (generated - sequences))

    def render(self) -> bytes:
        return generate_latest(self.registry)
