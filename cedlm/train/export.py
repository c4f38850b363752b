"""Export a trained checkpoint as a lean model directory (BF16 weights, config, tokenizer).

    cedlm export runs/small-ced cedlm/assets/model             (= python -m cedlm.train.export)
    cedlm export runs/small-ced out/official --format official [--shard-size 5G]

`--format official` writes the official DeepSeek-V4.1 layout instead (FP8 block / packed-FP4
experts / FP8 Engram tables, sharded safetensors with an index, `quantization_config`; see
`cedlm.official.export`), which the serving engines for V4.1 read and `load_model` reads back.

BF16 is the official checkpoint's dtype for these tensors; the loader upcasts to fp32. Training
state (optimizer, RNG) is left behind; `training_args.json` and a summary of the run are kept.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from cedlm.checkpoint import load_model, resolve_checkpoint


def export_model(src: str | Path, dst: str | Path, dtype: torch.dtype = torch.bfloat16,
                 summary: dict | None = None) -> Path:
    ckpt = resolve_checkpoint(src)
    model, tok = load_model(ckpt)
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}.tmp-"))
    try:
        model.cfg.save_json(tmp / "config.json")
        state = {k: (v.to(dtype) if v.is_floating_point() and k.endswith("weight") else v).contiguous()
                 for k, v in model.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tok.save(tmp)
        if (ckpt / "training_args.json").exists():
            shutil.copy(ckpt / "training_args.json", tmp / "training_args.json")
        if summary:
            (tmp / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        tmp.chmod(0o755)
        if dst.exists():
            shutil.rmtree(dst)
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _size(s: str) -> int:
    """Bytes; K/M/G suffixes are powers of 1024 (e.g. 5G)."""
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(s[-1:].lower(), 1)
    try:
        v = int(float(s[:-1] if mult > 1 else s) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {s!r} (e.g. 5G, 512M)") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {s!r}")
    return v


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="RUN_OR_CHECKPOINT", help="a run or checkpoint directory")
    p.add_argument("dst", metavar="OUT_DIR", help="the directory to write (replaced if present)")
    p.add_argument("--format", choices=("bf16", "official"), default="bf16",
                   help="bf16: cedlm's lean directory (default); official: the DeepSeek-V4.1 "
                        "quantised, sharded layout")
    p.add_argument("--shard-size", type=_size, default=None, metavar="BYTES",
                   help="official format: largest shard (default 5G)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.format == "official":
        from cedlm.official import export_official
        from cedlm.official.export import DEFAULT_SHARD_BYTES
        model, tok = load_model(resolve_checkpoint(args.src))
        rep = export_official(model, args.dst, tok, shard_bytes=args.shard_size or DEFAULT_SHARD_BYTES)
        print(rep.summary())
    else:
        print(export_model(args.src, args.dst))
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="write a model directory (lean BF16, or the official "
                              "quantised layout)", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    return p


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cedlm.train.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
