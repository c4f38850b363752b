"""`cedlm warmup`: build the compiled decode step's graphs ahead of time, into cedlm's cache
folder (`$CEDLM_CACHE_DIR`, default `~/.cache/cedlm`: the graph store and inductor's C++), so that
a later `cedlm serve` (same model and code, same `--speculative`) starts on the compiled step at
once. Optional: `cedlm serve` answers without it
on the uncompiled step while it compiles in the background.
"""
from __future__ import annotations

import sys
import time

from cedlm.engine.args import add_cli_args

PROG = "cedlm warmup"


def add_parser(sub) -> None:
    p = sub.add_parser("warmup", help="compile the decode step's graphs ahead of time (cached on disk)",
                       description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--model", default=None, help="checkpoint dir or preset (default: the shipped model)")
    # the engine options, as `cedlm serve` takes them (serve's default: one torch thread; the
    # compiled graphs are specific to the thread count)
    add_cli_args(p, num_threads=1)
    p.set_defaults(func=run)


def run(args) -> int:
    from cedlm.engine.args import EngineArgs
    try:
        engine_args = EngineArgs.from_cli(args, decode_step=args.decode_step or "compiled")
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    from cedlm.engine.llm import LLM
    t0 = time.monotonic()
    try:
        llm = LLM(model=args.model, args=engine_args)
    except (OSError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(f"{PROG}: model loaded in {time.monotonic() - t0:.1f} s; compiling (minutes the first time "
          f"on 2 cores, seconds from the cache)", file=sys.stderr, flush=True)
    import logging
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    got = llm.engine.warm_up()
    if not got:
        print(f"{PROG}: nothing to compile (decode step {llm.engine.decoder.active_mode})", file=sys.stderr)
        return 0
    for graph, sec in got.items():
        print(f"{PROG}: {graph}: {sec:.1f} s", file=sys.stderr)
    print(f"{PROG}: done in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    return 0
