"""Official-layout checkpoints: load time and memory of the shipped small model, and the choice
between dequantising at load (what cedlm.official does) and keeping weights quantised.

    .venv/bin/python bench/scripts/official_checkpoint.py [--repeats 3] [--out DIR]

1. exports cedlm/assets/model (BF16, the `small` preset) to the official layout (FP8 blocks,
   packed-FP4 experts, FP8 Engram tables, sharded + index) with `cedlm export --format official`;
2. loads each directory in a fresh process (median of --repeats): wall time of `load_model`,
   resident memory after the load minus before it (VmRSS), and peak (VmHWM);
3. prices the alternative: the bytes the quantised weights would keep resident, against the time
   a pure-torch forward would spend dequantising every weight once per call (no fused kernels on
   CPU), next to the forward time itself (prefill of 256 tokens, one decode step);
4. the export's effect on the model: logits and NLL on a fixed text, BF16 vs official;
5. a header-only V4.1-Flash checkpoint (96,085 tensor headers, no data): its memory account and
   how fast `load_model` refuses it.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "cedlm" / "assets" / "model"
TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
        "must be in want of a wife. However little known the feelings or views of such a man may be "
        "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
        "surrounding families, that he is considered the rightful property of some one or other of "
        "their daughters. And God said, Let there be light: and there was light.")

_CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(1)
from cedlm.checkpoint import load_model
def status():
    d = {}
    for line in open('/proc/self/status'):
        k, v = line.split(':', 1)
        if k in ('VmRSS', 'VmHWM'):
            d[k] = int(v.split()[0]) * 1024
    return d
kw = json.loads(sys.argv[2])
before = status()
t = time.perf_counter()
if kw:
    from cedlm.official import load_official_model
    m, _ = load_official_model(sys.argv[1], **kw)
else:
    m, tok = load_model(sys.argv[1])
dt = time.perf_counter() - t
after = status()
print(json.dumps({"seconds": dt, "rss_delta": after['VmRSS'] - before['VmRSS'],
                  "rss": after['VmRSS'], "hwm": after['VmHWM'], "rss_before": before['VmRSS']}))
"""


def child(path: Path, repeats: int, **kw) -> dict:
    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", _CHILD, str(path), json.dumps(kw)],
                             capture_output=True, text=True, check=True, cwd=ROOT)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    med["seconds_all"] = [round(r["seconds"], 3) for r in runs]
    return med


def keep_quantised_price(official: Path) -> dict:
    import torch
    from cedlm.checkpoint import load_model
    from cedlm.official import load as OL
    from cedlm.official import layout as L
    torch.set_num_threads(1)
    infos, files = OL.read_tensor_infos(official)
    model, tok = load_model(official)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    entries, _ = OL.plan_load(official, infos, {"weight_block_size": [32, 32]}, files, expected)
    from contextlib import ExitStack
    quant = [e for e in entries if e.fmt != "plain"]
    quant_bytes = sum(e.weight.nbytes + e.scale.nbytes for e in quant)
    f32_bytes = sum(4 * math.prod(e.shape) for e in quant)
    # Pre-read the stored tensors (resident), then time dequantising all of them once.
    with ExitStack() as st:
        r = OL.ShardReader(st)
        held = [(e, r.slice(e.weight, 0, e.weight.shape[0]), r.slice(e.scale, 0, e.scale.shape[0]))
                for e in quant]
    from cedlm.official.dequant import dequant_fp4, dequant_fp8_block

    def dequant_all(skip_engram: bool):
        for e, w, s in held:
            if skip_engram and e.fmt == L.FP8_ROWS:
                continue                 # only the looked-up rows would be dequantised
            if e.fmt == L.FP4_EXPERT:
                dequant_fp4(w, s, k=e.shape[1])
            elif e.fmt == L.FP8_ROWS:
                dequant_fp8_block(w, s, (1, 32))
            else:
                dequant_fp8_block(w, s, (32, 32))

    def best(fn, n=5):
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return min(ts)

    ids = torch.tensor(tok.encode(TEXT * 3)[:256])
    with torch.no_grad():
        pre = best(lambda: model.prefill(ids, model.new_state(), mode="full"), 3)
        st = model.new_state()
        model.prefill(ids, st, mode="full")
        dec = best(lambda: model.decode([5], [st]), 5)
    return {"quantised_tensors": len(quant), "quantised_bytes": quant_bytes, "float32_bytes": f32_bytes,
            "dequant_all_s": best(lambda: dequant_all(False)),
            "dequant_all_but_engram_s": best(lambda: dequant_all(True)),
            "forward_prefill_256_s": pre, "forward_decode_1_s": dec}


def quality(bf16: Path, official: Path) -> dict:
    import torch
    from cedlm.checkpoint import load_model
    torch.set_num_threads(1)
    a, tok = load_model(bf16)
    b, _ = load_model(official)
    ids = torch.tensor([tok.encode(TEXT)])
    with torch.no_grad():
        la, lb = a(ids), b(ids)

    def nll(lg):
        return torch.nn.functional.cross_entropy(lg[0, :-1], ids[0, 1:]).item()
    return {"tokens": ids.shape[1], "max_abs_logit_diff": (la - lb).abs().max().item(),
            "max_abs_logit": la.abs().max().item(),
            "rel_l2": ((la - lb).norm() / la.norm()).item(),
            "argmax_agreement": (la.argmax(-1) == lb.argmax(-1)).float().mean().item(),
            "nll_bf16": nll(la), "nll_official": nll(lb)}


def header_only_full(path: Path) -> dict:
    """A V4.1-Flash checkpoint of headers only: 96,085 tensors, official dtypes and shapes."""
    import numpy as np
    from cedlm.config import ModelConfig
    from cedlm.config.params import param_inventory
    from cedlm.official import layout as L
    from cedlm.official.dequant import block_scale_shape, fp4_packed_shape, fp4_scale_shape
    cfg = ModelConfig.preset("deepseek-v4.1-flash")
    names = [(t.name, tuple(t.shape)) for part in ("main", "dspark", "vision")
             for t in param_inventory(cfg, part)]
    for pre, n, k in [("layers", cfg.n_layers, cfg.n_routed_experts),
                      ("mtp", cfg.num_nextn_predict_layers, cfg.dspark_n_routed_experts)]:
        names += [(f"{pre}.{i}.ffn.gate.{b}", (k,)) for i in range(n) for b in ("bias", "bias_vl")]
    header, off = {}, 0

    def add(name, dtype, shape, itemsize=1):
        nonlocal off
        nb = int(np.prod(shape)) * itemsize
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + nb]}
        off += nb
    for name, shape in names:
        fmt = L.storage_format(name)
        if fmt == L.FP4_EXPERT:
            add(name, "I8", fp4_packed_shape(shape))
            add(L.scale_name(name), "F8_E8M0", fp4_scale_shape(shape))
        elif fmt in (L.FP8_BLOCK, L.FP8_ROWS):
            add(name, "F8_E4M3", shape)
            add(L.scale_name(name), "F8_E8M0", block_scale_shape(shape, (32, 32) if fmt == L.FP8_BLOCK
                                                                 else (1, 32)))
        else:
            add(name, "F32" if fmt == L.F32 else "BF16", shape, 4 if fmt == L.F32 else 2)
    path.mkdir(parents=True, exist_ok=True)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)   # no data
    conf = json.loads((ROOT / "cedlm/config/official/deepseek-v4.1-flash.config.json").read_text())
    (path / "config.json").write_text(json.dumps(conf))
    from cedlm.official import checkpoint_memory, CheckpointTooLargeError
    from cedlm.checkpoint import load_model
    acc = checkpoint_memory(path)
    t = time.perf_counter()
    try:
        load_model(path)
        msg = "loaded?!"
    except CheckpointTooLargeError as e:
        msg = str(e)
    return {"tensors": acc.tensors, "disk_gib": acc.disk_bytes / 2 ** 30,
            "float32_gib": acc.ram_bytes / 2 ** 30, "engram_float32_gib": acc.engram_bytes / 2 ** 30,
            "refused_in_s": time.perf_counter() - t, "message": msg, "describe": acc.describe()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cedlm-official-"))
    official = work / "small-official"
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "cedlm.train.export", str(SRC), str(official),
                    "--format", "official", "--allow-cedlm-fields"], check=True, cwd=ROOT)
    res = {"export_s": time.perf_counter() - t,
           "disk_bf16": sum(p.stat().st_size for p in SRC.glob("*.safetensors")),
           "disk_official": sum(p.stat().st_size for p in official.glob("*.safetensors"))}
    res["load_bf16"] = child(SRC, args.repeats)
    res["load_official"] = child(official, args.repeats)
    res["load_official_engram_mmap"] = child(official, args.repeats, engram_mmap=str(work / "engram"))
    res["keep_quantised"] = keep_quantised_price(official)
    res["quality"] = quality(SRC, official)
    res["full_size_header_only"] = header_only_full(work / "v41-headers")
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "official_checkpoint.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
