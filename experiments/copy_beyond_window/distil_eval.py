"""Beyond the window: distil the indexer of a copy- or recall-trained model, then compare selections.

    python distil_eval.py CHECKPOINT.pt OUT.json [DISTIL_STEPS [GAP]] [--layout recall|passkey --gaps 0 32 64 96]

CHECKPOINT.pt: saved by train_copy.py --save (its preset, config overrides and args are in it).
Rows: dense selection (every visible entry), sparse top-k with the indexer at initialisation, and
sparse top-k after distilling the indexer (`cedlm train indexer`'s phase 1, indexer weights only).
Layout "far" (default) scores the second copy of the far layout at GAP; "recall" scores the
query part's values at each of --gaps (filler as the checkpoint was trained with); "passkey"
scores the answer of a passkey item in corpus text at each gap setting of --gaps (`tasks.passkey`:
about 0.9 x the setting in filler tokens between record and query; validation text; distillation
on training text, gaps drawn as in the checkpoint's run).
"""
import argparse, copy, json, os, sys, time
import numpy as np
import torch
import torch.nn.functional as F
torch.set_num_threads(1)
from cedlm.config import ModelConfig
from cedlm.model import build_model
from cedlm.model.probe import IndexerProbe, distill_kl, topk_recall
from cedlm.train.indexer import indexer_params

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tasks

ap = argparse.ArgumentParser()
ap.add_argument("ckpt"); ap.add_argument("out")
ap.add_argument("steps", nargs="?", type=int, default=150)
ap.add_argument("gap", nargs="?", type=int, default=48)
ap.add_argument("--layout", default="far", choices=["far", "recall", "passkey"])
ap.add_argument("--gaps", type=int, nargs="*", default=None, help="recall: filler lengths scored (default: GAP)")
ap.add_argument("--batches", type=int, default=8)
ap.add_argument("--save-checkpoints", metavar="DIR", default=None,
                help="write DIR/init (the model as trained, indexer at initialisation) and DIR/distilled "
                     "as cedlm checkpoints, for `cedlm eval fidelity / ablate --model DIR/...`")
ap.add_argument("--filler", default=None, choices=["random", "text"], help="recall: default as the checkpoint was trained")
ap.add_argument("--pairs", type=int, default=None, help="recall: default as the checkpoint was trained, else 8")
ap.add_argument("--train-gaps", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                help="recall: distillation batches draw their gap in MIN..MAX (default: the checkpoint's run, else GAP)")
args = ap.parse_args()
ck = torch.load(args.ckpt)
cfg = ModelConfig.preset(ck["preset"]).replace(**ck["cfg_over"])
model = build_model(cfg)
model.load_state_dict(ck["state"])
model.eval()
init_state = copy.deepcopy(model.state_dict())
steps = args.steps
L, BLOCKS, LO, HI, B = 16, 2, 16, 80, 16
GAP = args.gap
GAPS = args.gaps or [GAP]
W = cfg.sliding_window
targs = ck.get("args", {})
text = None
if args.filler:
    targs["filler"] = args.filler
if args.pairs:
    targs["pairs"] = args.pairs
if args.train_gaps:
    targs.update(min_gap=args.train_gaps[0], gap=args.train_gaps[1], random_gap=True)
np_rng = [None]
if args.layout == "passkey" or (args.layout == "recall" and targs.get("filler") == "text"):
    from cedlm.data.tokens import token_cache
    from cedlm.text.tokenizer import load_tokenizer
    # held-out filler: the validation split (training drew from train.txt)
    tokenizer = load_tokenizer()
    text = torch.from_numpy(np.asarray(token_cache("data/corpus/val.txt", tokenizer, build=True), dtype=np.int64))
PAIRS = targs.get("pairs", 8)


def batch(g, gap=GAP):
    if args.layout == "passkey":
        x, y, _, m = tasks.passkey(np_rng[0], B, targs.get("seq", 128), gap, text.numpy(), tokenizer, max_gap=gap)
        return x, y, m
    if args.layout == "recall":
        x, y, _, m = tasks.recall(g, B, PAIRS, gap, LO, HI, text=text)
        return x, y, m
    x, y, _, m = tasks.far(g, B, L, BLOCKS, gap, LO, HI, skip_first=True)
    return x, y, m


def evaluate(tag, probe_dense: bool, n=args.batches):
    out = {"row": tag, "by_gap": {}}
    for gap in GAPS:
        g = torch.Generator().manual_seed(12345)
        np_rng[0] = np.random.default_rng(12345) if args.layout == "passkey" else None
        nll = acc = cnt = exact = rows_n = 0.0
        rec = {}
        with torch.no_grad():
            for _ in range(n):
                x, y, m = batch(g, gap)
                probe = IndexerProbe(dense=probe_dense)
                logits = model(x, probe=probe)
                ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view_as(y)
                nll += ce[m].sum().item(); acc += (logits.argmax(-1) == y)[m].float().sum().item()
                cnt += int(m.sum())
                hit, rows_m = logits.argmax(-1) == y, m.any(1)    # exact: every answer token of an item right
                exact += (hit | ~m).all(1)[rows_m].float().sum().item(); rows_n += int(rows_m.sum())
                if not probe_dense:
                    for l, v in topk_recall(probe, cfg.index_topk).items():
                        rec.setdefault(l, []).append(v)
        out["by_gap"][gap] = {"acc": acc / cnt, "nll": nll / cnt, "tokens": int(cnt),
                              "exact": exact / max(rows_n, 1), "items": int(rows_n),
                              "topk_recall": {l: sum(v) / len(v) for l, v in rec.items()}}
    first = out["by_gap"][GAPS[0]]
    out.update(copy_acc=first["acc"], copy_nll=first["nll"], tokens=first["tokens"], topk_recall=first["topk_recall"])
    print(json.dumps(out), flush=True)
    return out


def save_checkpoint(name):
    if args.save_checkpoints:
        from cedlm.checkpoint import save_checkpoint as save
        from cedlm.text.tokenizer import load_tokenizer
        save(os.path.join(args.save_checkpoints, name), model, load_tokenizer(),
             training_args={"experiment": "copy_beyond_window", "from": args.ckpt, "indexer": name,
                            "distil_steps": steps if name == "distilled" else 0, "layout": args.layout})


save_checkpoint("init")
rows = [evaluate("dense: every visible entry", True), evaluate("sparse top-k, indexer at initialisation", False)]
# distillation: the dense warm-up recipe (KL of the indexer's scores to the attention over every
# visible entry), indexer weights only; training batches draw the gap like the checkpoint's run
for p in model.parameters():
    p.requires_grad_(False)
params = indexer_params(model)
for p in params:
    p.requires_grad_(True)
opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
g = torch.Generator().manual_seed(7)
np_rng[0] = np.random.default_rng(7) if args.layout == "passkey" else None
if text is not None:          # distil on training text, score on validation text
    val_text = text
    text = torch.from_numpy(np.asarray(token_cache("data/corpus/train.txt", load_tokenizer(), build=False)[:2_000_000],
                                       dtype=np.int64))
t0 = time.time()
for i in range(1, steps + 1):
    gap = int(torch.randint(targs.get("min_gap", GAP), targs.get("gap", GAP) + 1, (1,), generator=g)) \
        if (args.layout == "recall" and targs.get("random_gap")) or args.layout == "passkey" else GAP
    x, y, m = batch(g, gap)
    probe = IndexerProbe(dense=True)
    model(x, probe=probe)
    kl, per = distill_kl(probe, sparse=False)
    kl.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    if i % 25 == 0:
        print(json.dumps({"distil_step": i, "kl": round(kl.item(), 4), "s": round(time.time() - t0, 1)}), flush=True)
if text is not None:
    text = val_text
main_same = all(torch.equal(v, init_state[k]) for k, v in model.state_dict().items() if ".indexer." not in k)
rows.append(evaluate("sparse top-k, indexer distilled", False))
save_checkpoint("distilled")
json.dump({"rows": rows, "distil_steps": steps, "distil_s": time.time() - t0, "main_weights_unchanged": main_same,
           "index_topk": cfg.index_topk, "window": W, "layout": args.layout, "gaps": GAPS, "pairs": PAIRS,
           "L": L, "gap": GAP, "blocks": BLOCKS}, open(args.out, "w"), indent=1)
