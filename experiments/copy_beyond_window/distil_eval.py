"""Copy beyond the window: distil the indexer of a copy-trained model, then compare selections.

    python distil_eval.py CHECKPOINT.pt OUT.json [DISTIL_STEPS [GAP]]

CHECKPOINT.pt: saved by train_copy.py --save (its preset and config overrides are in it).
"""
import copy, json, sys, time
import torch
import torch.nn.functional as F
torch.set_num_threads(1)
from cedlm.config import ModelConfig
from cedlm.model import build_model
from cedlm.model.probe import IndexerProbe, distill_kl, topk_recall
from cedlm.train.indexer import indexer_params

ck = torch.load(sys.argv[1])
cfg = ModelConfig.preset(ck["preset"]).replace(**ck["cfg_over"])
model = build_model(cfg)
model.load_state_dict(ck["state"])
model.eval()
init_state = copy.deepcopy(model.state_dict())
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 150
L, BLOCKS, LO, HI, B = 16, 2, 16, 80, 16
GAP = int(sys.argv[4]) if len(sys.argv) > 4 else 48
W = cfg.sliding_window


def batch(g, gap=GAP, blocks=BLOCKS):
    """The far layout of train_copy.py: blocks of [r (L random tokens), filler (gap), r]; the
    copy sits L + gap tokens back, beyond the window. Mask: the second copy's targets except
    its first token (it follows the filler, not predictable)."""
    parts, mask = [], []
    for _ in range(blocks):
        r = torch.randint(LO, HI, (B, L), generator=g)
        parts += [r, torch.randint(LO, HI, (B, gap), generator=g), r]
        mask += [torch.zeros(L + gap + 1, dtype=torch.bool), torch.ones(L - 1, dtype=torch.bool)]
    seq = torch.cat(parts, 1)
    m = torch.cat(mask).expand(B, -1)
    return seq[:, :-1], seq[:, 1:], m[:, 1:]


def evaluate(tag, probe_dense: bool, n=8):
    g = torch.Generator().manual_seed(12345)
    nll = acc = cnt = 0.0
    rec = {}
    with torch.no_grad():
        for _ in range(n):
            x, y, m = batch(g)                              # copy distance L + gap > window
            probe = IndexerProbe(dense=probe_dense)
            logits = model(x, probe=probe)
            ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view_as(y)
            nll += ce[m].sum().item(); acc += (logits.argmax(-1) == y)[m].float().sum().item()
            cnt += int(m.sum())
            if not probe_dense:
                for l, v in topk_recall(probe, cfg.index_topk).items():
                    rec.setdefault(l, []).append(v)
    out = {"row": tag, "copy_acc": acc / cnt, "copy_nll": nll / cnt, "tokens": int(cnt),
           "topk_recall": {l: sum(v) / len(v) for l, v in rec.items()}}
    print(json.dumps(out), flush=True)
    return out


rows = [evaluate("dense: every visible entry", True), evaluate("sparse top-k, indexer at initialisation", False)]
# distillation: the dense warm-up recipe (KL of the indexer's scores to the attention over every
# visible entry), indexer weights only
for p in model.parameters():
    p.requires_grad_(False)
params = indexer_params(model)
for p in params:
    p.requires_grad_(True)
opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
g = torch.Generator().manual_seed(7)
t0 = time.time()
for i in range(1, steps + 1):
    x, y, m = batch(g)
    probe = IndexerProbe(dense=True)
    model(x, probe=probe)
    kl, per = distill_kl(probe, sparse=False)
    kl.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    if i % 25 == 0:
        print(json.dumps({"distil_step": i, "kl": round(kl.item(), 4), "s": round(time.time() - t0, 1)}), flush=True)
main_same = all(torch.equal(v, init_state[k]) for k, v in model.state_dict().items() if ".indexer." not in k)
rows.append(evaluate("sparse top-k, indexer distilled", False))
json.dump({"rows": rows, "distil_steps": steps, "distil_s": time.time() - t0, "main_weights_unchanged": main_same,
           "index_topk": cfg.index_topk, "window": W, "L": L, "gap": GAP, "blocks": BLOCKS}, open(sys.argv[2], "w"), indent=1)
