"""Prompt scoring (`SamplingParams.prompt_logprobs`): the prefill logits of every prompt row as
one `TokenLogprob` per prompt position, plain Python values."""
from __future__ import annotations

import torch

from cedlm.engine.request import TokenLogprob


@torch.no_grad()
def prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], k: int) -> list[TokenLogprob | None]:
    """Scored prompt from the prefill logits of every prompt row ([P, vocab]; row j predicts
    token j + 1): entry 0 None, entry j the raw logprob, rank and top-k of prompt_ids[j]."""
    P = len(prompt_ids)
    if logits.shape[0] != P:
        raise RuntimeError(f"prompt_logprobs: {logits.shape[0]} scored rows for a {P}-token prompt")
    out: list[TokenLogprob | None] = [None]
    if P < 2:
        return out
    lp = torch.log_softmax(logits[:-1].float(), dim=-1)                       # [P-1, V]
    tgt = torch.tensor(prompt_ids[1:], dtype=torch.long, device=lp.device)
    act = lp.gather(1, tgt[:, None])                                           # [P-1, 1]
    ranks = ((lp > act).sum(-1) + 1).tolist()
    k = min(k, lp.shape[-1])
    tv, ti = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    tv, ti, act = tv.tolist(), ti.tolist(), act[:, 0].tolist()
    for j in range(P - 1):
        out.append(TokenLogprob(prompt_ids[j + 1], act[j], ranks[j], ti[j], tv[j]))
    return out
