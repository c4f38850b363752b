"""`cedlm` command line: each sub-command lives beside its subsystem and registers itself here."""
from __future__ import annotations

import argparse
import importlib
import sys

# Each sub-command: (name, the module whose `add_parser(subparsers)` registers it, its one-line
# help). Only the module of the command being run is imported, so `cedlm --help` and a mistyped
# command answer without importing torch (tests/test_cli_messages.py checks that each module
# registers its commands with these help lines).
COMMANDS = [
    ("serve", "cedlm.server.cli", "serve the model over an OpenAI-compatible HTTP API"),
    ("generate", "cedlm.engine.cli", "generate a completion for one prompt"),
    ("warmup", "cedlm.engine.warmup_cli", "compile the decode step's graphs ahead of time (cached on disk)"),
    ("plan", "cedlm.plan", "KV bytes, parameter counts and sequences that fit"),
    ("data", "cedlm.data.cli", "build the training corpus"),
    ("tokenizer", "cedlm.data.cli", "train or inspect tokenizers"),
    ("train", "cedlm.train.cli", "pretrain a model, or run a training stage on top of one"),
    ("export", "cedlm.train.export", "write a model directory (lean BF16, or the official quantised layout)"),
    ("eval", "cedlm.eval.cli", "evaluate models (perplexity, bits/byte, baselines)"),
    ("bench", "cedlm.bench.cli", "run the benchmark suite (JSON, plots, BENCHMARKS.md)"),
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


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """`cedlm`'s parser. command: the sub-command being run (only its module is imported and
    registers its parser); another string (none, or an unknown name): every sub-command as a
    name and a help line, nothing imported; None: every sub-command's full parser."""
    from cedlm import __version__
    parser = argparse.ArgumentParser(prog="cedlm", description=__doc__)
    parser.add_argument("--version", action="version", version=f"cedlm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)
    mods = {mod for name, mod, _ in COMMANDS if command is None or name == command}
    if mods:
        for mod in dict.fromkeys(m for _, m, _ in COMMANDS if m in mods):     # in table order
            importlib.import_module(mod).add_parser(sub)
    else:
        for name, _, help_line in COMMANDS:
            sub.add_parser(name, help=help_line, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:                  # `cedlm train --preset ...`: the old spelling
        try:
            from cedlm.train.cli import legacy_argv
        except ModuleNotFoundError:
            pass
        else:
            argv = legacy_argv(argv)
    parser = build_parser(argv[0] if argv else "")
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    rc = args.func(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
