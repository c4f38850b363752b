"""Figure 7: decode throughput vs HF transformers (Llama of equal parameter count).

The peer: a `LlamaForCausalLM` (random init, float32, SDPA attention, untied head) whose
parameter count matches CED-small's without its Engram tables (the tables are looked up, never
multiplied; with them CED-small is larger still); width, depth, vocabulary as CED-small, heads of
64 dims, MLP width solved for the count. It decodes with `model.generate(use_cache=True)`, greedy,
from a cache already holding `context` tokens; CED decodes with `CEDModel.decode` on B states of
`context` tokens plus a greedy argmax. Both caches are built directly with random values (HF: a
DynamicCache filled by `update`; CED: common.synth_ced_state); decode cost depends on sizes.
Throughput = B x new tokens / wall time, median of repeats.

transformers is an optional extra: when it is absent the figure is skipped with a message, unless
--install-peer is given: then it pip-installs TRANSFORMERS_PIN into the running interpreter
(constrained to the installed torch / tokenizers / safetensors / numpy); nothing is installed
unasked.
"""
from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
import subprocess
import sys
import tempfile

import torch

from cedlm.bench.common import Ctx, md_table, measure, plt, stats, synth_ced_state, target

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
    model = transformers.LlamaForCausalLM(lc).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _hf_cache(transformers, model, B: int, C: int, seed: int):
    c = model.config
    hd = c.hidden_size // c.num_attention_heads
    cache = transformers.DynamicCache()
    g = torch.Generator().manual_seed(seed)
    for l in range(c.num_hidden_layers):
        k = torch.randn(B, c.num_key_value_heads, C, hd, generator=g)
        v = torch.randn(B, c.num_key_value_heads, C, hd, generator=g)
        cache.update(k, v, l)
    return cache


def run(ctx: Ctx) -> dict:
    C = ctx.size(8192, 512)
    new = ctx.size(16, 3)
    reps = ctx.size(5, 1)
    batches = [1, 8]
    ced = ctx.ced()
    target_params = ced.num_parameters(exclude_engram=True)
    tf, how = ensure_transformers(ctx.install, ctx.log)
    if tf is None:
        return {"skipped": f"peer figure skipped: {how}. Install it with "
                           f"`pip install {TRANSFORMERS_PIN}` (optional extra) to run it.",
                "config": {"context": C, "batches": batches, "new_tokens": new},
                "rows": [], "target": target("CED tokens/s / HF Llama tokens/s (worst batch)",
                                             ">=", 1.0, None)}
    hf = llama_for(tf, target_params, ced.cfg, C + new + 64)
    hf_params = sum(p.numel() for p in hf.parameters())
    rows = []
    for B in batches:
        g = torch.Generator().manual_seed(ctx.seed + B)
        # ---- HF: generate from a cache holding C tokens
        ids = torch.randint(1, ced.cfg.vocab_size, (B, C + 1), generator=g)
        mask = torch.ones_like(ids)
        cache = _hf_cache(tf, hf, B, C, ctx.seed + B)

        def hf_gen(n):
            out = hf.generate(input_ids=ids, attention_mask=mask, past_key_values=cache,
                              max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True)
            assert out.shape == (B, C + 1 + n), out.shape
            extra = cache.get_seq_length() - C
            if extra > 0:
                cache.crop(-extra)                   # back to the C prefilled tokens
            assert cache.get_seq_length() == C
        with torch.no_grad():
            hf_gen(2)                                               # warm-up
            t_hf = stats(measure(lambda: hf_gen(new), reps, 0))
        del cache
        # ---- CED: B states of C tokens, greedy decode
        states = [synth_ced_state(ced, C, seed=ctx.seed + b) for b in range(B)]

        def ced_gen(n):
            tok = torch.randint(1, ced.cfg.vocab_size, (B,), generator=g)
            for _ in range(n):
                tok = ced.decode(tok, states).argmax(-1)
        ced_gen(2)
        t_ced = stats(measure(lambda: ced_gen(new), reps, 0))
        del states
        r = {"batch": B, "context": C, "new_tokens": new,
             "ced_s": t_ced["median_s"], "hf_s": t_hf["median_s"],
             "ced_tokens_per_s": B * new / t_ced["median_s"], "hf_tokens_per_s": B * new / t_hf["median_s"],
             "spread": max(t_ced["spread"], t_hf["spread"])}
        r["ratio"] = r["ced_tokens_per_s"] / r["hf_tokens_per_s"]
        rows.append(r)
        ctx.log(f"  peer batch {B}: CED {r['ced_tokens_per_s']:.1f} tok/s, HF {r['hf_tokens_per_s']:.1f} tok/s")
    worst = min(r["ratio"] for r in rows)
    prof = None
    if ctx.profile and worst < 1.0:
        from cedlm.bench.profiling import profile_call
        B = batches[-1]
        g = torch.Generator().manual_seed(ctx.seed)
        states = [synth_ced_state(ced, C, seed=ctx.seed + b) for b in range(B)]
        ced.decode(torch.full((B,), 7), states)
        cache = _hf_cache(tf, hf, B, C, ctx.seed)
        ids = torch.randint(1, ced.cfg.vocab_size, (B, C + 1), generator=g)
        n = ctx.size(4, 2)
        prof = {f"ced_decode_batch{B}_{n}_steps": profile_call(
                    lambda: [ced.decode(torch.full((B,), 7), states) for _ in range(n)]),
                f"hf_generate_batch{B}_{n}_tokens": profile_call(
                    lambda: hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                        past_key_values=cache, max_new_tokens=n, min_new_tokens=n,
                                        do_sample=False, use_cache=True))}
        del states, cache
    out = {
        "config": {"context": C, "batches": batches, "new_tokens": new, "repeats": reps,
                   "transformers": how, "ced_params_without_engram_tables": target_params,
                   "ced_params_total": ced.num_parameters(), "hf_params": hf_params,
                   "hf_config": {k: getattr(hf.config, k) for k in (
                       "hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "num_key_value_heads", "vocab_size")},
                   "caches": "built directly with random values (both sides)"},
        "rows": rows,
        "target": target("CED decode tokens/s / HF Llama tokens/s (worst batch)", ">=", 1.0, worst),
        "notes": ["HF runs float32 eager PyTorch with SDPA; CED runs its float32 reference path "
                  "with byte-format caches (decoded per step)."],
    }
    if prof:
        out["profile"] = prof
    return out


def table(res: dict) -> str:
    if res.get("skipped"):
        return res["skipped"]
    body = [[r["batch"], r["context"], r["new_tokens"], r["ced_tokens_per_s"], r["hf_tokens_per_s"],
             f"{r['ratio']:.2f}", r["spread"]] for r in res["rows"]]
    c = res["config"]
    return (md_table(["batch", "context", "new tokens", "CED tokens/s", "HF Llama tokens/s",
                      "CED / HF", "spread"], body)
            + f"\n\nParameters: CED-small {c['ced_params_without_engram_tables']:,} without Engram "
              f"tables ({c['ced_params_total']:,} with); HF Llama {c['hf_params']:,} "
              f"({c['hf_config']}); {c['transformers']}.")


def plot(res: dict, path) -> bool:
    pyplot = plt()
    if pyplot is None or res.get("skipped"):
        return False
    fig, ax = pyplot.subplots(figsize=(6, 4))
    xs = range(len(res["rows"]))
    ax.bar([x - 0.2 for x in xs], [r["ced_tokens_per_s"] for r in res["rows"]], 0.4, label="CED-small")
    ax.bar([x + 0.2 for x in xs], [r["hf_tokens_per_s"] for r in res["rows"]], 0.4, color="#888888",
           label="HF Llama (equal params)")
    for x, r in zip(xs, res["rows"]):
        ax.text(x - 0.2, r["ced_tokens_per_s"], f"{r['ratio']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [f"batch {r['batch']}" for r in res["rows"]])
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Decode at {res['config']['context']:,} context")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot.close(fig)
    return True
