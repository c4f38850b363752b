"""The first two phases of `cedlm train vision`: anchors, then the tower regressed onto them.

Training the tower end to end through a frozen text model costs a full forward and backward of
the text model per example; on a shared CPU that allows a few hundred steps in the time budget.
So the run starts with two cheap phases (the last phase is end to end, `cedlm.train.vision`):

A. anchors: for every answer class (a digit, a word) learn the image rows `A[c]` ([n_llm, D]) and
   the shared image_start / image_newline / image_end rows such that the frozen text model,
   given the prompt with the span [start, A[c] rows with newlines, end], answers c. One
   sequence per class per step: the text model runs over classes, not over images.
B. regression: train the ViT + aligner so that the aligner rows of an image of class c approach
   A[c] (mean squared error relative to the anchors' scale, plus a cross-entropy over the
   negative distances to every class's anchor, which separates the classes first; no text model
   in the loop): thousands of images per minute.

The tower then starts phase C already reading the images; C corrects what regression missed.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from cedlm.model.vision import span_embeds


class Anchors:
    """Per-class image rows of one task (all its images share one grid)."""

    def __init__(self, model, examples):
        self.ex = examples
        first: dict[str, int] = {}
        for i, r in enumerate(examples.rows):
            first.setdefault(r[4], i)
        self.classes = sorted(first)
        self.rep = [first[c] for c in self.classes]              # one example row per class
        self.index = {c: k for k, c in enumerate(self.classes)}
        im = examples.rows[0][3]
        self.vit_grid, self.llm_grid = im.vit_grid, im.llm_grid
        if any(r[3].llm_grid != self.llm_grid for r in examples.rows):
            raise ValueError("anchors: a task's images must share one grid")
        n = self.llm_grid[0] * self.llm_grid[1]
        scale = model.embed.weight.detach().std()
        draw = torch.randn(len(self.classes), n, model.cfg.hidden_size, device="cpu")   # host draw
        self.rows = torch.nn.Parameter(draw.to(model.device) * scale)

    def loss(self, model, classes: list[int]) -> tuple[torch.Tensor, float]:
        """(LM loss of the answers given the anchor spans of `classes`, share of answers whose
        every token is the argmax)."""
        ids, mask, rows = self.ex.batch([self.rep[c] for c in classes], model.device)
        lh, lw = self.llm_grid
        imgs = [[(r[1], span_embeds(self.rows[c], lh, lw, model.image_start, model.image_newline,
                                    model.image_end))] for c, r in zip(classes, rows)]
        logits = model(ids, images=imgs)
        m = mask[:, 1:]
        hit = (logits[:, :-1].argmax(-1) == ids[:, 1:]) | ~m
        return F.cross_entropy(logits[:, :-1][m], ids[:, 1:][m]), hit.all(1).float().mean().item()

    def targets(self, idx: list[int]) -> torch.Tensor:
        return self.rows.detach()[[self.index[self.ex.rows[i][4]] for i in idx]]


def train_anchors(model, anchors: dict[str, Anchors], seconds: float, batch: int, lr: float, log,
                  rng, min_loss: float = 0.05, order: list[str] | None = None) -> int:
    """Phase A: until every task's loss is below `min_loss` or the time is up; returns steps.
    `order`: the task schedule, cycled (a task may appear more than once)."""
    shared = [model.image_start, model.image_newline, model.image_end]
    opt = torch.optim.Adam([a.rows for a in anchors.values()] + shared, lr=lr)
    t0, step, last = time.monotonic(), 0, {k: 9.0 for k in anchors}
    names = order or list(anchors)
    model.train()
    try:
        while time.monotonic() - t0 < seconds and max(last.values()) > min_loss:
            todo = [n for n in names if last[n] > min_loss]
            name = todo[step % len(todo)]
            a = anchors[name]
            k = min(batch, len(a.classes))
            loss, acc = a.loss(model, rng.sample(range(len(a.classes)), k))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            last[name] = loss.item()
            step += 1
            log({"phase": "anchors", "step": step, "task": name, "loss": round(last[name], 5), "acc": acc,
                 "elapsed_s": round(time.monotonic() - t0, 1)})
    finally:
        model.eval()
    return step


def train_regression(model, anchors: dict[str, Anchors], seconds: float, batch: int, lr: float, log,
                     rng) -> int:
    """Phase B: ViT + aligner rows -> the anchor rows of each image's class (MSE)."""
    params = list(model.vision.parameters()) + list(model.aligner.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    t0, step = time.monotonic(), 0
    names = list(anchors)
    while time.monotonic() - t0 < seconds:
        name = names[step % len(names)]
        a = anchors[name]
        idx = [rng.randrange(len(a.ex.rows)) for _ in range(batch)]
        patches = torch.stack([a.ex.rows[i][3].patches for i in idx]).to(model.device, non_blocking=True)
        n_h, n_w = a.vit_grid
        rows = model.aligner(model.vision(patches, n_h, n_w), n_h, n_w)
        tgt = a.targets(idx)
        scale = a.rows.detach().pow(2).mean()
        loss = F.mse_loss(rows, tgt) / scale
        d = (rows.flatten(1)[:, None] - a.rows.detach().flatten(1)[None]).pow(2).mean(-1) / scale
        cls = torch.tensor([a.index[a.ex.rows[i][4]] for i in idx], device=d.device)
        loss = loss + F.cross_entropy(-d * 10, cls)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 20 in (0, 1):
            log({"phase": "regression", "step": step, "task": name, "loss": round(loss.item(), 5),
                 "elapsed_s": round(time.monotonic() - t0, 1)})
    return step


def train_codes(model, anchors: Anchors, seconds: float, batch: int, lr: float, log, rng) -> int:
    """Phase B' (instead of B for a task whose classes x rows fit the aligner width): the aligner
    hidden channel k*n + p (class k, span row p) becomes the code of "class k at row p". The ViT
    and `aligner.w1` learn, row by row, a cross-entropy over all K*n code channels (so a row lights
    its own code and no other);
    then `aligner.w2` (and its bias) is solved by ridge regression of the anchor rows on the
    GELU features of training images. The text model is not in the loop."""
    n = anchors.rows.shape[1]
    K = len(anchors.classes)
    D = model.aligner.w2.weight.shape[1]
    if K * n > D:
        raise ValueError(f"codes: {K} classes x {n} rows exceed the aligner width {D}")
    dev = model.device
    chan = torch.arange(K, device=dev)[:, None] * n + torch.arange(n, device=dev)[None]   # [K, n]
    params = list(model.vision.parameters()) + list(model.aligner.w1.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    n_h, n_w = anchors.vit_grid
    rows_ = anchors.ex.rows
    t0, step = time.monotonic(), 0

    def hidden(idx):
        patches = torch.stack([rows_[i][3].patches for i in idx]).to(dev, non_blocking=True)
        from cedlm.model.vision import unfold_3x3
        return model.aligner.w1(unfold_3x3(model.vision(patches, n_h, n_w), n_h, n_w, model.aligner.r))

    while time.monotonic() - t0 < seconds:
        idx = [rng.randrange(len(rows_)) for _ in range(batch)]
        h = hidden(idx)                                                   # [B, n, D]
        cls = torch.tensor([anchors.index[rows_[i][4]] for i in idx], device=dev)
        # over every code channel: row p of class k must light k*n + p and no other code
        target = (cls[:, None] * n + torch.arange(n, device=dev)[None]).flatten()
        loss = F.cross_entropy(h[..., : K * n].reshape(-1, K * n), target)
        logits = h[:, torch.arange(n, device=dev)[:, None], chan.t()]      # [B, n, K]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if step % 10 == 0:
            acc = (logits.mean(1).argmax(-1) == cls).float().mean().item()
            log({"phase": "codes", "step": step, "loss": round(loss.item(), 5), "batch_acc": acc,
                 "elapsed_s": round(time.monotonic() - t0, 1)})
    with torch.no_grad():             # aligner.w2 by ridge regression onto the anchor rows
        feats, tgts = [], []
        for s in range(0, min(len(rows_), 1024), 64):
            idx = list(range(s, min(s + 64, len(rows_))))
            feats.append(F.gelu(hidden(idx)).reshape(-1, D))
            tgts.append(anchors.targets(idx).reshape(-1, anchors.rows.shape[-1]))
        X, Y = torch.cat(feats).double(), torch.cat(tgts).double()
        X = torch.cat((X, torch.ones(X.shape[0], 1, dtype=X.dtype, device=X.device)), 1)
        W = torch.linalg.solve(X.t() @ X + 1e-3 * torch.eye(X.shape[1], dtype=X.dtype, device=X.device),
                               X.t() @ Y)
        model.aligner.w2.weight.copy_(W[:-1].t().float())
        model.aligner.w2.bias.copy_(W[-1].float())
        rel = ((X @ W - Y).pow(2).mean() / Y.pow(2).mean()).item()
        log({"phase": "codes_w2", "relative_mse": round(rel, 5), "samples": X.shape[0]})
    return step
