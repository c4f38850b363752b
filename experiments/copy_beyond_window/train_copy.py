"""Synthetic copy task: does a CED model learn to copy random tokens, inside its window and beyond it?

Layouts (tokens uniform in [lo, hi)):
- "fixed": blocks of [r, r], r = L random tokens (the copy sits L tokens back, inside the window);
- "induction": random filler with one stretch of L tokens repeated at a random later place
  (gap between the end of the first copy and the start of the second: 0..max_gap);
- "far": blocks of [r, filler of --gap tokens, r] (the copy sits L + gap tokens back: beyond a
  32-token window for gap >= 17); --switch-at N trains on "fixed" for the first N steps.
- "recall": associative recall by content (`tasks.recall`): --pairs key-value pairs, a filler of
  --gap tokens (random, or corpus text with --filler text), then every key again with its value.
  --random-gap draws the gap uniformly in --min-gap..--gap per batch.
Loss on all positions; logged per bucket of --log-every steps: the mean loss on the targets of the
first copy (random: floor ln(hi - lo)) and of the second copy (predictable by copying), and the
second copy's argmax accuracy. `--arch decoder_only` trains the repo's Llama-like baseline, `--arch
gpt` a textbook pre-LN GPT (controls). `--dense-probe` selects every visible compressed entry
(the indexer's dense warm-up; the indexer itself gets no gradient here). FIDELITY.md, section
"Why the retrieval model did not copy", has the runs and their commands, e.g.

    .venv/bin/python experiments/copy_beyond_window/train_copy.py --arch ced --preset retrieval \
        --set rope_scaling=null --hi 80 --steps 300 --out runs/copy/ced_noyarn.jsonl
"""
import argparse, json, math, os, sys, time
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tasks

torch.set_num_threads(1)
from cedlm.config import ModelConfig
from cedlm.model import build_model
from cedlm.train.optim import moe_layers, update_moe_bias

p = argparse.ArgumentParser()
p.add_argument("--arch", default="ced", choices=["ced", "decoder_only", "gpt"])
p.add_argument("--preset", default="retrieval")
p.add_argument("--set", action="append", default=[], help="config override key=json")
p.add_argument("--steps", type=int, default=600)
p.add_argument("--batch", type=int, default=16)
p.add_argument("--L", type=int, default=16)
p.add_argument("--blocks", type=int, default=2)
p.add_argument("--layout", default="fixed", choices=["fixed", "induction", "far", "recall", "passkey"])
p.add_argument("--gap", type=int, default=48, help="far layout: filler tokens between a block and its copy")
p.add_argument("--switch-at", type=int, default=0, help="fixed layout for the first N steps, then --layout")
p.add_argument("--random-gap", action="store_true", help="far/recall: each batch draws its gap uniformly in --min-gap..--gap")
p.add_argument("--min-gap", type=int, default=0)
p.add_argument("--pairs", type=int, default=8, help="recall layout: key-value pairs per sequence")
p.add_argument("--filler", default="random", choices=["random", "text"], help="recall layout: filler tokens")
p.add_argument("--seq", type=int, default=64, help="induction / passkey layout: sequence length")
p.add_argument("--answer-weight", type=float, default=0.0,
               help="add this times the mean loss of the second-copy / answer targets to the loss")
p.add_argument("--max-gap", type=int, default=0)
p.add_argument("--lo", type=int, default=16)
p.add_argument("--hi", type=int, default=528)
p.add_argument("--lr", type=float, default=2e-3)
p.add_argument("--warmup", type=int, default=20)
p.add_argument("--wd", type=float, default=0.1)
p.add_argument("--clip", type=float, default=1.0)
p.add_argument("--log-every", type=int, default=50)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--max-minutes", type=float, default=14.0)
p.add_argument("--dense-probe", action="store_true", help="pass IndexerProbe(dense=True) like --selection dense")
p.add_argument("--eval-mode", action="store_true", help="call model.eval() (no fake-quant STE path)")
p.add_argument("--out", default=None)
p.add_argument("--gpt-dim", type=int, default=128)
p.add_argument("--gpt-layers", type=int, default=2)
p.add_argument("--gpt-heads", type=int, default=4)
p.add_argument("--save", default=None, help="save state_dict here at the end")
p.add_argument("--init", default=None, help="start from the weights of a --save file (same preset and --set)")
a = p.parse_args()

class MiniGPT(torch.nn.Module):
    """A textbook pre-LN GPT (learned absolute positions, MHA, GELU MLP): the calibration control."""
    def __init__(self, V, D, L, H, maxlen):
        super().__init__()
        nn = torch.nn
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(maxlen, D)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(D, H, 4 * D, dropout=0.0, activation="gelu",
                                                               batch_first=True, norm_first=True) for _ in range(L))
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)
    def forward(self, x):
        T = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(T))
        mask = torch.nn.Transformer.generate_square_subsequent_mask(T)
        for b in self.blocks:
            h = b(h, src_mask=mask, is_causal=True)
        return self.head(self.ln(h))


torch.manual_seed(a.seed)
cfg = ModelConfig.preset(a.preset)
over = {}
for kv in a.set:
    k, v = kv.split("=", 1)
    over[k] = json.loads(v)
if a.arch in ("decoder_only",):
    over["arch"] = "decoder_only"
if over:
    cfg = cfg.replace(**over)
if a.arch == "gpt":
    model = MiniGPT(cfg.vocab_size, a.gpt_dim, a.gpt_layers, a.gpt_heads, 512)
else:
    model = build_model(cfg)
if a.init:
    model.load_state_dict(torch.load(a.init)["state"])
model.train()
nparam = sum(p.numel() for p in model.parameters())
gen = torch.Generator().manual_seed(1000 + a.seed)
text = None
np_rng = None
if a.filler == "text" or a.layout == "passkey":   # the prepared corpus (data/corpus/train.txt) as filler
    import numpy as np
    from cedlm.data.tokens import token_cache
    from cedlm.text.tokenizer import load_tokenizer
    tokenizer = load_tokenizer()
    text = torch.from_numpy(np.asarray(token_cache("data/corpus/train.txt", tokenizer, build=False)[:2_000_000],
                                       dtype=np.int64))
    np_rng = np.random.default_rng(1000 + a.seed)


def batch(layout=None):
    B, L = a.batch, a.L
    layout = layout or a.layout
    G = int(torch.randint(a.min_gap, a.gap + 1, (1,), generator=gen)) if a.random_gap else a.gap
    if layout == "far":
        return tasks.far(gen, B, L, a.blocks, G, a.lo, a.hi)
    if layout == "recall":
        return tasks.recall(gen, B, a.pairs, G, a.lo, a.hi, text=text)
    if layout == "passkey":
        return tasks.passkey(np_rng, B, a.seq, a.min_gap, text.numpy(), tokenizer, max_gap=a.gap)
    if layout == "fixed":
        blocks = []
        for _ in range(a.blocks):
            r = torch.randint(a.lo, a.hi, (B, L), generator=gen)
            blocks += [r, r]
        seq = torch.cat(blocks, 1)                                   # [B, S]
        off = torch.arange(seq.shape[1]) % (2 * L)
        first = (off < L).expand(B, -1)
        second = (off >= L).expand(B, -1)
    else:
        S = a.seq
        seq = torch.randint(a.lo, a.hi, (B, S), generator=gen)
        first = torch.zeros(B, S, dtype=torch.bool)
        second = torch.zeros(B, S, dtype=torch.bool)
        for b in range(B):
            gap = int(torch.randint(0, a.max_gap + 1, (1,), generator=gen))
            src = int(torch.randint(0, S - 2 * L - gap + 1, (1,), generator=gen))
            at = src + L + gap
            seq[b, at: at + L] = seq[b, src: src + L]
            first[b, src: src + L] = True
            second[b, at: at + L] = True
    # targets y[j] = seq[j+1]; classify by target position
    return seq[:, :-1], seq[:, 1:], first[:, 1:], second[:, 1:]


decay = [p for p in model.parameters() if p.dim() >= 2]
other = [p for p in model.parameters() if p.dim() < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd}, {"params": other, "weight_decay": 0.0}],
                        lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
probe_cls = None
if a.dense_probe:
    from cedlm.model.probe import IndexerProbe
    probe_cls = IndexerProbe
if a.eval_mode:
    model.eval()

info = {"arch": a.arch, "preset": a.preset, "overrides": over, "params": nparam, "args": vars(a)}
print(json.dumps(info), flush=True)
outf = open(a.out, "w") if a.out else None
if outf:
    outf.write(json.dumps(info) + "\n")
t0 = time.time()
acc = {"l1": 0.0, "n1": 0, "l2": 0.0, "n2": 0, "a2": 0.0, "all": 0.0, "k": 0, "gn": 0.0, "ex": 0.0, "rows": 0}
ln_floor = math.log(a.hi - a.lo) if a.layout != "passkey" else None
for step in range(1, a.steps + 1):
    lr = a.lr * min(1.0, step / a.warmup)
    for g in opt.param_groups:
        g["lr"] = lr
    x, y, m1, m2 = batch("fixed" if step <= a.switch_at else None)
    if probe_cls is not None:
        logits = model(x, probe=probe_cls(dense=True))
    else:
        logits = model(x)
    ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view_as(y)
    loss = ce.mean()
    if a.answer_weight:
        loss = loss + a.answer_weight * ce[m2].mean()
    loss.backward()
    gn = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip).item() if a.clip else 0.0
    opt.step()
    opt.zero_grad(set_to_none=True)
    if a.arch != "gpt" and moe_layers(model):         # aux-loss-free balancing, as in training
        update_moe_bias(model, 1e-3, 1)
    with torch.no_grad():
        acc["l1"] += ce[m1].sum().item(); acc["n1"] += int(m1.sum())
        acc["l2"] += ce[m2].sum().item(); acc["n2"] += int(m2.sum())
        hit = logits.argmax(-1) == y
        acc["a2"] += hit[m2].float().sum().item()
        rows = m2.any(1)                        # rows with answer tokens: exact = all of them right
        acc["ex"] += (hit | ~m2).all(1)[rows].float().sum().item(); acc["rows"] += int(rows.sum())
        acc["all"] += loss.item(); acc["k"] += 1; acc["gn"] += gn
    if step % a.log_every == 0 or step == a.steps:
        rec = {"step": step, "first": acc["l1"] / max(acc["n1"], 1), "second": acc["l2"] / max(acc["n2"], 1),
               "second_acc": acc["a2"] / max(acc["n2"], 1),
               "exact_rows": acc["ex"] / max(acc["rows"], 1), "loss": acc["all"] / acc["k"],
               "grad_norm": acc["gn"] / acc["k"], "s_per_step": (time.time() - t0) / step,
               "elapsed": time.time() - t0, "floor": ln_floor}
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()}), flush=True)
        if outf:
            outf.write(json.dumps(rec) + "\n"); outf.flush()
        acc = {k: 0 for k in acc}
    if time.time() - t0 > a.max_minutes * 60:
        print(f"stopped at step {step}: time budget", flush=True)
        break
if a.save:
    torch.save({"cfg_over": over, "preset": a.preset, "arch": a.arch, "args": vars(a), "state": model.state_dict()}, a.save)
