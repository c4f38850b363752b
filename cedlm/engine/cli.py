"""`cedlm generate`: one prompt through the engine, with a stats line (or one JSON object).

A bad flag or request ends with one `cedlm generate: error: ...` line on stderr and exit code 2
(argparse's own errors print the usage first), never a traceback. The presets (`--model tiny`,
`small`, ...) build RANDOM weights: a one-line warning says so unless `--random-weights` is given.
`--prompt-logprobs K` scores the prompt (then `--max-tokens 0` is allowed: scoring only).
`--device` (auto: CUDA when available, else the CPU) is checked before the model loads; the
device it runs on is printed on stderr once the model is loaded (`device` in `--json`'s stats).
"""
from __future__ import annotations

import json
import math
import sys
import time

from cedlm.engine.args import add_cli_args

PROG = "cedlm generate"


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion for one prompt",
                       description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--model", default=None,
                   help="checkpoint dir, or a preset name (random weights; see --random-weights) "
                        "(default: the shipped model)")
    p.add_argument("--random-weights", "--random_weights", dest="random_weights", action="store_true",
                   help="accept a preset's random weights without the warning")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the V4.1 chat encoding")
    p.add_argument("--max-tokens", "--max_tokens", dest="max_tokens", type=int, default=64,
                   help="tokens to generate at most (>= 1; 0 with --prompt-logprobs: score only)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", "--top_k", dest="top_k", type=int, default=0)
    p.add_argument("--top-p", "--top_p", dest="top_p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None)
    p.add_argument("--prompt-logprobs", "--prompt_logprobs", dest="prompt_logprobs", type=int,
                   default=None, metavar="K",
                   help="score the prompt: logprob of every prompt token (+ top-K in --json); "
                        "prints the prompt's total logprob and perplexity")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    # the engine options (engine/args.py); --seed here is the sampling seed (above)
    add_cli_args(p, skip=("seed",))
    p.set_defaults(func=run)


def _error(msg: str) -> int:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    return 2


def run(args) -> int:
    try:
        return _run(args)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def _run(args) -> int:
    from cedlm.config.presets import PRESETS
    from cedlm.engine.sampling_params import SamplingParams
    try:                                        # the settings first: fail before loading a model
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=args.stop,
                            prompt_logprobs=args.prompt_logprobs)
    except ValueError as e:
        return _error(str(e))
    from cedlm.engine.args import EngineArgs
    try:
        engine_args = EngineArgs.from_cli(args, skip=("seed",))   # --seed: sampling
    except ValueError as e:
        return _error(str(e).replace("num_threads:", "--threads:", 1))   # device: ... as well
    if isinstance(args.model, str) and args.model in PRESETS and not args.random_weights:
        print(f"{PROG}: WARNING: --model {args.model} is a preset with RANDOM weights: its output is "
              f"noise (pass a checkpoint directory, or --random-weights to silence this)",
              file=sys.stderr)

    from cedlm.engine.llm import LLM
    t0 = time.monotonic()
    try:
        llm = LLM(model=args.model, args=engine_args)
    except (OSError, ValueError) as e:          # no such model, bad config (ConfigError), unreadable
        return _error(str(e) if str(e).startswith(("model", "speculative", "num_draft_tokens", "device"))
                      else f"model: {e}")
    except Exception as e:                      # noqa: BLE001 - a checkpoint that does not load
        return _error(f"model: {args.model!r} could not be loaded: {type(e).__name__}: {e}")
    from cedlm.util import describe_device
    device = describe_device(llm.device)
    print(f"{PROG}: device {device}", file=sys.stderr, flush=True)
    # the compiled graphs are being built (or loaded from the cache) in the background, started
    # by LLM, while this generates on the same step uncompiled; the engine switches to them at a
    # step boundary once they are ready (a short generation may finish first)
    bg = llm.engine.compile_in_background()
    t1 = time.monotonic()
    try:
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], sp)[0]
        else:
            out = llm.generate(args.prompt, sp)[0]
    except ValueError as e:                     # rejected request: too long, no tokenizer, ...
        return _error(str(e))
    except RuntimeError as e:                   # the request failed in the engine
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    dt = time.monotonic() - t1
    compile_s = sum(bg.seconds.values()) if bg is not None and bg.done else 0.0
    st = llm.stats()
    stats = {
        "prompt_tokens": len(out.prompt_token_ids), "generated_tokens": len(out.token_ids),
        "tokens_per_s": len(out.token_ids) / dt if dt > 0 else None, "elapsed_s": dt,
        "load_s": t1 - t0, "device": device, "decode_step_compile_s": compile_s,
        "decode_step": llm.engine.decoder.active_mode,
        "finish_reason": out.finish_reason,
        "kv_bytes_per_token": st["kv_bytes_per_token"],
        "kv_bytes_peak": dict(llm.engine.peak), "prefix_cache_queries": st["prefix_queries"],
        "prefix_cache_hits": st["prefix_hits"], "encoder_tokens": st["encoder_tokens"],
        "decoder_prefill_tokens": st["decoder_prefill_tokens"],
    }
    if args.speculative:
        stats.update({k: v for k, v in st.items() if k.startswith("spec_")})
    scored = [e for e in (out.prompt_logprobs or []) if e is not None]
    if out.prompt_logprobs is not None:
        total = sum(e.logprob for e in scored)
        stats["prompt_logprob"] = total
        stats["prompt_perplexity"] = math.exp(-total / len(scored)) if scored else None
    if args.json:
        obj = {"text": out.text, "token_ids": out.token_ids, "stats": stats}
        if out.prompt_logprobs is not None:
            obj["prompt_logprobs"] = [None if e is None else e._asdict() for e in out.prompt_logprobs]
        print(json.dumps(obj))
    else:
        print(out.text)
        tps = f"{stats['tokens_per_s']:.1f}" if stats["tokens_per_s"] is not None else "-"
        print(f"\n[{stats['prompt_tokens']} prompt + {stats['generated_tokens']} generated tokens, "
              f"{tps} tok/s, global KV {stats['kv_bytes_per_token']:g} B/token, "
              f"peak KV bytes {stats['kv_bytes_peak']}, "
              f"prefix-cache hits {stats['prefix_cache_hits']}/{stats['prefix_cache_queries']}"
              + f", decode step {llm.engine.decoder.active_mode}"
              + (f" (compiled or loaded in {compile_s:.1f} s in the background)" if compile_s else "")
              + "]",
              file=sys.stderr)
        if out.prompt_logprobs is not None:
            ppl = stats["prompt_perplexity"]
            print(f"[prompt: {len(scored)} scored tokens, total logprob {stats['prompt_logprob']:.4f}, "
                  f"perplexity {ppl:.4g}]" if ppl is not None else "[prompt: nothing to score]",
                  file=sys.stderr)
    return 0
