"""GPU figure (c): the same bytes and the same logits on the device as on the CPU.

`codecs`: FP4 main KV (kv_fp4), FP4 index keys (index_fp4), FP8 window entries (window_fp8) and
V4-Flash's v4_fp8, at the dims the presets use. From one set of random inputs made on the CPU
(rows of N(0,1) at scales 1e-6 .. 1e6, plus rows of zeros, subnormals, huge values and a lone
outlier), each encoding is computed by the CPU reference (`cedlm.quant.formats.encode_reference`,
the oracle), the CPU fast path (`cedlm.kernels.encode`: the compiled module when built, else the
vectorised torch codec), the fast path on the device and the reference on the device; the bytes
must be equal. Decoding is compared the same way on the reference bytes and on random bytes
(every code, NaN and inf included): values equal (NaN where NaN) and, reported beside it, the
float32 bits equal. Inputs holding NaN and inf are encoded apart (`special`).

`logits`: one seeded model per preset, run on the CPU and, copied, on the device: the training
forward over a prompt, a prefill of it into an inference state, and decode steps fed the CPU's
greedy tokens (both devices take the same path). Max |difference| of the logits relative to the
CPU logits' std, against the golden test's bounds (`tiny` 10 %, `small` 2 %), and the share of rows
whose argmax agrees. The golden test itself (tests/test_golden.py on cuda) runs in the script's
test phase.
"""
from __future__ import annotations

import copy

import torch

from cedlm.bench.common import md_table
from cedlm.bench.gpu_common import sync

NAME = "exact"
# (format, dim): main KV of the small presets (512: small40; 128: small), index keys, window entries
CASES = (("kv_fp4", 512), ("kv_fp4", 128), ("index_fp4", 128), ("index_fp4", 64),
         ("window_fp8", 512), ("window_fp8", 128), ("v4_fp8", 512))
COLUMNS = {"encode_cpu_fast_vs_reference": "encode CPU fast",
           "encode_device_vs_cpu_reference": "encode device",
           "encode_device_reference_vs_cpu_reference": "encode device (reference)",
           "decode_cpu_fast_vs_reference": "decode CPU fast",
           "decode_device_vs_cpu_reference": "decode device",
           "decode_random_bytes_cpu_fast_vs_reference": "decode random bytes CPU fast",
           "decode_random_bytes_device_vs_cpu_reference": "decode random bytes device",
           "special_encode_device_vs_cpu_reference": "encode NaN/inf device"}
REL_TOLERANCE = {"tiny": 0.10, "small": 0.02}      # tests/test_golden.py's bounds (share of std)


def _inputs(rows: int, dim: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, dim, generator=g, device="cpu")
    x *= 10.0 ** (torch.rand(rows, 1, generator=g, device="cpu") * 12 - 6)
    n = min(rows, 4)
    special = torch.zeros(n, dim, device="cpu")         # zeros, subnormals, huge, lone outlier
    if n > 1:
        special[1] = torch.randn(dim, generator=g, device="cpu") * 1e-40
    if n > 2:
        special[2] = torch.randn(dim, generator=g, device="cpu") * 1e30
    if n > 3:
        special[3, dim // 3] = 7.5e3
    x[:n] = special
    return x


def _nonfinite(rows: int, dim: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(max(rows, 3), dim, generator=g, device="cpu")
    x[0, 0], x[1, -1], x[2, dim // 2] = float("nan"), float("inf"), float("-inf")
    return x


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> dict:
    bad = (a != b).reshape(a.shape[0], -1).any(-1) if a.shape == b.shape else None
    return {"equal": bool(a.shape == b.shape and torch.equal(a, b)),
            "rows_differing": None if bad is None else int(bad.sum())}


def _values_equal(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Float tensors: equal values with NaN where NaN (`equal`), and equal float32 bits."""
    na, nb = torch.isnan(a), torch.isnan(b)
    same = torch.equal(na, nb) and torch.equal(a[~na], b[~nb])
    return {"equal": bool(same), "bits_equal": bool(torch.equal(a.view(torch.int32), b.view(torch.int32))),
            "rows_differing": int(((a != b) & ~(na & nb)).reshape(a.shape[0], -1).any(-1).sum())}


def codecs(device: torch.device, rows: int = 4096, seed: int = 0, cases=CASES) -> dict:
    """Encode / decode on the CPU and on `device`, byte for byte (see the module docstring)."""
    from cedlm.kernels import gate
    if rows < 1:
        raise ValueError(f"rows: must be >= 1, got {rows}")
    g = torch.Generator().manual_seed(seed)
    out = []
    for fmt, dim in cases:
        try:
            out.append(_codec_case(fmt, dim, rows, g, device))
        except Exception as e:               # one format failing on the device: the others still run
            out.append({"format": fmt, "dim": dim, "rows": rows, "identical": False,
                        "error": f"{type(e).__name__}: {str(e)[:400]}"})
    return {"config": {"rows": rows, "seed": seed, "device": str(device),
                       "cpu_fast_backend": gate.active_backend(),
                       "cpu_compiled_status": gate.compiled_status()},
            "rows": out, "identical": all(r["identical"] for r in out)}


def _codec_case(fmt: str, dim: int, rows: int, g: torch.Generator, device) -> dict:
    """One (format, dim): encodings and decodings on the CPU and the device vs the CPU reference."""
    from cedlm.kernels import decode, encode
    from cedlm.quant import bytes_per_entry, decode_reference, encode_reference
    x = _inputs(rows, dim, g)
    ref = encode_reference(x, fmt)
    cpu = encode(x, fmt)
    dev = encode(x.to(device), fmt)
    dev_ref = encode_reference(x.to(device), fmt)
    sync(device)
    r = {"format": fmt, "dim": dim, "rows": rows, "entry_bytes": bytes_per_entry(fmt, dim),
         "device_tensor_on": str(dev.device),
         "encode_cpu_fast_vs_reference": _bytes_equal(cpu, ref),
         "encode_device_vs_cpu_reference": _bytes_equal(dev.cpu(), ref),
         "encode_device_reference_vs_cpu_reference": _bytes_equal(dev_ref.cpu(), ref)}
    junk = torch.randint(0, 256, ref.shape, dtype=torch.uint8, generator=g, device="cpu")
    for name, b in (("decode", ref), ("decode_random_bytes", junk)):
        want = decode_reference(b, fmt, dim)
        r[f"{name}_cpu_fast_vs_reference"] = _values_equal(decode(b, fmt, dim), want)
        r[f"{name}_device_vs_cpu_reference"] = _values_equal(decode(b.to(device), fmt, dim).cpu(), want)
    xs = _nonfinite(rows, dim, g)
    r["special_encode_device_vs_cpu_reference"] = _bytes_equal(encode(xs.to(device), fmt).cpu(),
                                                               encode_reference(xs, fmt))
    r["identical"] = all(v["equal"] for k, v in r.items() if isinstance(v, dict))
    return r


def _compare(cpu: torch.Tensor, dev: torch.Tensor, rel: float) -> dict:
    cpu, dev = cpu.float().reshape(-1, cpu.shape[-1]), dev.float().cpu().reshape(-1, dev.shape[-1])
    std = cpu.std().item()
    diff = (cpu - dev).abs().max().item()
    return {"rows": cpu.shape[0], "max_abs_diff": diff, "logit_std": std,
            "max_abs_diff_over_std": diff / std if std else None,
            "argmax_agreement": (cpu.argmax(-1) == dev.argmax(-1)).float().mean().item(),
            "within_tolerance": diff <= rel * std}


def logits(device: torch.device, presets=("tiny", "small"), tokens: int = 128,
           decode_steps: int = 4, seed: int = 0, log=print) -> dict:
    """CPU vs `device` logits of the same seeded model (see the module docstring)."""
    out = []
    for name in presets:
        row = {"preset": name, "tokens": tokens, "tolerance_share_of_std": REL_TOLERANCE.get(name, 0.02)}
        try:
            _logits_case(row, device, decode_steps, seed, log)
        except Exception as e:               # one path failing on the device: what ran is kept
            row.update(within_tolerance=False, error=f"{type(e).__name__}: {str(e)[:400]}")
        out.append(row)
    return {"config": {"presets": list(presets), "tokens": tokens, "decode_steps": decode_steps,
                       "seed": seed, "device": str(device)},
            "rows": out, "within_tolerance": all(r["within_tolerance"] for r in out)}


def _logits_case(row: dict, device, decode_steps: int, seed: int, log) -> None:
    """One preset (`row`): forward, prefill and decode logits on the CPU and on the device, each
    path's comparison put in `row` as it completes."""
    from cedlm.config import ModelConfig
    from cedlm.model import CEDModel
    name, tokens, rel = row["preset"], row["tokens"], row["tolerance_share_of_std"]
    torch.manual_seed(seed)
    cpu_model = CEDModel(ModelConfig.preset(name)).eval()
    dev_model = copy.deepcopy(cpu_model).to(device)
    ids = torch.randint(0, cpu_model.cfg.vocab_size, (1, tokens),
                        generator=torch.Generator().manual_seed(seed), device="cpu")
    with torch.no_grad():
        row["forward"] = _compare(cpu_model(ids), dev_model(ids.to(device)), rel)
        st_c, st_d = cpu_model.new_state(), dev_model.new_state()
        pc = cpu_model.prefill(ids[0], st_c, "bounded")
        pd = dev_model.prefill(ids[0].to(device), st_d, "bounded")
        row["prefill"] = _compare(pc[-1:], pd[-1:], rel)
        steps_c, steps_d = [], []
        tok = int(pc[-1].argmax())
        for _ in range(decode_steps):
            lc = cpu_model.decode([tok], [st_c])
            ld = dev_model.decode([tok], [st_d])
            steps_c.append(lc)
            steps_d.append(ld)
            tok = int(lc[0].argmax())
        if steps_c:
            row["decode"] = _compare(torch.cat(steps_c), torch.cat(steps_d), rel)
    row["within_tolerance"] = all(row[k]["within_tolerance"] for k in ("forward", "prefill", "decode")
                                  if k in row)
    log(f"  logits {name}: forward max|diff|/std {row['forward']['max_abs_diff_over_std']:.2e}, "
        f"within tolerance: {row['within_tolerance']}")


def table(res: dict) -> str:
    parts = []
    c = res.get("codecs")
    if c:
        keys = list(COLUMNS)
        body = [[r["format"], r["dim"], r["rows"]] + (
                    ["yes" if r[k]["equal"] else f"**no** ({r[k]['rows_differing']} rows)" for k in keys]
                    if "error" not in r else [f"**failed**: {r['error']}"] + [""] * (len(keys) - 1))
                for r in c["rows"]]
        parts.append(md_table(["format", "dim", "rows"] + [COLUMNS[k] for k in keys], body)
                     + f"\n\nEvery column compares with the CPU reference codec "
                       f"(`cedlm.quant.formats`); CPU fast backend: {c['config']['cpu_fast_backend']}; "
                       f"device {c['config']['device']}.")
    lg = res.get("logits")
    if lg:
        body = []
        for r in lg["rows"]:
            if "error" in r:
                body.append([r["preset"], "**failed**", r["error"], "", "", "", ""])
            for k in ("forward", "prefill", "decode"):
                if k in r:
                    v = r[k]
                    body.append([r["preset"], k, v["rows"], v["max_abs_diff"], v["max_abs_diff_over_std"],
                                 f"{v['argmax_agreement']:.3f}", "yes" if v["within_tolerance"] else "**no**"])
        parts.append(md_table(["preset", "path", "rows", "max abs diff", "max abs diff / std",
                               "argmax agreement", "within tolerance"], body))
    return "\n\n".join(parts)
