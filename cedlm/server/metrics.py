"""Prometheus metrics, one CollectorRegistry per app (so several apps can live in one process).

Engine-side values come from the worker's snapshot (taken on the engine thread after each step),
never from the engine directly.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cedlm.server.latency import RequestLatency

KV_KINDS = ("main_kv", "index_keys", "window", "compressor_state")


class EngineCollector:
    def __init__(self, worker, model_name: str):
        self.worker, self.model = worker, model_name

    def collect(self):
        s = self.worker.snapshot
        kv, c, peak = s.get("kv", {}), s.get("counters", {}), s.get("peak", {})
        lab = ["model_name"]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=lab)
            g.add_metric([self.model], value)
            return g

        def counter(name, doc, value):
            m = CounterMetricFamily(name, doc, labels=lab)
            m.add_metric([self.model], value)
            return m

        yield gauge("cedlm_num_requests_running", "Requests admitted by the scheduler (prefilling or decoding).",
                    s.get("running", 0))
        yield gauge("cedlm_num_requests_waiting", "Requests waiting for admission.", s.get("waiting", 0))
        g = GaugeMetricFamily("cedlm_kv_bytes_in_use", "KV-cache bytes in use, by kind.",
                              labels=lab + ["kind"])
        for k in KV_KINDS:
            g.add_metric([self.model, k], kv.get(k, 0))
        yield g
        g = GaugeMetricFamily("cedlm_kv_bytes_peak", "Peak KV-cache bytes in use since start, by kind.",
                              labels=lab + ["kind"])
        for k in KV_KINDS:
            g.add_metric([self.model, k], peak.get(k, 0))
        yield g
        yield gauge("cedlm_kv_bytes_per_token", "Global KV-cache bytes per token (pool, all layers).",
                    kv.get("kv_bytes_per_token", 0))
        yield gauge("cedlm_kv_pool_bytes", "Bytes of the paged KV pool.", kv.get("pool_bytes", 0))
        yield gauge("cedlm_kv_blocks_total", "KV blocks in the pool.", kv.get("blocks_total", 0))
        yield gauge("cedlm_kv_blocks_in_use", "KV blocks held by requests.", kv.get("blocks_in_use", 0))
        yield gauge("cedlm_kv_blocks_compiling", "KV blocks held by the scratch sequences of the decode "
                    "step's background compile (freed when its graphs are adopted).", kv.get("blocks_compiling", 0))
        yield counter("cedlm_prefix_cache_queries", "Prefix-cache lookups (one per admission).",
                      kv.get("prefix_queries", 0))
        yield counter("cedlm_prefix_cache_hits", "Prefix-cache lookups that found at least one block.",
                      kv.get("prefix_hits", 0))
        yield counter("cedlm_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.",
                      kv.get("prefix_cached_tokens", 0))
        yield counter("cedlm_prompt_tokens", "Prompt tokens submitted to the engine.",
                      c.get("prompt_tokens", 0))
        yield counter("cedlm_generation_tokens", "Tokens generated.", c.get("generation_tokens", 0))
        yield counter("cedlm_preemptions", "Sequences preempted (KV freed, recomputed later).",
                      c.get("preemptions", 0))
        yield counter("cedlm_requests_finished", "Requests the engine finished (any reason but abort).",
                      c.get("requests_finished", 0))
        if "spec_steps" in c:                  # DSpark speculative decoding (engine/speculative.py)
            for key, doc in (("steps", "Speculative verification forwards (one per sequence per step)."),
                             ("drafted_tokens", "Tokens the DSpark drafter proposed."),
                             ("verified_tokens", "Drafted tokens sent to verification (confidence-scheduled)."),
                             ("accepted_tokens", "Drafted tokens the target accepted."),
                             ("emitted_tokens", "Tokens emitted by speculative steps (accepted + the target's own).")):
                yield counter(f"cedlm_spec_{key}", doc, c.get(f"spec_{key}", 0))
            g = GaugeMetricFamily("cedlm_spec_acceptance_by_position",
                                  "Accepted / verified drafts at each block position.",
                                  labels=lab + ["position"])
            for i, v in enumerate(c.get("spec_acceptance_by_position", [])):
                g.add_metric([self.model, str(i + 1)], v)
            yield g
            # when to speculate (engine/spec_policy.py), named after vLLM's spec_decode metrics
            yield gauge("cedlm_spec_decode_draft_acceptance_rate", "Accepted / verified drafted tokens.",
                        c.get("spec_acceptance_rate", 0.0))
            yield gauge("cedlm_spec_decode_tokens_per_verify", "Tokens a sequence emits per verification "
                        "(1 + accepted drafts): the policy's moving average.",
                        c.get("spec_tokens_per_verify_ema", 0.0))
            for key, doc in (("speculative_steps", "Decode steps that speculated (draft + verify)."),
                             ("plain_steps", "Decode steps with sequences that may speculate that ran a "
                                             "plain step instead (the policy: drafting did not pay)."),
                             ("exploration_steps", "Decode steps whose kind the policy chose to measure "
                                                   "its cost or acceptance (either kind).")):
                yield counter(f"cedlm_spec_decode_num_{key}", doc, c.get(f"spec_{key}", 0))
            yield gauge("cedlm_spec_decode_enabled", "1 when the last decode step speculated.",
                        c.get("spec_enabled", 0))
            g = GaugeMetricFamily("cedlm_spec_decode_cost_ratio", "Measured seconds of a speculative "
                                  "step / a plain step, by batch-size bucket.", labels=lab + ["batch_bucket"])
            for bk, v in sorted(c.get("spec_cost_ratio_by_batch", {}).items()):
                g.add_metric([self.model, str(bk)], v)
            yield g
        m = CounterMetricFamily("cedlm_requests_rejected", "Requests rejected with 429, by reason.",
                                labels=lab + ["reason"])
        for k, v in s.get("rejected", {}).items():
            m.add_metric([self.model, k], v)
        yield m
        m = CounterMetricFamily("cedlm_engine_errors", "Engine failures contained by the worker, by kind "
                                "(request: one request failed; step: a whole step; loop: the loop crashed).",
                                labels=lab + ["kind"])
        for k, v in s.get("errors", {}).items():
            m.add_metric([self.model, k], v)
        yield m
        yield from store_metrics(lab, self.model, kv)
        status, _ = self.worker.health()
        g = GaugeMetricFamily("cedlm_engine_health", "1 for the engine's current health status (as /health).",
                              labels=lab + ["status"])
        for st in ("ready", "degraded", "failed"):
            g.add_metric([self.model, st], 1 if st == status else 0)
        yield g


STORE_COUNTERS = {
    "store_block_hits": "KV blocks read back from the store (prefix-cache hits past the pool).",
    "store_errors": "KV store calls that raised (each one a cache miss).",
    "store_timeouts": "KV store calls that timed out (counted in store_errors too).",
    "store_skipped": "KV store calls skipped because their circuit breaker was open.",
    "store_breaker_trips": "Times a KV store circuit breaker opened.",
}
BREAKER_STATES = ("closed", "half_open", "open")


def store_metrics(lab: list[str], model: str, kv: dict):
    """The KV store's counters and each circuit breaker's state (1 for the current state), from
    the engine's kv stats (cache/store/guard.py); nothing without a store."""
    if "store_breaker_state" not in kv:
        return
    for k, doc in STORE_COUNTERS.items():
        m = CounterMetricFamily(f"cedlm_{k}", doc, labels=lab)
        m.add_metric([model], kv.get(k, 0))
        yield m
    g = GaugeMetricFamily("cedlm_store_breaker_state", "1 for each KV store circuit breaker's current state.",
                          labels=lab + ["breaker", "state"])
    for breaker in ("read", "write"):
        now = kv.get(f"store_{breaker}_breaker", "closed")
        for st in BREAKER_STATES:
            g.add_metric([model, breaker, st], 1 if st == now else 0)
    yield g
    g = GaugeMetricFamily("cedlm_store_consecutive_failures", "The longer failure run of the two KV store "
                          "breakers.", labels=lab)
    g.add_metric([model], kv.get("store_consecutive_failures", 0))
    yield g


class Metrics:
    def __init__(self, worker, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(worker, model_name))
        self.http = Counter("cedlm_http_requests", "HTTP requests by route and status code.",
                            ["route", "status"], registry=self.registry)
        self.disconnects = Counter("cedlm_client_disconnects", "Requests aborted because the client went away.",
                                   registry=self.registry)
        # per-request latency histograms (server/latency.py), fed by the worker for each finished request
        self.latency = RequestLatency(self.registry, model_name,
                                      getattr(getattr(worker, "engine", None), "max_model_len", 4096))
