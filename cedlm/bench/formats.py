"""Figure 6: FP4/FP8 codec throughput vs a memcpy of the same bytes.

For each V4.1 format at its official width (kv_fp4 512, index_fp4 128, window_fp8 512): encode
N random N(0,1) entries (float32 in) to bytes and decode them back (float32 out), vs
`clone()` of a uint8 tensor of the encoded size (a memcpy of the cache bytes). Throughput is in
encoded bytes per second, so the ratio is memcpy time / (encode + decode time). The same ratio
against a memcpy of the float32 input size is reported alongside (the data the codec reads).
Pure-torch reference codecs (cedlm.quant), one thread unless --threads says otherwise.
"""
from __future__ import annotations

import torch

from cedlm.bench.common import Ctx, md_table, measure, plt, stats, target
from cedlm.bench.profiling import profile_call

NAME = "formats"
TITLE = "KV format codec throughput"
FMTS = (("kv_fp4", 512), ("index_fp4", 128), ("window_fp8", 512), ("v4_fp8", 512))


def run(ctx: Ctx) -> dict:
    from cedlm.quant import bytes_per_entry, decode, encode
    n_values = ctx.size(1 << 23, 1 << 20)                   # float32 values per call
    reps, warm = ctx.size(9, 3), 1
    rows = []
    g = torch.Generator().manual_seed(ctx.seed)
    for fmt, dim in FMTS:
        N = n_values // dim
        x = torch.randn(N, dim, generator=g)
        b = encode(x, fmt)
        nbytes = b.numel()
        assert nbytes == N * bytes_per_entry(fmt, dim)
        raw = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, generator=g)
        raw_in = torch.randint(0, 255, (x.numel() * 4,), dtype=torch.uint8, generator=g)
        t_enc = stats(measure(lambda: encode(x, fmt), reps, warm))
        t_dec = stats(measure(lambda: decode(b, fmt, dim), reps, warm))
        t_cpy = stats(measure(lambda: raw.clone(), reps, warm))
        t_cpy_in = stats(measure(lambda: raw_in.clone(), reps, warm))
        codec = t_enc["median_s"] + t_dec["median_s"]
        rows.append({
            "format": fmt, "dim": dim, "entries": N, "encoded_bytes": nbytes,
            "input_bytes": x.numel() * 4, "encode_s": t_enc["median_s"], "decode_s": t_dec["median_s"],
            "memcpy_s": t_cpy["median_s"], "memcpy_input_s": t_cpy_in["median_s"],
            "codec_gbps": nbytes / codec / 1e9, "memcpy_gbps": nbytes / t_cpy["median_s"] / 1e9,
            "ratio": t_cpy["median_s"] / codec, "ratio_vs_input_memcpy": t_cpy_in["median_s"] / codec,
            "spread": max(t_enc["spread"], t_dec["spread"], t_cpy["spread"]),
            "v41": fmt != "v4_fp8",
        })
        ctx.log(f"  {fmt}: enc {t_enc['median_s'] * 1e3:.1f} ms dec {t_dec['median_s'] * 1e3:.1f} ms "
                f"memcpy {t_cpy['median_s'] * 1e3:.2f} ms")
    worst = min(r["ratio"] for r in rows if r["v41"])
    out = {
        "config": {"float32_values_per_call": n_values, "repeats": reps, "warmup": warm,
                   "threads": torch.get_num_threads()},
        "rows": rows,
        "target": target("codec throughput / memcpy throughput (worst V4.1 format)", ">=", 0.3, worst),
        "notes": ["v4_fp8 (the V4 baseline's entry) is shown for comparison, not in the target."],
    }
    if ctx.profile and not out["target"]["met"]:
        x = torch.randn(n_values // 512, 512, generator=g)
        b = encode(x, "kv_fp4")
        out["profile"] = {
            "kv_fp4_encode_decode": profile_call(lambda: [decode(encode(x, "kv_fp4"), "kv_fp4", 512)
                                                         for _ in range(3)])}
    return out


def table(res: dict) -> str:
    body = [[r["format"], r["dim"], r["entries"], r["encoded_bytes"], r["encode_s"] * 1e3,
             r["decode_s"] * 1e3, r["memcpy_s"] * 1e3, r["codec_gbps"], r["memcpy_gbps"],
             f"{r['ratio']:.3f}", f"{r['ratio_vs_input_memcpy']:.3f}"] for r in res["rows"]]
    return md_table(["format", "dim", "entries", "encoded B", "encode ms", "decode ms", "memcpy ms",
                     "codec GB/s", "memcpy GB/s", "codec / memcpy", "vs fp32-input memcpy"], body)


def plot(res: dict, path) -> bool:
    pyplot = plt()
    if pyplot is None:
        return False
    fig, ax = pyplot.subplots(figsize=(7, 4))
    names = [r["format"] for r in res["rows"]]
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [r["codec_gbps"] for r in res["rows"]], 0.4, label="encode + decode")
    ax.bar([x + 0.2 for x in xs], [r["memcpy_gbps"] for r in res["rows"]], 0.4, color="#888888",
           label="memcpy (clone) of the encoded bytes")
    for x, r in zip(xs, res["rows"]):
        ax.text(x - 0.2, r["codec_gbps"], f"{r['ratio']:.3f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), names)
    ax.set_yscale("log")
    ax.set_ylabel("GB/s of encoded bytes (log)")
    ax.set_title("Codec throughput vs memcpy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot.close(fig)
    return True
