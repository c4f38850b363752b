"""`cedlm eval` sub-commands: `ppl` (perplexity, bits/byte of a text), `unigram` (baseline),
`fidelity` and `ablate` (compressions against a reference: `fidelity_cli.py`)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SystemExit(f"--text: no such file {path}") from None


def _print(res: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(res, indent=2))
    else:
        print(f"{res['model']}: perplexity {res['perplexity']:.3f}  bits/byte {res['bits_per_byte']:.4f}  "
              f"({res['tokens']:,} tokens, {res['bytes']:,} bytes)")


def _ppl(args: argparse.Namespace) -> int:
    import torch

    from cedlm.eval.ppl import DEFAULT_SEQ_LEN, evaluate_ppl, resolve_model, trained_seq_len
    if args.threads:
        torch.set_num_threads(args.threads)
    from cedlm.util import describe_device, resolve_device
    text = _read(args.text)
    if not text.strip():                     # before loading the model: one line, no traceback
        print(f"cedlm eval ppl: error: text: {args.text} is empty; nothing to score", file=sys.stderr)
        return 2
    try:
        device = resolve_device(args.device, "device")
    except ValueError as e:
        print(f"cedlm eval ppl: error: {e}", file=sys.stderr)
        return 2
    try:
        model, tok, name = resolve_model(args.model, device)
        print(f"cedlm eval ppl: device {describe_device(device)}", file=sys.stderr)
        seq_len = args.seq_len or trained_seq_len(name) or DEFAULT_SEQ_LEN
        res = evaluate_ppl(model, tok, text, seq_len=seq_len, batch_size=args.batch_size,
                           progress=not args.json and sys.stderr.isatty(), model_name=name)
    except (ValueError, FileNotFoundError) as e:       # e.g. too short to score, no such model
        print(f"cedlm eval ppl: error: {e}", file=sys.stderr)
        return 2
    res["seq_len"] = seq_len
    _print(res, args.json)
    return 0


def _unigram(args: argparse.Namespace) -> int:
    from cedlm.eval.ppl import unigram_baseline
    from cedlm.text.tokenizer import load_tokenizer
    tok = load_tokenizer(args.tokenizer)
    res = unigram_baseline(args.train, _read(args.text), tok, args.cache_dir)
    _print(res, args.json)
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("eval", help="evaluate models (perplexity, bits/byte, baselines)",
                              description=__doc__)
    sub = p.add_subparsers(dest="eval_command", metavar="EVAL")
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])

    q = sub.add_parser("ppl", help="perplexity and bits/byte of a UTF-8 file under a model")
    q.add_argument("--text", required=True, help="UTF-8 text file to score")
    q.add_argument("--model", help="checkpoint dir (or a run dir holding checkpoint/), a preset, "
                   "or nothing for the shipped default model")
    q.add_argument("--seq-len", type=int, help="window length (default: the trained seq_len, else 256)")
    q.add_argument("--batch-size", type=int, default=8, help="windows per forward (default 8)")
    q.add_argument("--threads", type=int, help="torch threads")
    q.add_argument("--device", default=None, help="auto (default: CUDA when available, else the CPU), "
                   "cpu, cuda or cuda:N")
    q.add_argument("--json", action="store_true", help="print a JSON object")
    q.set_defaults(func=_ppl)

    u = sub.add_parser("unigram", help="add-one unigram baseline: perplexity and bits/byte")
    u.add_argument("--train", required=True, help="text to fit the unigram on (e.g. data/corpus/train.txt)")
    u.add_argument("--text", required=True, help="UTF-8 text file to score")
    u.add_argument("--tokenizer", default="default", help="tokenizer name or dir (default: shipped BPE)")
    u.add_argument("--cache-dir", help="token cache dir for --train (default: beside it, tokens/)")
    u.add_argument("--json", action="store_true", help="print a JSON object")
    u.set_defaults(func=_unigram)

    from cedlm.eval.fidelity_cli import add_parsers
    add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cedlm")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["eval", *(argv if argv is not None else sys.argv[1:])])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
