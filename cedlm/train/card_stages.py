"""The model card's stage sections (`cedlm.train.model_card`), each generated from its summary.json keys.

    joint_pretraining   `joint_*`: one run of `cedlm train pretrain --mixture` in stages (text, chat and
                        retrieval from step 0), its retrieval by context length and the targets
    chat_stage          `chat_*` with `chat_steps`: the supervised chat stage (`cedlm train chat`)
    component_stages    `indexer_*`, `dspark_*`, `vision_*`: the distilled indexer, the DSpark drafter
                        (`mtp.safetensors`) and the vision tower (`vision.safetensors`)

A section whose keys are absent is left out, so a card lists only the stages its model went through.
"""
from __future__ import annotations

import json


# summary.json keys the sections above print as tables: the card's list of every value points there
TABLED = {"joint_curve_points": "(the \"Training curves\" table above)",
          "joint_sweep": "(the \"Scaling sweep\" table above)"}


def val(v) -> str:
    """One recorded value as the card prints it."""
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (list, dict)):
        return "`" + json.dumps(v, ensure_ascii=False) + "`"
    return f"`{v}`" if isinstance(v, str) else str(v)


def _share(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _count(share, n: int) -> str:
    """A share of n items as 'k / n'."""
    return "-" if share is None else f"{round(share * n)} / {n}"


def joint_pretraining(summary: dict) -> list[str]:
    """The joint pretraining run: its stages (mixture, curriculum, tokens, wall time), the held-out
    chat and retrieval metrics, and each target with what was measured."""
    s = summary
    stages = s.get("joint_stages")
    if not stages:
        return []
    L = ["", "## Joint pretraining", "",
         "One `cedlm train pretrain --mixture` run from random initialisation, continued in stages "
         "(`--init-from` the previous stage's weights, each stage with its own mixture file): corpus text, "
         "chat conversations in the V4.1 encoding (loss on the assistant's tokens) and retrieval items in "
         "text (one answerable passkey or key-value record per row, queried at least two sliding windows "
         "later) from step 0, a sequence-length curriculum, the lightning indexer distilled as it trains "
         "(dense selection, then sparse), FP4 / FP8 quantisation-aware throughout.", "",
         "| stage | mixture (rows: corpus / chat / retrieval / repeat) | answers weighted | sequence lengths "
         "| steps | tokens | wall time | threads |",
         "|---|---|---|---|---|---|---|---|"]
    for st in stages:
        w = st.get("weights", {})
        mix = " / ".join(_share(w.get(k)) for k in ("corpus", "chat", "retrieval", "repeat"))
        L.append(f"| {st['stage']} | `{st.get('mixture', '-')}`: {mix} | x{st.get('answer_weight', 1):g} "
                 f"| {' → '.join(str(x) for x in st.get('seq_lens', []))} | {st['steps']:,} "
                 f"| {st['tokens']:,} | {st['wall_s'] / 3600:.2f} h | {st.get('threads', '-')} |")
    tokens = sum(st["tokens"] for st in stages)
    wall = sum(st["wall_s"] for st in stages)
    L += ["", f"In all: {tokens:,} tokens, {wall / 3600:.2f} hours"
          + (f" on {s['joint_machine']}" if s.get("joint_machine") else "") + "."]
    if s.get("heldout_bits_per_byte") is not None:
        L += ["", f"Held-out English the model never trained on (`{s.get('heldout_text')}`): "
              f"{s['heldout_bits_per_byte']:.3f} bits/byte"
              + (f" (bzip2 -9: {s['bzip2_heldout_bits_per_byte']:.3f})"
                 if s.get("bzip2_heldout_bits_per_byte") is not None else "") + "."]
    if "chat_finished_greedy" in s:
        n, ns = s.get("chat_heldout_n"), s.get("chat_source_n")
        L += ["", f"Held-out chat ({n} conversations built from the validation split, replies of at most "
              f"{s.get('chat_eval_max_tokens', '?')} tokens): {s['chat_finished_greedy']:.0%} of the greedy "
              f"replies end their turn ({s.get('chat_finished_sampled', 0):.0%} sampled at temperature 1), "
              f"source questions right {round(s.get('chat_source_accuracy_greedy', 0) * (ns or 0))} / {ns}, "
              f"reference-reply cross-entropy {val(s.get('chat_heldout_loss'))} nats/token."]
    rows = s.get("joint_passkey") or []
    if rows:
        L += ["", "Passkey retrieval beyond the window, in text (`cedlm eval fidelity --retrieval-kinds passkey`; "
              "the shipped sparse configuration; exact = every answer token the argmax under teacher forcing):",
              "", "| context tokens | items | exact, trained indexer | exact, indexer at initialisation "
              "| answer tokens right, trained / at initialisation |", "|---|---|---|---|---|"]
        L += [f"| {r['length']:,} | {r['n']} | {_count(r['exact'], r['n'])} | {_count(r.get('exact_init'), r['n'])} "
              f"| {_share(r.get('token_acc'))} / {_share(r.get('token_acc_init'))} |" for r in rows]
    targets = s.get("joint_targets") or []
    if targets:
        L += ["", "Targets of the joint pretraining run and what this model measures:", "",
              "| target | goal | measured | | why, where missed |", "|---|---|---|---|---|"]
        L += [f"| {t['target']} | {t['goal']} | {t['measured']} | {'met' if t['met'] else '**missed**'} "
              f"| {t.get('why', '')} |" for t in targets]
    if s.get("joint_notes"):
        L += [""] + [f"- {n}" for n in s["joint_notes"]]
    L += _curve_points(s.get("joint_curve_points") or [], s.get("joint_curves"))
    L += _sweep(s.get("joint_sweep"))
    return L


def _curve_points(points: list[dict], plot: str | None) -> list[str]:
    """The run's curves at its validation steps, stage after stage."""
    if not points:
        return ["", f"Training curves: `{plot}` in the cedlm repository."] if plot else []
    L = ["", "### Training curves", "",
         "At every validation step of the run (step and tokens counted from the first stage; training loss: "
         "the logged step's, over the mixture; held-out retrieval: answer tokens right / items exact, at the "
         "length shown, under teacher forcing, with the selection of that moment)"
         + (f"; plotted in `{plot}` of the cedlm repository" if plot else "") + ":", "",
         "| stage | step | tokens | sequence length | selection | training loss | validation perplexity (256) "
         "| held-out retrieval: answer tokens / exact (length) |", "|---|---|---|---|---|---|---|---|"]
    for p in points:
        ret = ("-" if p.get("retrieval_acc") is None else
               f"{p['retrieval_acc']:.2f} / {p['retrieval_exact']:.2f} ({p['retrieval_len']:,})")
        L.append(f"| {p['stage']} | {p['step']:,} | {p['tokens']:,} | {p.get('seq_len', '-')} | {p.get('phase', '-')} "
                 f"| {p['loss']:.3f} | {p['val_ppl']:.1f} | {ret} |")
    return L


def _sweep(sw: dict | None) -> list[str]:
    """The width sweep (experiments/joint_pretraining/sweep.py): each width from scratch, same tokens."""
    if not sw:
        return []
    L = ["", "### Scaling sweep", "",
         f"The shipped config at {len(sw['rows'])} widths (hidden size W; moe_intermediate, q_lora and o_lora "
         f"ranks W / 2; depth, heads, KV geometry, experts and Engram tables as shipped), each trained from "
         f"scratch on the first stage's mixture for {sw['steps']} steps of {sw['batch_tokens']:,} tokens "
         f"(its own warm-up and cosine decay), one after another on {sw['threads']} threads of this machine. "
         f"Training loss at equal time: each run's mean over its last 10 logged steps by "
         f"{sw['equal_time_s']:.0f} s, when the fastest run ended.", "",
         "| width | parameters | active per token | tokens | tokens/s | training time | validation perplexity (256) "
         f"| training loss at {sw['equal_time_s']:.0f} s |", "|---|---|---|---|---|---|---|---|"]
    for r in sw["rows"]:
        L.append(f"| {r['width']} | {r['params']['total'] / 1e6:.1f}M | {r['params']['active_decode'] / 1e6:.1f}M "
                 f"| {r['tokens']:,} | {r['tokens_per_s']:.0f} | {r['train_s'] / 60:.1f} min | {r['val_ppl']:.1f} "
                 f"| {r['train_loss_at_fastest_s']:.3f} |")
    if sw.get("conclusion"):
        L += ["", sw["conclusion"]]
    if sw.get("command"):
        L += ["", f"Reproduce: `{sw['command']}`"]
    return L


# summary.json keys of the chat stage (`cedlm train chat`, cedlm.train.chat_eval) -> description
_CHAT_ROWS = [
    ("heldout_loss", "cross-entropy of the reference replies (nats/token)"),
    ("finished_greedy", "replies that end their turn (EOS) within the budget, greedy"),
    ("finished_sampled", "replies that end their turn within the budget, temperature 1"),
    ("reply_tokens_greedy", "mean reply length in tokens, greedy"),
    ("reply_tokens_sampled", "mean reply length in tokens, temperature 1"),
    ("source_accuracy_greedy", "source questions answered with the right source, greedy"),
]


def chat_stage(summary: dict) -> list[str]:
    """The chat stage's section: what it trained and its held-out metrics before / after."""
    if "chat_steps" not in summary:
        return []
    s = summary
    L = ["", "## Chat stage", "",
         f"A supervised stage (`cedlm train chat`) on top of the pretrained model: {s['chat_steps']} steps of "
         f"{s.get('chat_rows_per_step')} rows of up to {s.get('chat_max_len')} tokens, "
         f"{s.get('chat_assistant_tokens', 0):,} assistant tokens from {s.get('chat_train_conversations', 0):,} "
         "conversations built from the training split (which source a quote is from, which book of the Bible, "
         "the next sentence of a passage, what a standard-library function does from its docstring, greetings; "
         "some multi-turn, with a system prompt, or in thinking mode), rendered with the V4.1 chat encoding; "
         "the loss covers the assistant tokens and the EOS ending each turn. "
         f"{s.get('chat_text_fraction_rows', 0):.0%} of the rows ({s.get('chat_text_fraction_tokens', 0):.0%} of "
         "the loss tokens) are plain corpus text with the pretraining loss."]
    if any(f"chat_after_{k}" in s for k, _ in _CHAT_ROWS):
        n = s.get("chat_after_n_heldout")
        L += ["", f"Held-out chat metrics on {n} conversations built from the validation split "
              f"(replies of at most {s.get('chat_eval_max_tokens', '?')} tokens):", "",
              "| metric | before | after |", "|---|---|---|"]
        L += [f"| {d} | {val(s.get(f'chat_before_{k}', '-'))} | {val(s.get(f'chat_after_{k}', '-'))} |"
              for k, d in _CHAT_ROWS if f"chat_after_{k}" in s]
    return L


def component_stages(summary: dict) -> list[str]:
    """The stages after pretraining and chat: the distilled lightning indexer (in the main weights,
    `cedlm train indexer`), then those that add a component file beside the main weights: the DSpark drafter
    (`mtp.safetensors`, `cedlm train dspark`) and the vision tower (`vision.safetensors`,
    `cedlm train vision`), from their summary keys."""
    s, L = summary, []
    if "indexer_steps" in s:
        L += ["", "## Lightning indexer (distilled)", "",
              f"`cedlm train indexer` (dense warm-up, indexer weights only; the other weights are unchanged): "
              f"{s['indexer_steps']} steps of {s.get('indexer_seq_len')}-token sequences in "
              f"{val(s.get('indexer_wall_s'))} s. KL of the indexer's scores to the main attention "
              f"{val(s.get('indexer_kl_start'))} -> {val(s.get('indexer_kl_end'))} nats. Against dense BF16 "
              f"attention at {s.get('indexer_fidelity_len')} tokens, the shipped sparse configuration's KL is "
              f"{val(s.get('indexer_fidelity_kl_before'))} nats with the indexer at initialisation and "
              f"{val(s.get('indexer_fidelity_kl'))} distilled (top-1 agreement "
              f"{val(s.get('indexer_fidelity_top1_before'))} -> {val(s.get('indexer_fidelity_top1'))}; "
              "the repository's FIDELITY.md has the full table)."]
    if "dspark_steps" in s:
        L += ["", "## DSpark drafter (`mtp.safetensors`)", "",
              f"`cedlm train dspark`: the target frozen, {s['dspark_steps']} drafter updates in "
              f"{val(s.get('dspark_minutes'))} min, distilled on the target's own outputs; mean accepted run "
              f"length while training {val(s.get('dspark_accepted_run'))} of {s.get('dspark_block_size', 5)} drafts. "
              "Use it with `cedlm serve --speculative` / `LLM(..., speculative=\"dspark\")`; greedy output "
              "is the plain decode's except where two tokens tie within float rounding (see the repository's "
              "BENCHMARKS.md for acceptance and speed-up)."]
    if "vision_params" in s:
        L += ["", "## Vision tower (`vision.safetensors`)", "",
              f"`cedlm train vision`: a {s['vision_params']:,}-parameter ViT and aligner trained with the text "
              f"model frozen, on scikit-learn's digits and words rendered with Pillow. Held out: digits "
              f"{val(s.get('vision_digits_heldout_acc'))} ({s.get('vision_digits_heldout_n')} images), words "
              f"{val(s.get('vision_words_heldout_acc'))} ({s.get('vision_words_heldout_n')} images)"
              + (f", after {s['vision_runs']} runs (commands above)" if s.get("vision_runs") else "")
              + (": it reads handwritten digits and cannot read words."
                 if (s.get("vision_digits_heldout_acc") or 0) >= 0.9 else
                 ": it tells some digits apart and cannot read words.")]
    return L
