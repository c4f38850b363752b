"""`cedlm` command line: each sub-command lives beside its subsystem and registers itself here."""
from __future__ import annotations

import argparse
import importlib
import sys

# (module, attribute) of each `add_parser(subparsers)` hook; optional ones may be absent.
COMMANDS = [
    ("cedlm.server.cli", "add_parser"),
    ("cedlm.engine.cli", "add_parser"),
    ("cedlm.plan", "add_parser"),
    ("cedlm.data.cli", "add_parser"),
    ("cedlm.train.cli", "add_parser"),
    ("cedlm.train.export", "add_parser"),
    ("cedlm.eval.cli", "add_parser"),
    ("cedlm.bench.cli", "add_parser"),
]


class CommandParser(argparse.ArgumentParser):
    """A sub-command's parser: an argument it does not know is reported with this sub-command's
    usage (`cedlm serve: error: unrecognized arguments: --bogus`). Plain argparse leaves them to the
    top-level parser, which prints `cedlm`'s usage and no hint of the sub-command's flags."""

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras


def build_parser() -> argparse.ArgumentParser:
    from cedlm import __version__
    parser = argparse.ArgumentParser(prog="cedlm", description=__doc__)
    parser.add_argument("--version", action="version", version=f"cedlm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)
    for mod, attr in COMMANDS:
        try:
            hook = getattr(importlib.import_module(mod), attr)
        except ModuleNotFoundError as e:
            if e.name == mod:          # that subsystem is not part of this build
                continue
            raise
        hook(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:                  # `cedlm train --preset ...`: the old spelling
        try:
            from cedlm.train.cli import legacy_argv
        except ModuleNotFoundError:
            pass
        else:
            argv = legacy_argv(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    rc = args.func(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
