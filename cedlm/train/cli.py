"""`cedlm train` sub-command hook (wired into cedlm/cli.py).

    cedlm train --preset small --out runs/small ...        pretraining (cedlm.train.train)
    cedlm train STAGE --init MODEL_DIR --out RUN ...        a stage on top of a trained model

Each stage lives in its own module (`STAGES`) with an `add_parser(subparsers)` hook that adds its
sub-parser and sets `func`; a stage module that is not part of this build is skipped. Pretraining
flags belong to pretraining only: giving one together with a stage is an error that names it,
never a flag silently ignored.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# stage name -> module with `add_parser(subparsers)`
STAGES = {
    "chat": "cedlm.train.chat",          # supervised chat stage (end-of-turn, V4.1 chat encoding)
    "indexer": "cedlm.train.indexer",    # lightning-indexer distillation / long-context stage
    "dspark": "cedlm.train.dspark",      # DSpark drafter (mtp.*), target frozen
    "vision": "cedlm.train.vision",      # ViT + aligner on top of a text model
}


def _run(args: argparse.Namespace) -> int:
    from cedlm.train.train import run
    return run(args)


def _stage_conflicts(args: argparse.Namespace, pretrain_dests: list[str]) -> list[str]:
    """Pretraining flags given on a stage's command line (their defaults are None)."""
    return [d for d in pretrain_dests if getattr(args, d, None) is not None]


def add_parser(subparsers) -> argparse.ArgumentParser:
    from cedlm.train.train import __doc__ as doc, add_arguments
    p = subparsers.add_parser("train", help="pretrain a model, or run a training stage on top of one",
                              description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    before = {a.dest for a in p._actions}
    add_arguments(p)
    pretrain_dests = [a.dest for a in p._actions if a.dest not in before]
    p.set_defaults(func=_run)
    stages = p.add_subparsers(dest="stage", metavar="STAGE", required=False,
                              title="stages (run on top of a trained model)")
    for name, mod in STAGES.items():
        try:
            hook = importlib.import_module(mod).add_parser
        except ModuleNotFoundError as e:
            if e.name == mod:
                continue
            raise
        sp = hook(stages)
        stage_func = sp.get_default("func")

        def checked(args, _f=stage_func, _name=name):
            bad = _stage_conflicts(args, pretrain_dests)
            if bad:
                flags = ", ".join("--" + d.replace("_", "-") for d in bad)
                print(f"error: {flags}: pretraining flag(s) do not apply to `cedlm train {_name}` "
                      f"(put the stage's own flags after its name; see cedlm train {_name} --help)",
                      file=sys.stderr)
                return 2
            return _f(args)
        sp.set_defaults(func=checked)
    return p
