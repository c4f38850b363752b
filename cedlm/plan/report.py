"""The human table and the `cedlm plan` command."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cedlm.config import ConfigError, ModelConfig
from cedlm.plan.capacity import plan
from cedlm.plan.kvbytes import GIB, MIB

def _b(n) -> str:
    """Bytes with separators, plus MiB/GiB where useful."""
    if n is None:
        return "-"
    s = f"{n:,.2f}".rstrip("0").rstrip(".") if isinstance(n, float) else f"{n:,}"
    s += " B"
    if n >= GIB:
        s += f" ({n / GIB:,.2f} GiB)"
    elif n >= MIB:
        s += f" ({n / MIB:,.2f} MiB)"
    return s


def _p(n) -> str:
    if n is None:
        return "-"
    n = round(n) if isinstance(n, float) else n
    s = f"{n:,}"
    if n >= 10 ** 9:
        s += f" ({n / 1e9:,.2f} B)"
    elif n >= 10 ** 6:
        s += f" ({n / 1e6:,.2f} M)"
    return s


def _table(rows: list[tuple], header: tuple | None = None) -> list[str]:
    """Align columns: the first left, the rest right; None rows are section titles."""
    body = [r for r in rows if isinstance(r, tuple)]
    allr = ([header] if header else []) + body
    ncol = max(len(r) for r in allr)
    w = [max(len(str(r[i])) for r in allr if i < len(r)) for i in range(ncol)]
    out = []

    def line(r):
        cells = [str(r[0]).ljust(w[0])] + [str(c).rjust(w[i + 1]) for i, c in enumerate(r[1:])]
        return "  ".join(cells).rstrip()

    if header:
        out.append(line(header))
        out.append("  ".join("-" * x for x in w))
    for r in rows:
        out.append(line(r) if isinstance(r, tuple) else r)
    return out


def _layers(ls: list[int]) -> str:
    if len(ls) > 6:
        return f"{len(ls)} layers"
    return "layer" + ("s " if len(ls) > 1 else " ") + ",".join(map(str, ls))


def format_plan(p: dict) -> str:
    out = [f"cedlm plan: {p['model']} (family {p['family']})", ""]
    rows: list = ["Global KV per token (" + p.get("kv_bytes_headline", "") + ")"]
    for part in p["kv_bytes_per_token_parts"]:
        formula = (f"{part['n_layers']} x {part['entry_bytes']} B" +
                   (f" / {part['ratio']}" if part["ratio"] != 1 else ""))
        rows.append((f"  {part['part']} ({part['format']}), {_layers(part['layers'])}"
                     + (f", ratio {part['ratio']}" if p["family"] in ("ced", "v4") else ""),
                     formula, _b(part["bytes_per_token"])))
    rows.append(("  total", "", _b(p["kv_bytes_per_token"])))
    for k, v in (p.get("kv_bytes_alternatives") or {}).items():
        rows.append((f"  alternative: {k}", "", _b(v)))
    rows.append("Per-sequence fixed")
    if p.get("window_entry_bytes"):
        rows.append(("  SWA rings", f"{p['n_layers']} x {p['sliding_window']} x "
                     f"{p['window_entry_bytes']} B", _b(p["window_bytes_per_sequence"])))
        rows.append(("  DSpark/MTP rings", f"{p['dspark_layers']} x {p['sliding_window']} x "
                     f"{p['window_entry_bytes']} B", _b(p["dspark_window_bytes_per_sequence"])))
    else:
        rows.append(("  SWA rings", "(full KV model)", _b(p["window_bytes_per_sequence"])))
    rows.append(("  compressor state (max)", "", _b(p["compressor_state_bytes_per_sequence"])))
    d = p.get("dspark")
    if d:
        rows.append("DSpark drafter")
        rows.append(("  draft layers / taps", f"{d['draft_layers']} SWA-only / layers "
                     f"{','.join(map(str, d['taps']))}", ""))
        rows.append(("  block, Markov rank, experts", f"{d['block_size']} (noise id {d['noise_token_id']}), "
                     f"rank {d['markov_rank']}, top {d['num_experts_per_tok']} of {d['n_routed_experts']}", ""))
        rows.append(("  draft window", f"{d['draft_layers']} rings x {d['draft_window']} positions",
                     _b(p["dspark_window_bytes_per_sequence"])))
        if d.get("rollback_ring_bytes") is not None:
            rows.append(("  verification (transient)", f"{d['max_verify_tokens']} tokens: ring slots kept "
                         f"for rollback", _b(d["rollback_ring_bytes"])))
    rows.append("Parameters")
    rows.append(("  total (main stack incl. Engram)", "", _p(p["params_total"])))
    rows.append(("  Engram tables", "", _p(p["params_engram"])))
    rows.append(("  total without Engram tables", "", _p(p["params_total"] - p["params_engram"])))
    rows.append(("  DSpark / MTP blocks", "(separate)", _p(p["params_dspark"])))
    rows.append(("  vision", "(separate)", _p(p["params_vision"])))
    rows.append(("  active per token, prefill", "", _p(p["params_active_prefill"])))
    rows.append(("  active per token, decode", "", _p(p["params_active_decode"])))
    rows.append("Capacity")
    rows.append(("  context", "", "-" if p["context"] is None else f"{p['context']:,} tokens"))
    rows.append(("  bytes per sequence", "", _b(p["bytes_per_sequence"])))
    rows.append(("  memory", "", "-" if p["memory_gib"] is None else f"{p['memory_gib']:,g} GiB"))
    rows.append(("  max sequences", "", "-" if p["max_sequences"] is None
                 else f"{p['max_sequences']:,}"))
    out += _table(rows)
    out += ["", "Assumptions:"] + [f"  - {a}" for a in p["assumptions"]]
    ex = p.get("concurrency_example")
    if ex:
        devs = list(ex["devices"])
        out += ["", "Concurrency example (one device, KV only; sequences that fit):"]
        header = ("model", "context", "bytes/sequence",
                  *[f"{d} ({ex['devices'][d]['kv_memory_gib']:g} GiB KV)" for d in devs])
        erows = [(r["model"], f"{r['context']:,}", _b(r["bytes_per_sequence"]),
                  *[f"{r['sequences'][d]:,}" for d in devs]) for r in ex["rows"]]
        out += _table(erows, header)
        out += [f"  - {a}" for a in ex["assumptions"]]
    return "\n".join(out)


# ============================================================================ CLI
def _int_tokens(s: str) -> int:
    """An integer token count; k/K = x1024, m/M = x1048576 (e.g. 128k, 1M)."""
    mult = {"k": 1 << 10, "m": 1 << 20}.get(s[-1:].lower(), 1)
    try:
        v = int(s[:-1] if mult > 1 else s) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {s!r} (e.g. 131072, 128k, 1M)")
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {s!r}")
    return v


def _add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", metavar="PATH", help="a config.json (V4.1, V4, V3 or llama schema)")
    src.add_argument("--preset", metavar="NAME", help="a named preset (cedlm.config.presets.PRESETS)")
    src.add_argument("--checkpoint", metavar="DIR", help="a checkpoint directory (official layout "
                     "or cedlm's): also prints whether loading it fits this machine's RAM, from "
                     "the safetensors headers (no tensor is read)")
    p.add_argument("--context", type=_int_tokens, metavar="N",
                   help="tokens per sequence (e.g. 1048576, 128k, 1M)")
    p.add_argument("--memory-gib", type=float, metavar="M", help="memory for KV, in GiB")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="KV bytes, parameter counts and sequences that fit",
                              description="KV bytes, parameter counts and sequences that fit. "
                                          "Exactly one of --config / --preset / --checkpoint.")
    _add_arguments(p)
    return p


def run(args) -> int:
    acc = None
    try:
        if getattr(args, "checkpoint", None):
            from cedlm.official.load import checkpoint_memory
            ckpt = Path(args.checkpoint)
            if not (ckpt / "config.json").exists() and (ckpt / "checkpoint" / "config.json").exists():
                ckpt = ckpt / "checkpoint"                  # a run directory
            cfg, name = ModelConfig.from_json(ckpt / "config.json"), ckpt.resolve().name
            acc = checkpoint_memory(ckpt)
        elif args.config:
            cfg = ModelConfig.from_json(args.config)
            path = Path(args.config)
            name = (path.parent.name if path.name == "config.json" or path.is_dir()
                    else path.name.removesuffix(".json").removesuffix(".config"))
        else:
            cfg, name = ModelConfig.preset(args.preset), args.preset
        p = plan(cfg, context=args.context, memory_gib=args.memory_gib, name=name)
    except (ConfigError, ValueError, OSError) as e:
        raise SystemExit(f"cedlm plan: error: {e}")
    if args.json:
        if acc is not None:
            p["checkpoint"] = acc.to_dict()
        print(json.dumps(p, indent=2))
    else:
        print(format_plan(p))
        if acc is not None:
            print("\nCheckpoint memory (from the safetensors headers; weights dequantised to float32 at load):")
            print("\n".join(acc.describe()))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cedlm.plan", description="cedlm capacity planner. "
                                "Exactly one of --config / --preset / --checkpoint.")
    _add_arguments(p)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
