"""`cedlm train` sub-command hook (wired into cedlm/cli.py)."""
from __future__ import annotations

import argparse


def _run(args: argparse.Namespace) -> int:
    from cedlm.train.train import run
    return run(args)


def add_parser(subparsers) -> argparse.ArgumentParser:
    from cedlm.train.train import __doc__ as doc, add_arguments
    p = subparsers.add_parser("train", help="pretrain a model on a prepared corpus",
                              description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=_run)
    return p
