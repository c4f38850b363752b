"""What the training stages (`cedlm train STAGE`, see cedlm/train/cli.py) share."""
from __future__ import annotations

import argparse


def flag_adder(p: argparse.ArgumentParser, prefix: str, metavars: bool = True):
    """-> `a(flag, **kw)`: adds `flag` to the stage's parser `p` with dest `prefix + name`.

    A stage's options share one namespace with the pretraining flags (the `train` parser is the
    stage parser's parent), so each stage keeps its own dests (`chat_steps`, `dspark_steps` ...);
    value options get their name as metavar unless given one."""
    def a(flag: str, **kw):
        name = flag.lstrip("-").replace("-", "_")
        kw.setdefault("dest", prefix + name)
        if metavars and kw.get("action") not in ("store_true", "store_false"):
            kw.setdefault("metavar", name.upper())
        return p.add_argument(flag, **kw)
    return a
