"""Figure 7: decode throughput vs HF transformers and llama.cpp (Llama of equal parameter count).

The peer: a `LlamaForCausalLM` (random init, float32, SDPA attention, untied head) whose
parameter count matches CED-small's without its Engram tables (the tables are looked up, never
multiplied; with them CED-small is larger still); width, depth, vocabulary as CED-small, heads of
64 dims, MLP width solved for the count. It decodes with `model.generate(use_cache=True)`, greedy,
from a cache already holding `context` tokens; CED decodes with the step `ced_decode_fn(model)`
returns (common.py) on B states of `context` tokens plus a greedy argmax. Both caches are built
directly with random values (HF: a DynamicCache filled by `update`; CED: common.synth_ced_state);
decode cost depends on sizes. The same Llama, converted to GGUF F32 and F16 by llama.cpp's own
converter, decodes in llama.cpp at batch 1 after a real prefill of `context` tokens (timed apart;
peer_llamacpp.py); batch 8 is n/a there. Throughput = B x new tokens / wall time, median of
repeats, every engine's runs of one point interleaved round-robin. Swept over contexts 512, 2k, 8k
and 32k at batch 1 and 8 (`--quick`: 512 only).

Targets (each context its own, in `targets`; `target` is the worst CED / HF point relative to its
own): CED / HF >= 2x at 512, >= 1x at 2k and 8k, >= 3x at 32k; CED / llama.cpp
F32 at batch 1 >= 1x at 512 and 2k, >= 1.5x at 8k, >= 3x at 32k (F16 reported without a
target); the weight-read bandwidth fraction of CED at batch 1 and the smallest context >= 0.5:
(bytes of weights read per token x tokens/s) / this machine's single-thread read bandwidth,
measured in the run (weight_reads.py), beside llama.cpp's. `ttft`: first-token latency of one
1k-token prompt at batch 1 against the same HF model (no target; `--quick`: 256 tokens).

Device (`--device`): CED and the HF Llama both run on the run's device (weights drawn on the host,
seeded, then moved; caches built there; a GPU synchronised around every timed run). On a GPU
the llama.cpp columns and the weight-read bandwidth fractions are not measured, each with its
reason in `config.cpu_only_skipped` and under the table: llama-cpp-python decodes on the CPU, and
the bandwidth fraction divides by the host's single-thread read bandwidth.

transformers is an optional extra: when it is absent the figure is skipped with a message, unless
--install-peer is given: then it pip-installs TRANSFORMERS_PIN into the running interpreter
(constrained to the installed torch / tokenizers / safetensors / numpy), and llama.cpp's pieces
(peer_llamacpp.ensure_llama_cpp); nothing is installed unasked.
"""
from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
import subprocess
import sys
import tempfile

import torch

from cedlm.bench import peer_llamacpp
from cedlm.bench.common import (Ctx, ced_decode_fn, md_table, measure, measure_interleaved, plt,
                               save_plot, stats, synth_ced_batch, target)
from cedlm.bench.weight_reads import GIB, active_parameters, bandwidth_fraction, read_bandwidth

NAME = "peer"
TITLE = "Decode throughput vs HF transformers"
TRANSFORMERS_PIN = "transformers==5.23.0"


def ensure_transformers(install: bool, log=print) -> tuple[object | None, str]:
    if importlib.util.find_spec("transformers") is not None:
        import transformers
        return transformers, f"transformers {transformers.__version__} (already installed)"
    if not install:
        return None, ("transformers is not installed (nothing is installed unasked: pass "
                      "--install-peer to pip-install it into this environment)")
    pins = []
    for dist in ("torch", "tokenizers", "safetensors", "numpy"):
        try:
            pins.append(f"{dist}=={md.version(dist).split('+')[0]}")
        except md.PackageNotFoundError:
            pass
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(pins) + "\n")
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", TRANSFORMERS_PIN, "-c", f.name]
    log(f"  installing {TRANSFORMERS_PIN} (constraints: {', '.join(pins)}) ...")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"pip install {TRANSFORMERS_PIN} failed: {e}"
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return None, f"pip install {TRANSFORMERS_PIN} failed: {' / '.join(tail)}"
    importlib.invalidate_caches()
    try:
        import transformers
    except ImportError as e:
        return None, f"transformers installed but does not import: {e}"
    return transformers, f"transformers {transformers.__version__} (installed by the benchmark)"


def llama_for(transformers, target_params: int, cfg, max_pos: int):
    """A LlamaConfig with CED's width, depth and vocabulary and the MLP width that matches."""
    D, L, V = cfg.hidden_size, cfg.n_layers, cfg.vocab_size
    heads = max(1, D // 64)
    fixed = 2 * V * D + D + L * (4 * D * D + 2 * D)
    inter = max(8, round((target_params - fixed) / (3 * D * L)))
    lc = transformers.LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=inter, num_hidden_layers=L,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max_pos,
        tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=None,
        pad_token_id=0)
    lc._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cpu"):                    # drawn on the host; the caller moves it
        model = transformers.LlamaForCausalLM(lc).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _hf_cache(transformers, model, B: int, C: int, seed: int):
    """A DynamicCache of B x C tokens on the model's device (random K and V drawn on the host)."""
    c = model.config
    hd = c.hidden_size // c.num_attention_heads
    cache = transformers.DynamicCache()
    g = torch.Generator().manual_seed(seed)
    dev = model.device
    for l in range(c.num_hidden_layers):
        k = torch.randn(B, c.num_key_value_heads, C, hd, generator=g, device="cpu").to(dev)
        v = torch.randn(B, c.num_key_value_heads, C, hd, generator=g, device="cpu").to(dev)
        cache.update(k, v, l)
    return cache


def hf_generate_from_cache(model, ids, mask, cache, C: int, n: int) -> None:
    """Greedy-decode n tokens with HF `generate` after `cache` (holding C tokens; `ids` are those
    C tokens and the next one), then crop the cache back to its C tokens for the next run."""
    B = ids.shape[0]
    out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache,
                         max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True)
    assert out.shape == (B, C + 1 + n), out.shape
    extra = cache.get_seq_length() - C
    if extra > 0:
        cache.crop(-extra)


# CED / HF: >= 2x at 512, >= 1x to 8k, >= 3x at 32k
TARGETS = {512: 2.0, 2048: 1.0, 8192: 1.0, 32768: 3.0}
LLAMA_NA_BATCH = "n/a at batch > 1: llama-cpp-python decodes one sequence"
# what the figure does not measure on a GPU, and why
CPU_ONLY_PARTS = {
    "llama_cpp": "the llama.cpp peer decodes on the CPU (llama-cpp-python is built for the host); "
                 "against it on a GPU would compare two devices",
    "bandwidth_fraction": "the weight-read bandwidth fraction divides by the host's single-thread "
                          "read bandwidth (weight_reads.read_bandwidth), a CPU figure",
}


def _pair(ctx: Ctx, tf, hf, ced, B: int, C: int, new: int, reps: int, lcp, bw: dict) -> dict:
    """One (batch, context) point: HF generate, CED decode and (batch 1) llama.cpp F32 / F16,
    `new` tokens each, runs interleaved, medians. `lcp`: the LlamaCppPeer or None; `bw`: the read
    bandwidth and bytes per token of each side."""
    g = torch.Generator().manual_seed(ctx.seed + B + C)
    dev = ctx.device
    # ---- HF: generate from a cache holding C tokens
    ids = torch.randint(1, ced.cfg.vocab_size, (B, C + 1), generator=g, device="cpu").to(dev)
    mask = torch.ones_like(ids)
    cache = _hf_cache(tf, hf, B, C, ctx.seed + B)

    def hf_gen(n):
        hf_generate_from_cache(hf, ids, mask, cache, C, n)
        assert cache.get_seq_length() == C
    # ---- CED: B states of C tokens, greedy decode through the one step function
    states = synth_ced_batch(ced, C, B, seed=ctx.seed, new_tokens=new * (reps + 2))
    step = ced_decode_fn(ced, ctx.engine_options.get("decode_step"))

    def ced_gen(n):
        tok = torch.randint(1, ced.cfg.vocab_size, (B,), generator=g, device="cpu").to(dev)
        for _ in range(n):
            tok = step(tok, states).argmax(-1)
    fns = {"ced": lambda: ced_gen(new), "hf": lambda: hf_gen(new)}
    streams = {}
    if lcp is not None and B == 1:
        streams = lcp.streams(C, new, ctx.threads, ctx.seed + C)
        fns.update({f"llamacpp_{t}": (lambda s=s: s.decode(new)) for t, s in streams.items()})
    try:
        st = {k: stats(v) for k, v in measure_interleaved(fns, reps, warmup=1, device=dev).items()}
    finally:
        for s in streams.values():
            s.close()
        states = cache = None               # the caches freed (the closures hold the names)
    r = {"batch": B, "context": C, "new_tokens": new,
         "ced_s": st["ced"]["median_s"], "hf_s": st["hf"]["median_s"],
         "ced_tokens_per_s": B * new / st["ced"]["median_s"],
         "hf_tokens_per_s": B * new / st["hf"]["median_s"],
         "spread": max(x["spread"] for x in st.values()),
         "runs_s": {k: x["runs_s"] for k, x in st.items()}}
    r["ratio"] = r["ced_tokens_per_s"] / r["hf_tokens_per_s"]
    r["target"] = TARGETS.get(C, 1.0)
    r["met"] = r["ratio"] >= r["target"]
    r["llamacpp"] = ("measured" if streams else LLAMA_NA_BATCH if lcp is not None
                     else "skipped (see config.llama_cpp)")
    r["ced_bandwidth_fraction"] = (bandwidth_fraction(bw["ced_bytes_per_token"],
                                                      r["ced_tokens_per_s"], bw["bytes_per_s"])
                                   if B == 1 and bw["bytes_per_s"] else None)
    msg = ""
    for t in peer_llamacpp.OUTTYPES:
        k = f"llamacpp_{t}"
        tps = B * new / st[k]["median_s"] if k in st else None
        r[f"{k}_s"] = st[k]["median_s"] if k in st else None
        r[f"{k}_tokens_per_s"] = tps
        r[f"{k}_prefill_s"] = streams[t].prefill_s if t in streams else None
        r[f"ratio_vs_{k}"] = r["ced_tokens_per_s"] / tps if tps else None
        r[f"{k}_bandwidth_fraction"] = bandwidth_fraction(
            bw["llamacpp_bytes_per_token"].get(t), tps, bw["bytes_per_s"])
        if tps:
            msg += f", llama.cpp {t.upper()} {tps:.1f} tok/s ({r[f'ratio_vs_{k}']:.2f}x)"
    r["target_vs_llamacpp_f32"] = peer_llamacpp.TARGETS.get(C, 1.0) if B == 1 else None
    ctx.log(f"  peer context {C} batch {B}: CED {r['ced_tokens_per_s']:.1f} tok/s, "
            f"HF {r['hf_tokens_per_s']:.1f} tok/s ({r['ratio']:.2f}x, target {r['target']}x)" + msg)
    return r


TTFT_PROMPT = 1024


def _ttft(ctx: Ctx, hf, ced, S: int, reps: int) -> dict:
    """First-token latency of one S-token prompt, batch 1: HF `generate(max_new_tokens=1)` from
    an empty cache (its prefill, SDPA) vs CED's engine default, a `bounded` prefill in chunks of
    512 tokens into a fresh state plus the argmax. Medians of `reps`, the two interleaved."""
    ids = torch.randint(1, ced.cfg.vocab_size, (1, S), generator=torch.Generator().manual_seed(ctx.seed),
                        device="cpu").to(ctx.device)
    mask = torch.ones_like(ids)

    def hf_first():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, min_new_tokens=1,
                          do_sample=False, use_cache=True)
        assert out.shape == (1, S + 1)

    def ced_first():
        int(ced.prefill(ids[0], ced.new_state(), "bounded", chunk_size=512)[-1].argmax())
    with torch.no_grad():
        hf_first()
        ced_first()                                                  # warm-up
        t_hf, t_ced = [], []
        for _ in range(reps):
            t_hf += measure(hf_first, 1, 0, device=ctx.device)
            t_ced += measure(ced_first, 1, 0, device=ctx.device)
    h, c = stats(t_hf), stats(t_ced)
    r = {"prompt_tokens": S, "batch": 1, "ced_s": c["median_s"], "hf_s": h["median_s"],
         "ced_over_hf": c["median_s"] / h["median_s"], "spread": max(c["spread"], h["spread"]),
         "ced_mode": "bounded, chunks of 512 (the engine default)"}
    ctx.log(f"  first token after {S} prompt tokens: CED {r['ced_s'] * 1e3:.0f} ms, "
            f"HF {r['hf_s'] * 1e3:.0f} ms ({r['ced_over_hf']:.2f}x the time)")
    return r


def _weights(ctx: Ctx, ced, lcp) -> dict:
    """The bandwidth-fraction inputs: this machine's single-thread read bandwidth (measured now)
    and the bytes of weights each side reads per decoded token (CED: its active parameters x 4;
    llama.cpp: the GGUF's tensors at their stored size, one embedding row). Off the CPU the
    bandwidth is not measured (None: CPU_ONLY_PARTS says why)."""
    active = active_parameters(ced)
    if ctx.device.type != "cpu":
        bw = {"bytes_per_s": None, "skipped": CPU_ONLY_PARTS["bandwidth_fraction"]}
    else:
        bw = read_bandwidth(ctx.size(GIB, GIB // 4), ctx.size(5, 3))
        ctx.log(f"  single-thread read bandwidth {bw['bytes_per_s'] / 1e9:.1f} GB/s; CED reads "
                f"{active['total']:,} active parameters per token")
    return {"bytes_per_s": bw["bytes_per_s"], "read_bandwidth": bw, "ced_active_params": active,
            "ced_bytes_per_token": 4 * active["total"],
            "llamacpp_bytes_per_token": {t: w["bytes_per_token"]
                                         for t, w in (lcp.weights if lcp else {}).items()}}


def run(ctx: Ctx) -> dict:
    contexts = ctx.peer_contexts or ctx.size([512, 2048, 8192, 32768], [512])
    new = ctx.size(16, 3)
    batches = [1, 8]
    ced = ctx.ced()
    target_params = ced.num_parameters(exclude_engram=True)
    tf, how = ensure_transformers(ctx.install, ctx.log)
    if tf is None:
        return {"skipped": f"peer figure skipped: {how}. Install it with "
                           f"`pip install {TRANSFORMERS_PIN}` (optional extra) to run it (the "
                           f"llama.cpp peer converts the same HF Llama).",
                "config": {"contexts": contexts, "batches": batches, "new_tokens": new},
                "rows": [], "target": target("CED tokens/s / HF Llama tokens/s (worst batch)",
                                             ">=", 1.0, None)}
    # llama.cpp pads n_ctx to a multiple of 256: room for it within the trained length
    hf = llama_for(tf, target_params, ced.cfg, max(contexts) + new + 512).to(ctx.device)
    hf_params = sum(p.numel() for p in hf.parameters())
    on_cpu = ctx.device.type == "cpu"
    skipped = {} if on_cpu else {k: f"not measured on {ctx.device}: {v}" for k, v in CPU_ONLY_PARTS.items()}
    if on_cpu:
        lcp, llama_how = peer_llamacpp.setup(ctx, hf)
    else:
        lcp, llama_how = None, f"llama.cpp peer {skipped['llama_cpp']}"
    ctx.log(f"  {llama_how}")
    bw = _weights(ctx, ced, lcp)
    rows = []
    try:
        for C in contexts:
            # the 32k points hold a 32k-token HF cache per row: fewer repeats there
            reps = ctx.size(5 if C <= 8192 else 3, 1)
            for B in batches:
                rows.append(_pair(ctx, tf, hf, ced, B, C, new, reps, lcp, bw))
    finally:
        if lcp is not None:
            lcp.close()
    ttft = _ttft(ctx, hf, ced, ctx.size(TTFT_PROMPT, 256), ctx.size(5, 1))
    # the figure's target: the worst point relative to its own target (2x at 512, 1x to 8k, 3x at 32k)
    worst_row = min(rows, key=lambda r: r["ratio"] / r["target"])
    targets = {}
    for C in contexts:
        rs = [r for r in rows if r["context"] == C]
        targets[f"{C}"] = target(f"CED / HF decode tokens/s at {C:,} context (worst batch)", ">=",
                                 TARGETS.get(C, 1.0), min(r["ratio"] for r in rs))
    if on_cpu:
        targets.update(peer_llamacpp.targets(rows, contexts))
    prof = None
    if ctx.profile and not worst_row["met"]:
        from cedlm.bench.profiling import profile_call
        B, C = worst_row["batch"], worst_row["context"]
        g = torch.Generator().manual_seed(ctx.seed)
        states = synth_ced_batch(ced, C, B, seed=ctx.seed)
        step = ced_decode_fn(ced, ctx.engine_options.get("decode_step"))
        seven = torch.full((B,), 7, device=ctx.device)
        step(seven, states)
        cache = _hf_cache(tf, hf, B, C, ctx.seed)
        ids = torch.randint(1, ced.cfg.vocab_size, (B, C + 1), generator=g, device="cpu").to(ctx.device)
        n = ctx.size(4, 2)
        prof = {f"ced_decode_context{C}_batch{B}_{n}_steps": profile_call(
                    lambda: [step(seven, states) for _ in range(n)]),
                f"hf_generate_context{C}_batch{B}_{n}_tokens": profile_call(
                    lambda: hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                        past_key_values=cache, max_new_tokens=n, min_new_tokens=n,
                                        do_sample=False, use_cache=True))}
        del states, cache
    out = {
        "config": {"contexts": contexts, "batches": batches, "new_tokens": new,
                   "device": str(ctx.device), "cpu_only_skipped": skipped,
                   "transformers": how, "ced_params_without_engram_tables": target_params,
                   "ced_params_total": ced.num_parameters(), "hf_params": hf_params,
                   "hf_config": {k: getattr(hf.config, k) for k in (
                       "hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "num_key_value_heads", "vocab_size")},
                   "caches": "built directly with random values (CED, HF); llama.cpp prefills",
                   "targets_by_context": {str(c): TARGETS.get(c, 1.0) for c in contexts},
                   "llamacpp_targets_by_context": {str(c): peer_llamacpp.TARGETS.get(c, 1.0)
                                                   for c in contexts},
                   "llama_cpp": llama_how, "llamacpp_batch8": LLAMA_NA_BATCH,
                   "llamacpp_weights": lcp.weights if lcp else None,
                   "read_bandwidth": bw["read_bandwidth"],
                   "ced_active_params": bw["ced_active_params"],
                   "ced_bytes_per_token": bw["ced_bytes_per_token"]},
        "rows": rows,
        "ttft": ttft,
        "targets": targets,
        "target": target("CED / HF decode tokens/s, worst point over contexts and batches, "
                         "relative to its target (2x at 512, 1x at 2k and 8k, 3x at 32k)", ">=",
                         1.0, worst_row["ratio"] / worst_row["target"],
                         note=f"worst: context {worst_row['context']}, batch {worst_row['batch']}: "
                              f"{worst_row['ratio']:.2f}x vs {worst_row['target']}x"),
        "notes": ["HF runs float32 eager PyTorch with SDPA and its default DynamicCache; CED runs "
                  "its default (fast) path with byte-format caches (the step ced_decode_fn "
                  "returns); llama.cpp runs the GGUF F32 / F16 conversion of the same Llama with "
                  "its default F16 KV cache, one `eval` per token plus an argmax of the logits.",
                  "Bandwidth fraction = bytes of weights read per token x tokens/s / single-thread "
                  "read bandwidth (summing a float32 tensor). CED: active parameters x 4 bytes "
                  "(embedding row, attention, top-k routed + shared experts, head; no Engram "
                  "tables, no unselected experts); llama.cpp: its GGUF tensors, one embedding row."],
    }
    if prof:
        out["profile"] = prof
    return out


def table(res: dict) -> str:
    if res.get("skipped"):
        return res["skipped"]
    body = [[r["context"], r["batch"], r["new_tokens"], r["ced_tokens_per_s"], r["hf_tokens_per_s"],
             f"{r['ratio']:.2f}", f">= {r.get('target', 1.0)}",
             "met" if r.get("met", r["ratio"] >= 1.0) else "**missed**", r["spread"]]
            for r in res["rows"]]
    c = res["config"]
    return (md_table(["context", "batch", "new tokens", "CED tokens/s", "HF Llama tokens/s",
                      "CED / HF", "target", "met", "spread"], body)
            + f"\n\nParameters: CED-small {c['ced_params_without_engram_tables']:,} without Engram "
              f"tables ({c['ced_params_total']:,} with); HF Llama {c['hf_params']:,} "
              f"({c['hf_config']}); {c['transformers']}."
            + (peer_llamacpp.table(res) if not c.get("cpu_only_skipped") else "".join(
                f"\n\n{k.replace('_', ' ').capitalize()}: {v}." for k, v in c["cpu_only_skipped"].items()))
            + (f"\n\nFirst-token latency, one {res['ttft']['prompt_tokens']:,}-token prompt, batch 1 "
               f"(medians): CED {res['ttft']['ced_s'] * 1e3:.0f} ms ({res['ttft']['ced_mode']}), "
               f"HF {res['ttft']['hf_s'] * 1e3:.0f} ms (`generate` from an empty cache): CED takes "
               f"{res['ttft']['ced_over_hf']:.2f}x HF's time (spread {res['ttft']['spread']:.2f})."
               if res.get("ttft") else ""))


def plot(res: dict, path) -> bool:
    pyplot = plt()
    if pyplot is None or res.get("skipped"):
        return False
    fig, ax = pyplot.subplots(figsize=(6.5, 4))
    series = [(f"vs HF, batch {B}", "ratio", [r for r in res["rows"] if r["batch"] == B])
              for B in sorted({r["batch"] for r in res["rows"]})]
    series += [(f"vs llama.cpp {t.upper()}, batch 1", f"ratio_vs_llamacpp_{t}",
                [r for r in res["rows"] if r.get(f"ratio_vs_llamacpp_{t}") is not None])
               for t in peer_llamacpp.OUTTYPES]
    for (label, key, rs), mark in zip(series, "osD^"):
        if not rs:
            continue
        rs = sorted(rs, key=lambda r: r["context"])
        ax.plot([r["context"] for r in rs], [r[key] for r in rs], marker=mark, label=label)
        for r in rs:
            ax.annotate(f"{r[key]:.2f}x", (r["context"], r[key]), fontsize=7,
                        textcoords="offset points", xytext=(4, 4))
    ts = sorted({(r["context"], r.get("target", 1.0)) for r in res["rows"]})
    ax.step([c for c, _ in ts], [t for _, t in ts], where="mid", color="#888888", linestyle="--",
            label="target (CED / HF)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("CED-small / peer decode tokens/s (log)")
    ax.set_title("Decode vs HF transformers and llama.cpp (equal parameters)")
    ax.legend(fontsize=8)
    return save_plot(pyplot, fig, path)
