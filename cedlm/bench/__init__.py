"""The benchmark suite: `cedlm bench` (see BENCHMARKS.md).

One module per figure, each with NAME, TITLE, run(ctx) -> dict, table(result) -> str and
plot(result, path) -> bool:

    kv_bytes   KV bytes per token from configs and from the live allocators
    capacity   sequences that fit a fixed KV budget (CED vs V4-Flash-style vs decoder-only BF16 baseline)
    prefill    long-prompt prefill time, CED bounded/exact vs the decoder-only baseline
    decode     per-token decode step time vs context
    resume     stored bytes per token of a session; resume by replay vs re-prefill
    formats    FP4/FP8 codec throughput vs memcpy
    peer       decode throughput vs HF transformers (Llama of equal parameter count)

`runner.run_figures` runs a selection and writes JSON, PNG and BENCHMARKS.md sections.
"""
