"""Export a trained checkpoint as a lean model directory (BF16 weights, config, tokenizer).

    cedlm export runs/small-ced cedlm/assets/model             (= python -m cedlm.train.export)
    cedlm export runs/small-ced out/official --format official [--shard-size 5G]

`--format official` writes the official DeepSeek-V4.1 layout instead (FP8 block / packed-FP4
experts / FP8 Engram tables, sharded safetensors with an index, `quantization_config`; see
`cedlm.official.export`), which the serving engines for V4.1 read and `load_model` reads back.

BF16 is the official checkpoint's dtype for these tensors; the loader upcasts to fp32. Training
state (optimizer, RNG) is left behind; `training_args.json` and a summary of the run are kept
(`summary.json`: the `summary` argument, else the one in the checkpoint or run directory).
Both formats also get the HF-style text files, generated from that metadata
(`cedlm.train.model_card`): `generation_config.json`, the model card `README.md`, and the
tokenizer's `tokenizer_config.json` with its chat template.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from cedlm.checkpoint import load_model, resolve_checkpoint
from cedlm.train.model_card import model_files, write_model_files
from cedlm.util import atomic_directory


def run_metadata(ckpt: Path, summary: dict | None = None) -> tuple[dict | None, dict | None]:
    """(summary, training_args) of a checkpoint: `summary` if given, else summary.json in the
    checkpoint directory or the run directory above it."""
    if summary is None:
        for d in (ckpt, ckpt.parent):
            if (d / "summary.json").exists():
                summary = json.loads((d / "summary.json").read_text("utf-8"))
                break
    args = ckpt / "training_args.json"
    return summary, (json.loads(args.read_text("utf-8")) if args.exists() else None)


# Component files of a model directory: tensors whose names start with one of the prefixes go to
# `<part>.safetensors`, everything else to `model.safetensors` (`cedlm.checkpoint.read_weights`
# merges them back). A stage trained on top of a shipped model then adds a file of its own.
PARTS = {"mtp": ("mtp.",), "vision": ("vision.", "aligner.", "image_")}


def split_parts(state: dict) -> dict[str, dict]:
    out: dict[str, dict] = {"model": {}}
    for k, v in state.items():
        part = next((p for p, pre in PARTS.items() if k.startswith(pre)), "model")
        out.setdefault(part, {})[k] = v
    return out


def export_model(src: str | Path, dst: str | Path, dtype: torch.dtype = torch.bfloat16,
                 summary: dict | None = None) -> Path:
    ckpt = resolve_checkpoint(src)
    model, tok = load_model(ckpt)
    summary, training_args = run_metadata(ckpt, summary)
    dst = Path(dst)
    with atomic_directory(dst) as tmp:
        model.cfg.save_json(tmp / "config.json")
        state = {k: (v.to(dtype) if v.is_floating_point() and k.endswith("weight") else v).contiguous()
                 for k, v in model.state_dict().items()}
        for part, tensors in split_parts(state).items():
            save_file(tensors, str(tmp / f"{part}.safetensors"), metadata={"format": "pt"})
        tok.save(tmp)
        if (ckpt / "training_args.json").exists():
            shutil.copy(ckpt / "training_args.json", tmp / "training_args.json")
        if summary:
            (tmp / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        write_model_files(tmp, model.cfg, tok, summary, training_args, weights="bf16")
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
    p.add_argument("--allow-cedlm-fields", action="store_true",
                   help="official format: export even when an engine following the official config "
                        "would read the model differently (Engram map, RoPE precision, tokenizer: "
                        "refused by default, the error says what would change)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.allow_cedlm_fields and args.format != "official":
        print("error: --allow-cedlm-fields: only with --format official", file=sys.stderr)
        return 2
    if args.format == "official":
        from cedlm.official import export_official
        from cedlm.official.export import DEFAULT_SHARD_BYTES, NotOfficialError
        ckpt = resolve_checkpoint(args.src)
        model, tok = load_model(ckpt)
        summary, training_args = run_metadata(ckpt)
        extra = model_files(model.cfg, tok, summary, training_args, weights="official")
        for name, meta in (("training_args.json", training_args), ("summary.json", summary)):
            if meta:
                extra[name] = json.dumps(meta, indent=2) + "\n"
        try:
            rep = export_official(model, args.dst, tok, shard_bytes=args.shard_size or DEFAULT_SHARD_BYTES,
                                  extra_files=extra, allow_cedlm_fields=args.allow_cedlm_fields)
        except NotOfficialError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
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
