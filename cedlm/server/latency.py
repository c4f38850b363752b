"""Per-request latency and size histograms for /metrics, fed from each finished request's
`StepOutput` (its `RequestTimes`, engine/output.py).

The names are vLLM's (`vllm:` -> `cedlm_`) where vLLM has one, with vLLM's buckets:

    cedlm_time_to_first_token_seconds           arrival -> first sampled token
    cedlm_time_per_output_token_seconds         decode time / (output tokens - 1), two tokens or more
    cedlm_e2e_request_latency_seconds           arrival -> finish
    cedlm_request_queue_time_seconds            arrival -> first admission (KV reserved)
    cedlm_request_prefill_time_seconds          first admission -> first token
    cedlm_request_decode_time_seconds           first token -> finish
    cedlm_request_prompt_tokens                 prompt tokens per request
    cedlm_request_generation_tokens             output tokens per request
    cedlm_request_success_total{finished_reason}  finished requests by reason (stop, length, error)

Each has the `model_name` label. A request the client aborted never finishes in the engine and is
not observed (it is counted in `cedlm_client_disconnects_total`). With DSpark speculative decoding
the time per output token is where the speed-up shows (the acceptance counters are `cedlm_spec_*`).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from cedlm.engine.output import StepOutput

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's build_1_2_5_buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(float(x) for x in out)
            out.append(m * scale)
        scale *= 10


class RequestLatency:
    """The histograms of one app's registry; `observe(output)` for each finished request (called
    on the engine thread: prometheus_client's metrics are thread-safe)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int = 4096):
        self.model = model_name
        lab = ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(name, doc, lab, buckets=buckets, registry=registry).labels(model_name)
        self.ttft = hist("cedlm_time_to_first_token_seconds", "Time to first token (arrival to first "
                         "sampled token).", TTFT_BUCKETS)
        self.tpot = hist("cedlm_time_per_output_token_seconds", "Time per output token after the first "
                         "(decode time / (output tokens - 1)).", TPOT_BUCKETS)
        self.e2e = hist("cedlm_e2e_request_latency_seconds", "End-to-end request latency (arrival to "
                        "finish).", REQUEST_BUCKETS)
        self.queue = hist("cedlm_request_queue_time_seconds", "Time waiting for admission (arrival to "
                          "the first schedule).", REQUEST_BUCKETS)
        self.prefill = hist("cedlm_request_prefill_time_seconds", "Prefill time (first schedule to "
                            "first token).", REQUEST_BUCKETS)
        self.decode = hist("cedlm_request_decode_time_seconds", "Decode time (first token to finish).",
                           REQUEST_BUCKETS)
        tokens = token_buckets(max_model_len)
        self.prompt = hist("cedlm_request_prompt_tokens", "Prompt tokens per finished request.", tokens)
        self.generation = hist("cedlm_request_generation_tokens", "Output tokens per finished request.",
                               tokens)
        self.success = Counter("cedlm_request_success", "Finished requests, by finish reason.",
                               lab + ["finished_reason"], registry=registry)

    def observe(self, o: StepOutput) -> None:
        """Record one finished request (its last StepOutput)."""
        self.success.labels(self.model, o.finish_reason or "unknown").inc()
        self.prompt.observe(o.num_prompt_tokens)
        self.generation.observe(o.num_output_tokens)
        t = o.times
        if t is None:
            return
        for hist, value in ((self.ttft, t.ttft_s), (self.e2e, t.e2e_s), (self.queue, t.queue_s),
                            (self.prefill, t.prefill_s), (self.decode, t.decode_s),
                            (self.tpot, t.time_per_output_token(o.num_output_tokens))):
            if value is not None:
                hist.observe(max(0.0, value))
