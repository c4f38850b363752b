"""Held-out chat metrics of the chat stage (`cedlm train chat`), through the serving engine.

The held-out conversations are built from the validation split (`cedlm.train.chat_data`), so no
passage was seen in training. For each, the prompt is every message before the last assistant
turn, rendered by the engine's chat path (`LLM.chat`: the server's encoder), and the reply is
generated twice: greedy, and by plain sampling (temperature 1, top-p 1, seeded; the server's
defaults for the shipped model are gentler: docs/serving.md, "Sampling defaults"). Reported:

- `heldout_loss`: teacher-forced cross-entropy (nats/token) on the reference assistant tokens, EOS
  included;
- `finished_greedy` / `finished_sampled`: fraction of replies that end their turn (EOS, finish
  reason "stop") within `max_tokens`;
- `reply_tokens_greedy` / `reply_tokens_sampled`: mean generated tokens per reply (EOS included);
- `source_accuracy_greedy`: on the `source` questions, the fraction of greedy replies naming the
  right source (`SOURCE_NAMES` keyword) and no other;
- `n_heldout`, `n_source`.
"""
from __future__ import annotations

import torch

from cedlm.engine.llm import LLM
from cedlm.engine.sampling_params import SamplingParams
from cedlm.train.chat_data import EVAL_MAX_TOKENS, SOURCE_NAMES, ChatExample


def named_sources(reply: str) -> set[str]:
    """The sources whose keyword a reply mentions."""
    return {s for s, (_, kw) in SOURCE_NAMES.items() if kw.lower() in reply.lower()}


@torch.no_grad()
def heldout_loss(model, tokenizer, examples: list[ChatExample]) -> float:
    """Mean cross-entropy over the assistant tokens of `examples` (one forward per example)."""
    tot, n = 0.0, 0
    dev = next(model.parameters()).device
    for e in examples:
        ids = torch.tensor([e.ids], device=dev)
        logits = model(ids[:, :-1])[0]
        m = torch.tensor(e.mask[1:], dtype=torch.bool, device=dev)
        ce = torch.nn.functional.cross_entropy(logits[m], ids[0, 1:][m], reduction="sum")
        tot, n = tot + ce.item(), n + int(m.sum())
    return tot / max(1, n)


def generate_replies(model, tokenizer, examples: list[ChatExample], params: SamplingParams) -> list:
    """One engine output per example (its prompt messages, in its thinking mode)."""
    llm = LLM(model, tokenizer, max_num_seqs=max(1, len(examples)), enable_prefix_cache=False)
    outs: list = [None] * len(examples)
    for mode in ("chat", "thinking"):
        idx = [i for i, e in enumerate(examples) if e.thinking_mode == mode]
        if idx:
            got = llm.chat([examples[i].prompt_messages for i in idx], params, thinking_mode=mode)
            for i, o in zip(idx, got):
                outs[i] = o
    return outs


def chat_metrics(model, tokenizer, examples: list[ChatExample], max_tokens: int = EVAL_MAX_TOKENS,
                 seed: int = 0) -> dict:
    """The metrics above for `examples`; the model is left in eval mode."""
    was = model.training
    model.eval()
    out: dict = {"n_heldout": len(examples), "heldout_loss": round(heldout_loss(model, tokenizer, examples), 4)}
    for name, params in (("greedy", SamplingParams(max_tokens=max_tokens, temperature=0.0)),
                         ("sampled", SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=1.0,
                                                    seed=seed))):
        outs = generate_replies(model, tokenizer, examples, params)
        out[f"finished_{name}"] = round(sum(o.finish_reason == "stop" for o in outs) / max(1, len(outs)), 4)
        out[f"reply_tokens_{name}"] = round(sum(len(o.token_ids) for o in outs) / max(1, len(outs)), 2)
        if name == "greedy":
            src = [(e, o) for e, o in zip(examples, outs) if e.source is not None]
            out["n_source"] = len(src)
            if src:
                ok = sum(named_sources(o.text) == {e.source} for e, o in src)
                out["source_accuracy_greedy"] = round(ok / len(src), 4)
    model.train(was)
    return out
