"""Prompt scoring (`SamplingParams.prompt_logprobs`): the prefill logits of every prompt row as
one `TokenLogprob` per prompt position, plain Python values.

`PromptScorer` takes the logits chunk by chunk as the prefill runs them (`PrefillRun`'s
`on_rows`), so that no more than one chunk's logits ([chunk, vocab]) is alive at a time: memory
linear in the prompt. `prompt_logprobs` scores logits of the whole prompt at once (same rows,
same values)."""
from __future__ import annotations

import torch

from cedlm.engine.request import TokenLogprob


class PromptScorer:
    """Scores a prompt from the logits of its rows, given in order, a chunk at a time."""

    def __init__(self, prompt_ids: list[int], k: int):
        self.ids, self.k = list(prompt_ids), int(k)
        self.entries: list[TokenLogprob | None] = [None]
        self.next_row = 0

    @torch.no_grad()
    def add(self, logits: torch.Tensor, first_row: int) -> None:
        """logits [T, vocab] of prompt rows first_row .. first_row + T - 1 (row j predicts
        token j + 1; the last prompt row predicts nothing of the prompt)."""
        if first_row != self.next_row:
            raise RuntimeError(f"prompt_logprobs: rows from {first_row}, expected {self.next_row}")
        P, T = len(self.ids), logits.shape[0]
        self.next_row += T
        n = min(T, P - 1 - first_row)                  # rows that predict a prompt token
        if n <= 0:
            return
        lp = torch.log_softmax(logits[:n].float(), dim=-1)                     # [n, V]
        tgt = torch.tensor(self.ids[first_row + 1: first_row + 1 + n], dtype=torch.long, device=lp.device)
        act = lp.gather(1, tgt[:, None])                                         # [n, 1]
        ranks = ((lp > act).sum(-1) + 1).tolist()
        k = min(self.k, lp.shape[-1])
        tv, ti = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        tv, ti, act = tv.tolist(), ti.tolist(), act[:, 0].tolist()
        for j in range(n):
            self.entries.append(TokenLogprob(self.ids[first_row + 1 + j], act[j], ranks[j], ti[j], tv[j]))

    def result(self) -> list[TokenLogprob | None]:
        if self.next_row != len(self.ids):
            raise RuntimeError(f"prompt_logprobs: {self.next_row} scored rows for a {len(self.ids)}-token prompt")
        return self.entries


@torch.no_grad()
def prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], k: int) -> list[TokenLogprob | None]:
    """Scored prompt from the prefill logits of every prompt row ([P, vocab]; row j predicts
    token j + 1): entry 0 None, entry j the raw logprob, rank and top-k of prompt_ids[j]."""
    P = len(prompt_ids)
    if logits.shape[0] != P:
        raise RuntimeError(f"prompt_logprobs: {logits.shape[0]} scored rows for a {P}-token prompt")
    scorer = PromptScorer(prompt_ids, k)
    scorer.add(logits, 0)
    return scorer.result()
