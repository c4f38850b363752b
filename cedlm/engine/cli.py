"""`cedlm generate`: one prompt through the engine, with a stats line (or one JSON object)."""
from __future__ import annotations

import json
import sys
import time


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion for one prompt")
    p.add_argument("--model", default=None, help="checkpoint dir or preset (default: the shipped model)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the V4.1 chat encoding")
    p.add_argument("--max-tokens", "--max_tokens", dest="max_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", "--top_k", dest="top_k", type=int, default=0)
    p.add_argument("--top-p", "--top_p", dest="top_p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None)
    p.add_argument("--prefill-mode", "--prefill_mode", dest="prefill_mode", default="bounded",
                   choices=["full", "exact", "bounded"])
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (1 is fastest for small models on a busy machine)")
    p.add_argument("--engram-mmap", "--engram_mmap", dest="engram_mmap", default=None,
                   help="directory to memory-map the Engram tables from (host memory / disk)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    from cedlm.engine.llm import LLM
    from cedlm.engine.sampling_params import SamplingParams
    t0 = time.monotonic()
    llm = LLM(model=args.model, prefill_mode=args.prefill_mode, num_threads=args.threads,
              engram_mmap=args.engram_mmap)
    prompt = args.prompt
    if args.chat:
        from cedlm.text.chat import encode_chat
        prompt = llm.tokenizer.encode(encode_chat([{"role": "user", "content": prompt}]))
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, seed=args.seed, stop=args.stop)
    t1 = time.monotonic()
    out = llm.generate(prompt, sp)[0]
    dt = time.monotonic() - t1
    st = llm.stats()
    stats = {
        "prompt_tokens": len(out.prompt_token_ids), "generated_tokens": len(out.token_ids),
        "tokens_per_s": len(out.token_ids) / dt if dt > 0 else None, "elapsed_s": dt,
        "load_s": t1 - t0, "finish_reason": out.finish_reason,
        "kv_bytes_per_token": st["kv_bytes_per_token"],
        "kv_bytes_peak": dict(llm.engine.peak), "prefix_cache_queries": st["prefix_queries"],
        "prefix_cache_hits": st["prefix_hits"], "encoder_tokens": st["encoder_tokens"],
        "decoder_prefill_tokens": st["decoder_prefill_tokens"],
    }
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "stats": stats}))
    else:
        print(out.text)
        print(f"\n[{stats['prompt_tokens']} prompt + {stats['generated_tokens']} generated tokens, "
              f"{stats['tokens_per_s']:.1f} tok/s, global KV {stats['kv_bytes_per_token']:g} B/token, "
              f"peak KV bytes {stats['kv_bytes_peak']}, "
              f"prefix-cache hits {stats['prefix_cache_hits']}/{stats['prefix_cache_queries']}]",
              file=sys.stderr)
    return 0
