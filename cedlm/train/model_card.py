"""The HF-style text files of an exported model directory, generated from the checkpoint's metadata.

    generation_config.json   bos/eos/pad ids and cedlm's sampling defaults (`generation_config`)
    README.md                the model card (`model_card`): architecture and parameter counts from
                             config.json, training settings from training_args.json, the measured
                             numbers from summary.json, the corpus and its licenses from
                             `cedlm.data.sources`; nothing in it is typed by hand
    tokenizer_config.json    written by `Tokenizer.save` (chat template, BOS handling)

`cedlm export` writes them (`write_model_files`), so a re-trained model gets a matching card.
`expected_files(model_dir)` regenerates all three from a directory's own files (the test compares
the shipped `cedlm/assets/model` with it); `python -m cedlm.train.model_card DIR` rewrites them.

A chat stage that wants the card to say so records it in summary.json under a key starting with
"chat" or "sft"; the card then lists those values and drops the "no chat fine-tune" limitation.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from cedlm.config import ModelConfig
from cedlm.config.params import param_counts
from cedlm.train.card_stages import TABLED, chat_stage, component_stages, joint_pretraining, val

# The sampling defaults of a request that sets none: `cedlm serve`, vLLM and transformers'
# generate() read them from this file. Temperature 0.3 with top_p 0.9 gave the small chat model its
# best held-out replies (docs/serving.md, "Sampling defaults"; plain sampling at temperature 1 is
# noise from a model this size). A request without a length limit stops after
# DEFAULT_MAX_NEW_TOKENS: the shipped model rarely emits EOS by itself as a plain-text completer.
DEFAULT_MAX_NEW_TOKENS = 256
GENERATION_DEFAULTS = {"do_sample": True, "temperature": 0.3, "top_p": 0.9, "top_k": 0}
DEFAULT_CORPUS = "data/corpus"           # cedlm.data.corpus.DEFAULT_OUT

FORMATS = {
    "bf16": "BF16 safetensors (`model.safetensors`; cedlm's lean layout, `cedlm export --format bf16`)",
    "official": "the official DeepSeek-V4.1 layout: FP8 block-scaled and packed-FP4 expert weights in "
                "sharded safetensors with `model.safetensors.index.json` and `quantization_config` "
                "(`cedlm export --format official`)",
}


def generation_config(cfg: ModelConfig, tokenizer=None) -> dict:
    """generation_config.json: the special-token ids (the tokenizer's, else the config's) and defaults."""
    ids = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
    if tokenizer is not None:
        ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    return {**ids, **GENERATION_DEFAULTS, "max_new_tokens": DEFAULT_MAX_NEW_TOKENS}


# ----------------------------------------------------------------------------- the card

def _m(n: int) -> str:
    return f"{n:,} ({n / 1e6:.2f}M)"


def _chat_keys(summary: dict) -> list[str]:
    return [k for k in summary if k.startswith(("chat", "sft"))]


def _architecture(cfg: ModelConfig, counts: dict, tokenizer_name: str | None, vocab: int,
                  drafter: bool = False) -> list[str]:
    n = cfg.n_layers
    ratios = cfg.compress_ratios[:n]
    swa = sum(1 for r in ratios if r == 0)
    enc = [i for i in range(min(cfg.decoder_start, n)) if ratios[i] > 0]
    enc_ratios = sorted({ratios[i] for i in enc})
    dec = cfg.n_decoder_layers
    rope = cfg.rope_scaling or {}
    rows = [
        ("architecture", f"`DeepseekV41ForCausalLM` (`model_type` `deepseek_v41`), cedlm arch `{cfg.arch}`"),
        ("parameters", f"{_m(counts['total'])} in total, of which {_m(counts['engram'])} are Engram tables; "
                       f"{_m(counts['active_decode'])} active per decoded token"),
        ("layers", f"{n}: {swa} sliding-window only, {len(enc)} encoder (compressed sparse attention, ratio "
                   f"{'/'.join(map(str, enc_ratios)) or '-'}), {dec} decoder (reading the shared global KV)"),
        ("width", f"hidden size {cfg.hidden_size}; {cfg.num_attention_heads} query heads, "
                  f"{cfg.num_key_value_heads} KV head(s), head dim {cfg.head_dim} (RoPE {cfg.qk_rope_head_dim})"),
        ("MoE", f"{cfg.n_routed_experts} routed experts (top-{cfg.num_experts_per_tok}) + {cfg.n_shared_experts} "
                f"shared, expert width {cfg.moe_intermediate_size}, scoring `{cfg.scoring_func}`"),
        ("attention", f"sliding window {cfg.sliding_window}; lightning indexer top-{cfg.index_topk}"),
        ("Engram", f"layers {list(cfg.engram_layer_ids)}, n-grams up to {cfg.engram_max_ngram_size}, "
                   f"token map `{cfg.engram_token_map}`"),
        ("mHC", f"{cfg.hc_mult} residual streams"),
        ("vocabulary", f"{vocab:,} tokens" + (f" (`{tokenizer_name}`)" if tokenizer_name else "")
                       + f"; BOS {cfg.bos_token_id}, EOS {cfg.eos_token_id}, PAD {cfg.pad_token_id}"),
        ("positions", f"{cfg.max_position_embeddings:,}"
                      + (f" (YaRN x{rope.get('factor')} from {rope.get('original_max_position_embeddings'):,})"
                         if rope.get("rope_type") == "yarn" else "")),
        ("KV cache", f"main `{cfg.main_kv_format}`, index keys `{cfg.index_kv_format}`, window "
                     f"`{cfg.window_kv_format}`; training rounds the stored KV through the same formats "
                     "(straight-through), so the model is quantisation-aware from step 0"),
    ]
    if cfg.num_nextn_predict_layers:
        block = (f"the DSpark / MTP block (`num_nextn_predict_layers` {cfg.num_nextn_predict_layers}, "
                 f"{_m(counts['dspark'])})")
        rows.append(("DSpark drafter", f"{block}, trained by cedlm (`cedlm train dspark`, below) and shipped "
                                       "as `mtp.safetensors`") if drafter else
                    ("not included", f"{block} is not in this checkpoint (`cedlm train dspark` trains one)"))
    return ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]


def _training(args: dict, summary: dict) -> list[str]:
    if not args and not summary:
        return ["No training_args.json or summary.json was found with this checkpoint."]
    a = {**summary, **args}
    out = []
    steps, bs, sl = a.get("steps"), a.get("batch_size"), a.get("seq_len")
    joint = summary.get("joint_stages")
    if joint:
        out.append(f"- {len(joint)} stages of one joint run ({summary.get('tokens', 0):,} tokens), from random "
                   "initialisation" + (f", preset `{a['preset']}`" if a.get("preset") else "")
                   + ": section \"Joint pretraining\" below.")
    elif steps and bs and sl:
        tokens = summary.get("tokens", steps * bs * sl)
        out.append(f"- {steps} steps of {bs} x {sl} tokens ({tokens:,} tokens), from random initialisation"
                   + (f", preset `{a['preset']}`" if a.get("preset") else "") + ".")
    if "lr" in args:
        out.append(f"- AdamW (betas {args.get('beta1')}/{args.get('beta2')}, weight decay "
                   f"{args.get('weight_decay')}), learning rate {args['lr']:g} with {args.get('warmup')} "
                   f"warmup steps and cosine decay to {args.get('min_lr'):g}; gradient clip "
                   f"{args.get('grad_clip')}; seed {args.get('seed')}"
                   + (" (the last stage's settings)." if joint else "."))
    if "train_wall_s_approx" in summary:
        wall = summary["train_wall_s_approx"]
        out.append(f"- About {wall / 60:.0f} minutes of wall time ({wall:,} s) on CPU"
                   + (f", threads: {summary['threads']}" if summary.get("threads") else "") + ".")
    return out


def _is_default_corpus(args: dict) -> bool:
    return args.get("data") is not None and Path(args["data"]).as_posix().rstrip("/").endswith(DEFAULT_CORPUS)


def _data(args: dict) -> list[str]:
    data = args.get("data")
    if data is None:
        return ["The training data is not recorded with this checkpoint."]
    if _is_default_corpus(args):
        from cedlm.data.sources import SOURCES

        rows = [f"| `{s.name}` | {s.origin} | {s.license} |" for s in SOURCES.values()]
        return [f"`{data}`: the corpus `cedlm data prepare` builds from these sources (fetched from package "
                "registries, cleaned, capped and split into train / validation by a hash of each chunk's "
                "key; see DATA_LICENSES.md in the cedlm repository). The tokenizer was trained on the same "
                "corpus. No corpus text is shipped with the model.", "",
                "| source | origin | license |", "|---|---|---|", *rows]
    return [f"`{data}` (not cedlm's default corpus; see its manifest.json for sources and licenses)."]


_EVAL_ROWS = [
    ("", "this model"),
    ("chat_base_", "the same model before its chat stage"),
    ("twin_", "decoder-only twin (full attention), same data and token budget"),
    ("unigram_", "unigram (add-one, fitted on the training split)"),
]


def _evaluation(summary: dict) -> list[str]:
    rows = [f"| {label} | {summary[p + 'val_perplexity']:.1f} | {summary[p + 'val_bits_per_byte']:.3f} |"
            for p, label in _EVAL_ROWS
            if p + "val_perplexity" in summary and p + "val_bits_per_byte" in summary]
    if not rows:
        return ["No evaluation was recorded with this checkpoint (summary.json)."]
    where = "the validation split"
    if "val_tokens" in summary and "val_bytes" in summary:
        where += f" ({summary['val_tokens']:,} tokens, {summary['val_bytes']:,} bytes)"
    return [f"Measured with `cedlm eval ppl` on {where} of the training corpus:", "",
            "| model | perplexity | bits/byte |", "|---|---|---|", *rows]


def model_card(cfg: ModelConfig, tokenizer=None, summary: dict | None = None,
               training_args: dict | None = None, weights: str = "bf16") -> str:
    """README.md of a model directory, from its config, tokenizer and run metadata (see module doc)."""
    summary, args = dict(summary or {}), dict(training_args or {})
    counts = param_counts(cfg)
    preset = summary.get("preset") or args.get("preset")
    name = f"cedlm `{preset}`" if preset else "cedlm model"
    vocab = tokenizer.vocab_size if tokenizer is not None else cfg.vocab_size
    tok_name = getattr(tokenizer, "name", None)
    chat = _chat_keys(summary)
    L: list[str] = [
        "---", "license: mit", "language:", "- en", "library_name: cedlm", "pipeline_tag: text-generation",
        "tags:", "- deepseek_v41", "- cedlm", "---", "",
        f"# {name}: a {counts['total'] / 1e6:.2f}M-parameter model with the DeepSeek-V4.1-Flash architecture",
        "",
        "A small model of the DeepSeek-V4.1-Flash structure (causal encoder-decoder whose decoder shares one "
        "global KV cache, CSA2 sharing of KV and sparse indices, FP4 global KV, Engram memory, mHC, MoE), "
        "trained from scratch on a CPU by cedlm's own trainer. It exists to "
        "exercise and measure cedlm: the model code, the engine and its KV-cache formats, the "
        "OpenAI-compatible server. Its text is not useful (see Limitations).",
        "",
        "This card is generated by `cedlm export` (`cedlm.train.model_card`) from the checkpoint's "
        "config.json, tokenizer, training_args.json and summary.json.",
        "", "## Model", "", *_architecture(cfg, counts, tok_name, vocab, "dspark_steps" in summary), "",
        f"Weights: {FORMATS.get(weights, weights)}.",
        "", "## Training data", "", *_data(args),
        "", "## Training", "", *_training(args, summary),
    ]
    if summary.get("commands"):
        L += ["", "Reproduce (from the cedlm repository):", "", "```bash",
              *[str(c) for c in summary["commands"]], "```"]
    L += joint_pretraining(summary)
    L += chat_stage(summary)
    L += component_stages(summary)
    L += ["", "## Evaluation", "", *_evaluation(summary)]
    recorded = {k: v for k, v in summary.items() if k != "commands"}
    if recorded:
        L += ["", "Every value recorded in summary.json:", "", "| key | value |", "|---|---|",
              *[f"| `{k}` | {TABLED[k] if k in TABLED else val(v)} |" for k, v in recorded.items()]]
    default_corpus = _is_default_corpus(args)
    L += [
        "", "## Licenses", "",
        "- Model weights, tokenizer and code: MIT, the license of the cedlm package they ship in.",
        "- Training text: " + ("the licenses in the table above" if default_corpus else
                               "see the corpus's manifest") + "; the weights and the tokenizer are "
        "statistics derived from it, and no text is included.",
        "", "## Intended use", "",
        "- Testing, benchmarking and demonstrating cedlm: a real trained checkpoint for the engine, the server, "
        "the prefix cache, the KV formats and the checkpoint formats, small enough for CI on a CPU.",
        "- Studying the DeepSeek-V4.1 architecture at a size a CPU can train.",
        "",
        "Out of scope: anything that relies on what the model says (facts, advice, code, decisions), "
        "user-facing assistants, and any safety-relevant use.",
        "", "## Limitations", "",
    ]
    ppl, tokens, uni = summary.get("val_perplexity"), summary.get("tokens"), summary.get("unigram_val_perplexity")
    L += ["- Very low quality, barely past random initialisation: a toy-sized model"
          + (f" trained on {tokens:,} tokens" if tokens else "")
          + (f" (validation perplexity {ppl:.1f} on its own in-domain text" if ppl is not None else "")
          + (f", where a unigram model scores {uni:.1f})" if ppl is not None and uni is not None else
             ")" if ppl is not None else "")
          + ". Continuations are locally plausible word sequences, often repetitive and ungrammatical, "
          "with no knowledge to rely on."]
    if chat:
        L += ["- Chat stage recorded in summary.json: " + ", ".join(f"`{k}` = {val(summary[k])}" for k in chat)
              + "."]
    else:
        L += ["- No chat or instruction fine-tune yet: trained on plain documents only. It continues text; in "
              "the V4.1 chat format it does not follow instructions, rarely ends its turn with EOS (set "
              "`max_tokens`), and does not reason in `<think>` or call tools, although the tokenizer and the "
              "chat template support them."]
    if default_corpus:
        L += ["- A narrow, dated, English-only corpus (18th/19th-century novels, the King James Bible, US State "
              "of the Union addresses, Python documentation and standard library) with the language and views "
              "of its periods.",
              f"- A {vocab:,}-token vocabulary fitted to that corpus: other text tokenizes into many short pieces."]
    longest = max((n for st in summary.get("joint_stages") or [] for n in st.get("seq_lens", [])),
                  default=args.get("seq_len"))
    if longest:
        L += [f"- Trained on sequences of at most {longest:,} tokens; the config allows "
              f"{cfg.max_position_embeddings:,} positions, but quality beyond {longest:,} tokens is measured only "
              "where this card says so."]
    if cfg.engram_token_map == "legacy-v0":
        L += ["- Its Engram layers use cedlm's `legacy-v0` compressed-token map (config `cedlm.engram_token_map`); "
              "cedlm's loader applies it, other V4.1 implementations would use the official map and compute "
              "different Engram lookups."]
    L += [
        "", "## How to load", "",
        "With cedlm installed (`cedlm serve` serves the copy of this model shipped in the package by default):", "",
        "```python",
        "from cedlm import LLM, SamplingParams",
        "",
        'llm = LLM(model="path/to/this/directory")',
        'out = llm.generate("It is a truth universally acknowledged", SamplingParams(max_tokens=40, temperature=0))',
        "print(out[0].text)",
        "",
        "from cedlm.checkpoint import load_model",
        'model, tokenizer = load_model("path/to/this/directory")   # CEDModel (eval mode), Tokenizer',
        "```", "",
        "```bash",
        "cedlm serve --model path/to/this/directory        # OpenAI-compatible API on 127.0.0.1:8000",
        "```", "",
        "The tokenizer and the chat template also load with transformers (the weights do not: "
        "`deepseek_v41` is not a transformers model type):", "",
        "```python",
        "from transformers import AutoTokenizer",
        "",
        'tok = AutoTokenizer.from_pretrained("path/to/this/directory")',
        'prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,',
        "                                 add_generation_prompt=True)   # cedlm's V4.1 encoding, byte for byte",
        'ids = tok("It is a truth").input_ids   # starts with BOS, as cedlm tokenizes a text prompt',
        "```", "",
        "Template variables: `thinking_mode` (\"chat\" | \"thinking\", or `thinking=True`), `reasoning_effort`, "
        "`drop_thinking`, `tools`. `generation_config.json` holds cedlm's sampling defaults and "
        f"`max_new_tokens` {DEFAULT_MAX_NEW_TOKENS}.",
    ]
    return "\n".join(L) + "\n"


# ----------------------------------------------------------------------------- files

def _json_text(d: dict) -> str:
    return json.dumps(d, indent=2, ensure_ascii=False) + "\n"


def model_files(cfg: ModelConfig, tokenizer=None, summary: dict | None = None,
                training_args: dict | None = None, weights: str = "bf16") -> dict[str, str]:
    """{file name: text} of generation_config.json and README.md."""
    return {"generation_config.json": _json_text(generation_config(cfg, tokenizer)),
            "README.md": model_card(cfg, tokenizer, summary, training_args, weights)}


def write_model_files(dst: str | Path, cfg: ModelConfig, tokenizer=None, summary: dict | None = None,
                      training_args: dict | None = None, weights: str = "bf16") -> None:
    for name, text in model_files(cfg, tokenizer, summary, training_args, weights).items():
        (Path(dst) / name).write_text(text, encoding="utf-8")


def _read_json(p: Path) -> dict | None:
    return json.loads(p.read_text("utf-8")) if p.exists() else None


def expected_files(model_dir: str | Path) -> dict[str, str]:
    """What tokenizer.json, tokenizer_config.json, generation_config.json and README.md of
    `model_dir` should hold, regenerated from its config.json, tokenizer.json (the vocabulary),
    training_args.json and summary.json."""
    from cedlm.official import is_official_layout
    from cedlm.text.tokenizer import load_tokenizer

    d = Path(model_dir)
    weights = "official" if is_official_layout(d) else "bf16"
    cfg = ModelConfig.from_json(d / "config.json")
    tok = load_tokenizer(d) if (d / "tokenizer.json").exists() else None
    out = model_files(cfg, tok, _read_json(d / "summary.json"), _read_json(d / "training_args.json"), weights)
    if tok is not None:
        out["tokenizer.json"] = tok.to_json()
        out["tokenizer_config.json"] = _json_text(tok.config())
    return out


def main(argv=None) -> int:
    """python -m cedlm.train.model_card DIR...: rewrite the generated text files of model directories."""
    from cedlm.util import atomic_open

    dirs = sys.argv[1:] if argv is None else argv
    if not dirs:
        print("usage: python -m cedlm.train.model_card MODEL_DIR...", file=sys.stderr)
        return 2
    for d in dirs:
        for name, text in expected_files(d).items():
            with atomic_open(Path(d) / name) as f:
                f.write(text)
            print(Path(d) / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
