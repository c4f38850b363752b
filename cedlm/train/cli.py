"""`cedlm train STAGE` (wired into cedlm/cli.py): one sub-command per training stage.

    cedlm train pretrain --preset small --out runs/small ...      pretraining (cedlm.train.train)
    cedlm train chat|indexer|dspark|vision --init MODEL --out RUN  a stage on top of a trained model

Each stage module (`STAGES`) has `add_arguments(parser)` (its flags, on a parser of its own) and
`run(args) -> exit code`; `run` gets a namespace of that stage's flags only. A stage module that is
not part of this build is skipped. The stages share one loop, `cedlm.train.runner`.

The pre-stage spelling `cedlm train --preset small ...` (flags straight after `train`) still means
pretraining, with a deprecation line on stderr (`legacy_argv`).
"""
from __future__ import annotations

import argparse
import importlib
import sys

# stage name -> (module with `add_arguments(p)` and `run(args)`, one-line help)
STAGES = {
    "pretrain": ("cedlm.train.train", "pretrain a model from scratch on a prepared corpus"),
    "chat": ("cedlm.train.chat", "supervised chat stage: V4.1 chat encoding, short answers, end of turn"),
    "indexer": ("cedlm.train.indexer", "distil the lightning indexer; continue training on long "
                "sequences with retrieval items"),
    "dspark": ("cedlm.train.dspark", "train the DSpark drafter (mtp.*) of a model, target frozen"),
    "vision": ("cedlm.train.vision", "train a small ViT + aligner on top of a frozen text model"),
}


def legacy_argv(argv: list[str]) -> list[str]:
    """`train -FLAG ...` (flags straight after `train`, the pre-stage spelling of pretraining) ->
    `train pretrain -FLAG ...`, with a deprecation line on stderr; anything else unchanged."""
    if len(argv) >= 2 and argv[0] == "train" and argv[1].startswith("-") and argv[1] not in ("-h", "--help"):
        print("cedlm train: deprecated spelling; use `cedlm train pretrain ...`", file=sys.stderr)
        return ["train", "pretrain", *argv[1:]]
    return argv


class StageParser(argparse.ArgumentParser):
    """A stage's parser: remembers the dests of the flags added to it (`own_dests`), so that the
    stage's `run` gets those and nothing of the parsers above it."""

    def __init__(self, *args, **kw):
        self.own_dests: list[str] = []
        super().__init__(*args, **kw)

    def add_argument(self, *args, **kw):
        action = super().add_argument(*args, **kw)
        if action.default is not argparse.SUPPRESS:       # not --help
            self.own_dests.append(action.dest)
        return action


def _runner(run, dests: list[str]):
    """`func` of a stage's parser: its `run` on a namespace of the stage's own flags."""
    def func(args: argparse.Namespace) -> int:
        return run(argparse.Namespace(**{d: getattr(args, d) for d in dests}))
    return func


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="pretrain a model, or run a training stage on top of one",
                              description=__doc__, allow_abbrev=False,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    stages = p.add_subparsers(dest="stage", metavar="STAGE", required=True, title="stages",
                              parser_class=StageParser)
    for name, (mod, help_) in STAGES.items():
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name == mod:
                continue
            raise
        sp = stages.add_parser(name, help=help_, description=module.__doc__, allow_abbrev=False,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sp)
        sp.set_defaults(func=_runner(module.run, sp.own_dests))
    return p
