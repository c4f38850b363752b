"""`cedlm serve`: the OpenAI-compatible server (FastAPI + uvicorn), loopback by default.

`--device` (auto: CUDA when available, else the CPU) is checked before the model loads (a bad one
is one `cedlm serve: error: device: ...` line, exit 2); the device is logged at start, printed in
the start-up line and reported on every /v1/models card (`device`)."""
from __future__ import annotations

import argparse
import ipaddress
import sys

from cedlm.engine.args import add_cli_args, parse_bytes

__all__ = ["add_parser", "build_app", "configure_logging", "exposure_warning", "is_loopback", "parse_bytes",
           "run"]


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    h = host.strip().strip("[]")
    if h.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False          # a host name: it may resolve to anything


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning `cedlm serve` prints when it binds beyond loopback without an API key."""
    if api_key or is_loopback(host):
        return None
    return (f"WARNING: cedlm serve is binding to {host}, which is reachable from other machines, "
            f"without an API key: anyone who can reach it can use the model. Set --api-key or "
            f"$CEDLM_API_KEY, or bind to 127.0.0.1.")


def _alias(s: str) -> str:
    from cedlm.server.aliases import parse_alias
    try:
        parse_alias(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def _non_negative(s: str) -> int:
    try:
        n = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def _port(s: str) -> int:
    try:
        n = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535, got {n}")
    return n


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                       description=__doc__)
    from cedlm import __version__
    p.add_argument("--version", action="version", version=f"cedlm {__version__}")
    p.add_argument("--model", default=None,
                   help="checkpoint dir or preset (default: the shipped default model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port (1-65535; default 8000)")
    p.add_argument("--api-key", "--api_key", dest="api_key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                        "$CEDLM_API_KEY, else open)")
    p.add_argument("--metrics-public", "--metrics_public", dest="metrics_public", action="store_true",
                   help="with an API key, leave /metrics open (default: /metrics needs the key too)")
    p.add_argument("--served-model-name", "--served_model_name", dest="served_model_name", default=None,
                   help="model name clients use (default: cedlm-small for the shipped model, cedlm-PRESET "
                        "for a preset, the directory name for a checkpoint)")
    p.add_argument("--alias", action="append", default=[], type=_alias, metavar="NAME[=current|deprecated]",
                   help="another name for the served model; deprecated ones are served but announced "
                        "(repeatable; 'cedlm' is always a current alias)")
    # the engine options (engine/args.py); serving defaults to one torch thread: best for small
    # models on a busy machine
    add_cli_args(p, num_threads=1)
    p.add_argument("--max-waiting", "--max_waiting", dest="max_waiting", type=int, default=64,
                   help="requests that may wait for admission while the engine is full; beyond -> 429")
    p.add_argument("--queue-timeout", "--queue_timeout", dest="queue_timeout", type=float, default=30.0,
                   help="seconds a request may wait for admission before it gets 429 (0 or less: forever)")
    p.add_argument("--retry-after", "--retry_after", dest="retry_after", type=int, default=1,
                   help="seconds sent in the retry-after header of a 429")
    p.add_argument("--max-body-bytes", "--max_body_bytes", dest="max_body_bytes", type=parse_bytes,
                   default=8 << 20, help="largest request body; larger -> 413 before it is read "
                                          "(suffixes K/M/G, default 8M)")
    p.add_argument("--allow-remote-images", "--allow_remote_images", dest="allow_remote_images",
                   action="store_true", help="fetch http(s) image_url parts (default: refused with "
                                             "400; data: URLs are always accepted)")
    p.add_argument("--max-prompt-tokens", "--max_prompt_tokens", dest="max_prompt_tokens", type=int,
                   default=None, help="longest prompt a request may send; longer -> 400 "
                                      "(default: max-model-len)")
    p.add_argument("--default-max-tokens", "--default_max_tokens", dest="default_max_tokens",
                   type=_non_negative, default=256,
                   help="max_tokens of a request that omits it (default 256: seconds on a 2-core CPU; "
                        "0: the rest of the context, as before)")
    p.add_argument("--generation-config", "--generation_config", dest="generation_config", default="auto",
                   help="sampling defaults for requests that leave them unset: 'auto' (the model "
                        "directory's generation_config.json), 'none' (temperature 1, top_p 1), or a "
                        "directory or file (engine/sampling_defaults.py)")
    p.add_argument("--header-timeout", "--header_timeout", dest="header_timeout", type=float, default=10.0,
                   help="seconds a client may take to send a request's headers; then the connection is "
                        "closed (default 10; server/http_protocol.py)")
    p.add_argument("--http", dest="http", default="auto", choices=["auto", "httptools", "h11"],
                   help="HTTP parser, as uvicorn's --http: auto (httptools, a C parser, when installed; "
                        "else h11, pure Python)")
    p.add_argument("--loop", dest="loop", default="auto", choices=["auto", "uvloop", "asyncio"],
                   help="event loop, as uvicorn's --loop: auto (uvloop when installed; else asyncio)")
    p.add_argument("--log-level", "--log_level", dest="log_level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run)


def sampling_defaults_of(args) -> dict:
    """--generation-config: 'auto' reads the served model's directory (the shipped model's when
    --model is not given; a preset has none), 'none' nothing, anything else that path."""
    from pathlib import Path

    from cedlm.engine.loader import DEFAULT_MODEL
    from cedlm.engine.sampling_defaults import read
    choice = getattr(args, "generation_config", "auto")
    if choice == "none":
        return {}
    if choice == "auto":
        return read(DEFAULT_MODEL if args.model is None else args.model)
    if not Path(choice).exists():
        raise ValueError(f"generation_config: {choice!r} is neither 'auto', 'none' nor an existing path")
    return read(choice)


def build_app(args, background_compile: bool = False, on_engine_failure=None):
    """The server's FastAPI app over a freshly loaded model. background_compile: the compiled
    decode step's graphs are built in a background thread while the engine serves on the same
    step uncompiled (`Engine.compile_in_background`); else they are compiled here, before the
    app is returned."""
    from cedlm.engine.llm import LLM
    from cedlm.server.aliases import AliasTable, default_served_name
    from cedlm.server.app import api_key_from_env, create_app
    from cedlm.engine.args import EngineArgs
    from cedlm.engine.sampling_defaults import describe
    llm = LLM(model=args.model, args=EngineArgs.from_cli(args))
    import logging

    from cedlm.util import describe_device
    logging.getLogger("cedlm.server").info("device: %s", describe_device(llm.device))
    if background_compile:
        llm.engine.compile_in_background()    # logged with progress; cached on disk
    else:
        llm.engine.warm_up()                  # compile before serving (logged; cached on disk)
    table = AliasTable.from_cli(args.served_model_name or default_served_name(args.model), args.alias)
    defaults = sampling_defaults_of(args)
    logging.getLogger("cedlm.server").info("sampling defaults: %s", describe(defaults))
    return create_app(llm, aliases=table, sampling_defaults=defaults, api_key=api_key_from_env(args.api_key),
                      max_waiting=args.max_waiting,
                      queue_timeout=args.queue_timeout if args.queue_timeout > 0 else None,
                      retry_after=args.retry_after, max_body_bytes=getattr(args, "max_body_bytes", 8 << 20),
                      max_prompt_tokens=getattr(args, "max_prompt_tokens", None),
                      default_max_tokens=getattr(args, "default_max_tokens", 256),
                      allow_remote_images=getattr(args, "allow_remote_images", False),
                      metrics_public=getattr(args, "metrics_public", False),
                      exit_on_engine_failure=on_engine_failure or True)


def configure_logging(level: str) -> None:
    """The server's own lines (logger "cedlm": request ids, the per-request and throughput lines of
    server/tracing.py) on stderr at `level`, formatted like uvicorn's; uvicorn configures its own."""
    import logging
    logger = logging.getLogger("cedlm")
    if not any(getattr(h, "cedlm_serve", False) for h in logger.handlers):
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(levelname)s:     %(asctime)s %(name)s: %(message)s"))
        h.cedlm_serve = True
        logger.addHandler(h)
        logger.propagate = False
    logger.setLevel(level.upper())


def _model_error(model: str | None) -> str | None:
    """A --model that names neither a preset nor an existing path, said before any work."""
    if model is None:
        return None
    from pathlib import Path

    from cedlm.config.presets import PRESETS
    if model in PRESETS or Path(model).exists():
        return None
    return f"model: {model!r} is neither a checkpoint directory nor a preset ({sorted(PRESETS)})"


def _server_libs_error(args) -> str | None:
    """--http / --loop naming a library that is not installed: the error line, else None."""
    import importlib.util

    from cedlm.server.http_protocol import resolve_http
    try:
        resolve_http(getattr(args, "http", "auto"))
    except ValueError as e:
        return str(e)
    if getattr(args, "loop", "auto") == "uvloop" and importlib.util.find_spec("uvloop") is None:
        return "loop: uvloop is not installed (pip install uvloop)"
    return None


def run(args) -> int:
    """Bind the port, then listen at once: /health answers 503 "loading" while the model loads
    (server/startup.py), then the server serves on the uncompiled decode step while the compiled
    graphs are built in the background, switching to them at a step boundary."""
    import logging
    import os

    from cedlm.server.startup import BindError, StartingApp, bind

    def fail(msg: str) -> int:
        print(f"cedlm serve: error: {msg}", file=sys.stderr, flush=True)
        return 2
    bad = _model_error(args.model) or _server_libs_error(args)
    if bad:
        return fail(bad)
    if getattr(args, "device", None) not in (None, "auto"):     # an explicit device: checked first
        from cedlm.util import resolve_device
        try:
            resolve_device(args.device, "device")
        except ValueError as e:
            return fail(str(e))
    from cedlm.util import collect_fully_less_often
    collect_fully_less_often()
    try:
        sock = bind(args.host, args.port)        # before any work: a busy port is one line
    except BindError as e:
        return fail(str(e))
    # (server/app.py's api_key_from_env, without importing the app before the port listens)
    warning = exposure_warning(args.host, args.api_key or os.environ.get("CEDLM_API_KEY") or None)
    if warning:
        print(warning, file=sys.stderr, flush=True)
        logging.getLogger("cedlm.server").warning(warning)
    configure_logging(args.log_level)
    print(f"cedlm serve: listening on http://{args.host}:{args.port}/v1 (/health says \"loading\" "
          f"until the model is loaded)", flush=True)
    import uvicorn

    from cedlm.server.http_protocol import http_protocol
    failure: list[str] = []
    engine_down: list[str] = []         # why the engine failed for good (exit status 1)

    def build():                        # in a thread, while /health answers "loading"
        import torch
        torch.set_num_threads(args.num_threads)
        app = build_app(args, background_compile=True, on_engine_failure=engine_failed)
        from cedlm.util import describe_device, freeze_heap
        freeze_heap()                   # the model and the libraries: out of every full collection
        table = app.state.aliases
        print(f"cedlm serve: {table.served_name} (names: {', '.join(table.describe())}) ready on "
              f"http://{args.host}:{args.port}/v1, device {describe_device(app.state.engine.device)}, "
              f"decode step {app.state.engine.decoder.active_mode}", flush=True)
        return app

    def on_failed(msg: str) -> None:
        failure.append(msg)
        server.should_exit = True

    def engine_failed(reason: str) -> None:
        # a clean shutdown, then exit status 1 below (a SIGTERM to ourselves would end the
        # process with uvicorn's re-raised signal, status 143, before that)
        logging.getLogger("cedlm.server").critical("the engine has failed (%s): shutting the server down", reason)
        engine_down.append(reason)
        server.should_exit = True
    starting = StartingApp(build, on_failed)
    config = uvicorn.Config(starting, log_level=args.log_level, lifespan="on", loop=args.loop,
                            http=http_protocol(args.header_timeout, args.http))
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:                   # Ctrl-C: uvicorn shut down cleanly, then re-raised it
        pass
    finally:
        sock.close()
    if failure:
        return fail(failure[0])
    if engine_down:                               # the engine failed for good and shut the server down
        # (said by the callback itself: a failure right after the load, before `starting.app` is
        # set, is known here too)
        print(f"cedlm serve: the engine failed: {engine_down[0]}", file=sys.stderr, flush=True)
        return 1
    return 0
