"""`cedlm eval fidelity` (one configuration against the reference) and `cedlm eval ablate` (the
fidelity table, FIDELITY.md). See `cedlm.eval.fidelity` and `cedlm.eval.ablate`.

    cedlm eval fidelity --set main_kv_format=kv_fp4 --json          # the shipped model
    cedlm eval fidelity --retrieval-samples 16384:2 --retrieval-kinds passkey --indexer-init
    cedlm eval ablate --model cedlm/assets/model --out docs/fidelity --report FIDELITY.md \\
        --lengths 1024,2048 --samples 16 --retrieval-samples 256:8,1024:4,4096:2
    cedlm eval ablate --quick --out /tmp/fid          # tiny preset, seconds (CI)
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from cedlm.data.retrieval import ALL_KINDS, KINDS

QUICK = dict(model="tiny", lengths=[128], samples=1, retrieval={128: 1}, tail=32)


class UsageError(Exception):
    pass


def _ints(s: str) -> list[int]:
    try:
        v = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {s!r}") from None
    if not v or any(x <= 0 for x in v):
        raise argparse.ArgumentTypeError(f"lengths must be positive integers: {s!r}")
    return v


def _counts(s: str) -> dict[int, int]:
    """'1024:4,4096:2' -> {1024: 4, 4096: 2}."""
    try:
        out = {int(L): int(n) for L, n in (p.split(":") for p in s.split(",") if p.strip())}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LENGTH:SAMPLES[,...], got {s!r}") from None
    if not out or any(L <= 0 or n < 0 for L, n in out.items()):
        raise argparse.ArgumentTypeError(f"lengths and sample counts must be positive: {s!r}")
    return out


def _kinds(s: str) -> tuple[str, ...]:
    """'passkey,kv' -> ('passkey', 'kv'): the retrieval item kinds, cycled through per length."""
    v = tuple(k.strip() for k in s.split(",") if k.strip())
    bad = [k for k in v if k not in ALL_KINDS]
    if not v or bad:
        raise argparse.ArgumentTypeError(f"retrieval kinds must be among {','.join(ALL_KINDS)}: {s!r}")
    return v


def _value(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def _overrides(pairs: list[str], cfg) -> dict:
    from dataclasses import fields
    known = {f.name for f in fields(cfg)}
    out = {}
    for p in pairs or []:
        k, sep, v = p.partition("=")
        if not sep:
            raise UsageError(f"--set: expected KEY=VALUE, got {p!r}")
        if k not in known:
            raise UsageError(f"--set: {k!r} is not a config field")
        out[k] = _value(v)
    return out


def _load(args):
    import numpy as np
    import torch

    from cedlm.eval.ppl import resolve_model
    from cedlm.util import describe_device, resolve_device
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device, "device")        # before loading: a ValueError naming it
    model, tok, name = resolve_model(args.model, device)
    print(f"note: device {describe_device(device)}", file=sys.stderr)
    text = Path(args.text) if args.text else Path("data/corpus/val.txt")
    if not text.exists():
        if args.text:
            raise UsageError(f"--text: no such file {text}")
        import cedlm
        text = Path(cedlm.__file__).parent / "assets" / "model" / "README.md"
        print(f"note: data/corpus/val.txt not prepared; using {text} as text", file=sys.stderr)
    tokens = np.asarray(tok.encode(text.read_text(encoding="utf-8")), dtype=np.int64)
    return model, tok, name, tokens


def _fidelity(args) -> int:
    from cedlm.config import ConfigError
    from cedlm.eval.fidelity import Measurement, Setting
    from cedlm.eval.ablate import initial_indexer
    fidelity_defaults(args)
    try:
        model, tok, name, tokens = _load(args)
        over = _overrides(args.set, model.cfg)
        setting = Setting("custom", over, prefill=args.prefill, restore=args.restore,
                          indexer_state=initial_indexer(model, args.seed) if args.indexer_init else None)
        model.cfg.replace(**over)
        meas = Measurement(model, tok, tokens, args.lengths, args.samples, list(args.retrieval_samples),
                           args.retrieval_samples, tail=args.tail, progress=not args.json,
                           kinds=args.retrieval_kinds)
        res = meas.run(setting)
    except (UsageError, ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    res["model"] = name
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"{name} [{setting.name}]: KL {res['kl']:.5f} nats  ppl {res['ppl']:.3f} "
              f"({res['d_ppl_pct']:+.2f}% vs reference {res['ref_ppl']:.3f})  top-1 {res['top1']:.3f}  "
              f"retrieval {res['retrieval']}  {res['bytes_per_token']:.0f} B/token")
    return 0


def _rerender(args) -> int:
    """--report-only: FIDELITY.md and the plots again from OUT/fidelity.json (with --notes)."""
    from cedlm.checkpoint import resolve_checkpoint
    from cedlm.config import ModelConfig
    from cedlm.eval.ablate import NOT_MEASURED
    from cedlm.eval.fidelity_report import write_report
    try:
        data = json.loads((Path(args.out) / "fidelity.json").read_text())
        from cedlm.config.presets import PRESETS
        name = data["meta"]["model"]
        cfg = (ModelConfig.preset(name) if name in PRESETS else
               ModelConfig.from_json(resolve_checkpoint(name) / "config.json"))
        notes = Path(args.notes).read_text(encoding="utf-8") if args.notes else ""
    except (FileNotFoundError, KeyError, ValueError) as e:
        print(f"error: --report-only: {e}", file=sys.stderr)
        return 2
    print(write_report(Path(args.out), data["meta"], data["rows"], cfg, NOT_MEASURED,
                       Path(args.report) if args.report else None, "\n" + notes if notes else ""))
    return 0


def _ablate(args) -> int:
    from cedlm.config import ConfigError
    from cedlm.eval.ablate import run_ablation
    if args.report_only:
        return _rerender(args)
    if args.quick:
        args.model = args.model or QUICK["model"]
        args.lengths = args.lengths or QUICK["lengths"]
        args.samples = args.samples or QUICK["samples"]
        args.retrieval_samples = args.retrieval_samples or QUICK["retrieval"]
        args.tail = args.tail or QUICK["tail"]
    try:
        model, tok, name, tokens = _load(args)
        command = "cedlm eval ablate " + shlex.join(sys.argv[3:]) if sys.argv[1:3] == ["eval", "ablate"] else ""
        long_rows = None if args.long_rows is None else set(args.long_rows)
        run_ablation(model, tok, tokens, Path(args.out), args.lengths or [1024], args.samples or 2,
                     sorted(args.retrieval_samples or {1024: 4, 4096: 2}),
                     args.retrieval_samples or {1024: 4, 4096: 2}, long_rows=long_rows,
                     tail=args.tail or 128, progress=True, seed=args.seed, command=command,
                     model_name=name, only=args.only,
                     report=Path(args.report) if args.report else None, long_from=args.long_from,
                     kinds=args.retrieval_kinds)
    except (UsageError, ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(Path(args.report) if args.report else Path(args.out) / "FIDELITY.md")
    return 0


def _common(q: argparse.ArgumentParser) -> None:
    q.add_argument("--model", help="checkpoint or run dir, a preset, or nothing for the shipped model")
    q.add_argument("--text", help="UTF-8 text for the samples (default data/corpus/val.txt)")
    q.add_argument("--lengths", type=_ints, help="context lengths of the KL / perplexity samples")
    q.add_argument("--samples", type=int, help="text samples per length")
    q.add_argument("--retrieval-samples", type=_counts, metavar="L:N,...",
                   help="retrieval items per context length, e.g. 1024:4,4096:2,16384:1")
    q.add_argument("--retrieval-kinds", type=_kinds, default=KINDS, metavar="KIND,...",
                   help=f"retrieval item kinds, cycled through (default {','.join(KINDS)}; "
                        "varied: the held-out half of the varied items' wordings, words and names)")
    q.add_argument("--tail", type=int, help="scored tokens at the end of each text sample (default 128)")
    q.add_argument("--threads", type=int, help="torch threads")
    q.add_argument("--device", default=None, help="auto (default: CUDA when available, else the CPU), "
                   "cpu, cuda or cuda:N")
    q.add_argument("--seed", type=int, default=1337, help="seed of the indexer-at-initialisation build")


def add_parsers(sub) -> None:
    f = sub.add_parser("fidelity", help="KL / perplexity / top-1 / retrieval of one configuration "
                       "against the reference (BF16 KV, full prefill, dense selection)")
    _common(f)
    f.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="config field of the measured configuration (repeatable), e.g. main_kv_format=kv_fp4")
    f.add_argument("--prefill", default="full", choices=("full", "exact", "bounded"))
    f.add_argument("--restore", choices=("exact", "bounded"), help="restore by replay after the prefill")
    f.add_argument("--indexer-init", action="store_true", help="the indexer's weights at initialisation")
    f.add_argument("--json", action="store_true", help="print a JSON object")
    f.set_defaults(func=_fidelity, lengths=None)
    a = sub.add_parser("ablate", help="the fidelity table, one switch at a time (FIDELITY.md + plots)")
    _common(a)
    a.add_argument("--out", default="runs/fidelity", help="directory for fidelity.json and the plots")
    a.add_argument("--report", help="where FIDELITY.md goes (default OUT/FIDELITY.md)")
    a.add_argument("--quick", action="store_true", help="tiny preset, short contexts (CI)")
    a.add_argument("--long-rows", nargs="*", help="names of the only rows measured at retrieval lengths "
                   ">= --long-from (default: every row at every length)")
    a.add_argument("--long-from", type=int, default=2048, help="see --long-rows (default 2048)")
    a.add_argument("--report-only", action="store_true", help="measure nothing: rewrite FIDELITY.md "
                   "and the plots from OUT/fidelity.json")
    a.add_argument("--notes", help="markdown file appended to FIDELITY.md (with --report-only)")
    a.add_argument("--only", nargs="*", help="measure only rows whose name contains one of these")
    a.set_defaults(func=_ablate)


def fidelity_defaults(args) -> None:
    """Defaults of `cedlm eval fidelity` that depend on nothing else."""
    args.lengths = args.lengths or [1024]
    args.samples = args.samples or 2
    args.retrieval_samples = args.retrieval_samples or {1024: 4}
    args.tail = args.tail or 128
