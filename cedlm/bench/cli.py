"""`cedlm bench`: run the benchmark suite (see BENCHMARKS.md)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

FULL_OUT = Path("bench/results")
QUICK_OUT = Path("bench/results/quick")
# EngineArgs fields bench does not take as engine flags: its own --threads and --seed mean the
# same for every figure, and the dspark figure runs plain and speculative decoding itself.
BENCH_SKIPS = ("num_threads", "seed", "speculative", "speculative_threshold", "num_draft_tokens",
               "speculative_policy", "engram_mmap")


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="small sizes (a smoke test; minutes, results under bench/results/quick)")
    p.add_argument("--only", metavar="NAME,...",
                   help="figures to run: kv_bytes, capacity, prefill, decode, resume, formats, peer, dspark")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help=f"results directory (default {FULL_OUT}, or {QUICK_OUT} with --quick)")
    p.add_argument("--md", type=Path, metavar="PATH",
                   help="BENCHMARKS.md to update (default ./BENCHMARKS.md for full runs into the "
                        "default directory, else DIR/BENCHMARKS.md)")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="torch intra-op threads (default 1)")
    p.add_argument("--install-peer", action="store_true",
                   help="peer figure: pip-install transformers, llama-cpp-python (a source "
                        "build: minutes), gguf and sentencepiece into this environment when "
                        "absent (default: skip the figure or its llama.cpp columns with a message)")
    p.add_argument("--peer-contexts", metavar="N,...",
                   help="peer figure: the contexts to run (default 512,2048,8192,32768; --quick: 512)")
    p.add_argument("--no-install", action="store_true",
                   help="(the default; kept for compatibility) never pip-install anything")
    p.add_argument("--no-profile", action="store_true", help="do not profile missed targets")
    p.add_argument("--seed", type=int, default=0)
    # The engine's options (EngineArgs), for the figures that run the engine (capacity, kv_bytes,
    # dspark); a figure that fixes one of them for what it measures says so and keeps its value.
    from cedlm.engine.args import EngineConfig, add_cli_args
    g = p.add_argument_group("engine options (default: the engine's; see `cedlm serve --help`)")
    # --device (default auto: CUDA when available, else the CPU): every figure's models, caches
    # and peers live there; a figure that measures the CPU by nature is skipped on a GPU with its
    # reason (runner.skip_reason). The GPU-only figures (capacity in device memory, the decode
    # grid to batch 64) are bench/scripts/gpu_check.sh.
    add_cli_args(g, skip=BENCH_SKIPS, **{f: None for f in EngineConfig.__dataclass_fields__})
    p.add_argument("--dspark-contexts", metavar="N,...",
                   help="dspark figure: the long contexts of its batch-1 rows (default "
                        "512,2048,8192,32768; --quick: 256); none: no long-context rows")
    p.add_argument("--dspark-model", type=Path, default=None, metavar="DIR",
                   help="dspark figure: the model dir with its trained drafter (mtp.safetensors; "
                        "default runs/dspark/export when it has one, else the shipped cedlm/assets/model)")
    p.set_defaults(func=run)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="run the benchmark suite (JSON, plots, BENCHMARKS.md)",
                              description=__doc__)
    _add_arguments(p)
    return p


def run(args) -> int:
    from cedlm.bench.common import Ctx
    from cedlm.bench.runner import plan, run_figures, select
    if args.threads < 1:
        raise SystemExit("cedlm bench: error: --threads must be >= 1")
    try:
        names = select(args.only)
    except ValueError as e:
        raise SystemExit(f"cedlm bench: error: {e}")
    from cedlm.util import describe_device, resolve_device
    try:
        device = resolve_device(getattr(args, "device", None), "device")
    except ValueError as e:
        raise SystemExit(f"cedlm bench: error: {e}")
    import torch
    torch.set_num_threads(args.threads)               # before the line that reports them
    print(f"cedlm bench: device {describe_device(device)}", flush=True)
    for name, why in plan(names, device).items():
        if why is not None:
            print(f"cedlm bench: {why}", flush=True)
    from cedlm.engine.args import EngineConfig
    engine_options = {f: getattr(args, f) for f in EngineConfig.__dataclass_fields__
                      if getattr(args, f, None) is not None}
    if args.quick and "decode_step" not in engine_options:
        # a smoke run: the same step uncompiled, so that a cold machine does not spend its
        # minutes compiling graphs (the full run, or --decode-step compiled, measures them)
        engine_options["decode_step"] = "static"
        print("cedlm bench: --quick runs the decode step uncompiled (--decode-step compiled to "
              "compile it)", flush=True)
    try:
        EngineConfig(**engine_options)
    except ValueError as e:
        raise SystemExit(f"cedlm bench: error: {e}")
    peer_contexts = None
    if args.peer_contexts:
        try:
            peer_contexts = [int(x) for x in args.peer_contexts.split(",") if x.strip()]
        except ValueError:
            peer_contexts = []
        if not peer_contexts or min(peer_contexts) < 1:
            raise SystemExit(f"cedlm bench: error: --peer-contexts: positive integers separated "
                             f"by commas, got {args.peer_contexts!r}")
    dspark_contexts = None
    if args.dspark_contexts:
        if args.dspark_contexts.strip().lower() == "none":
            dspark_contexts = []
        else:
            try:
                dspark_contexts = [int(x) for x in args.dspark_contexts.split(",") if x.strip()]
            except ValueError:
                dspark_contexts = [0]
            if not dspark_contexts or min(dspark_contexts) < 1:
                raise SystemExit(f"cedlm bench: error: --dspark-contexts: positive integers separated "
                                 f"by commas or none, got {args.dspark_contexts!r}")
    out = args.out or (QUICK_OUT if args.quick else FULL_OUT)
    md = args.md
    if md is None:
        md = Path("BENCHMARKS.md") if args.out is None and not args.quick else out / "BENCHMARKS.md"
    ctx = Ctx(quick=args.quick, out=out, threads=args.threads,
              install=args.install_peer and not args.no_install,
              profile=not args.no_profile, seed=args.seed, log=lambda s: print(s, flush=True),
              dspark_model=args.dspark_model, engine_options=engine_options,
              peer_contexts=peer_contexts, dspark_contexts=dspark_contexts, device=device)
    results = run_figures(names, ctx, md)
    print(f"results: {out}/  report: {md}")
    return 1 if any(r.get("error") for r in results) else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="cedlm bench", description=__doc__)
    _add_arguments(p)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
