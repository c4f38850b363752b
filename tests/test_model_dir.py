"""The HF-style model directory: chat template, generation config, BOS handling, model card.

- ``chat_template`` (cedlm.text.chat_template) renders every documented example of
  tests/test_chat.py, and more, exactly as ``cedlm.text.chat.encode_chat`` does: with plain
  ``jinja2`` and through ``transformers.AutoTokenizer.apply_chat_template`` (text and ids).
- A text tokenized by ``AutoTokenizer`` gets the ids the server gives it (BOS first).
- The shipped ``cedlm/assets/model`` holds exactly what the generators write, and ``cedlm export``
  (both formats) writes the same files for a new checkpoint.
"""
from __future__ import annotations

import fnmatch
import json
import random
import tomllib
from pathlib import Path

import pytest

from cedlm.text.chat import BOS, encode_chat, encode_chat_ids
from cedlm.text.chat_template import chat_template, jinja_environment, render
from cedlm.text.tokenizer import load_tokenizer
from cedlm.train.model_card import DEFAULT_MAX_NEW_TOKENS, expected_files, generation_config
from test_chat import EXPECTED, MESSAGES

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "cedlm" / "assets" / "model"
TOKENIZER_DIRS = [ROOT / "cedlm" / "assets" / d for d in ("model", "tokenizer", "tokenizer-512")]

TOOLS = [{"type": "function", "function": {"name": "get_w", "description": "Weather <b>& é",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}},
         {"name": "bare_fn", "parameters": {}}]

# Beyond the reference examples: every feature of the encoder, with awkward text.
EXTRA = {
    "blocks_images_unsupported": (
        {"thinking_mode": "chat"},
        [{"role": "system", "content": [{"type": "text", "text": "S1"}, "S2"]},
         {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}},
                                      {"type": "audio"}, "plain"]},
         {"role": "assistant", "content": "ok", "wo_eos": True},
         {"role": "user", "content": "a\nb \"q\" \\ é 😀"},
         {"role": "user", "content": "merged"}]),
    "tool_calls_json_strings": (
        {"thinking_mode": "thinking", "reasoning_effort": 42},
        [{"role": "system", "content": "S", "tools": TOOLS},
         {"role": "user", "content": "go"},
         {"role": "assistant", "content": "Let me check.", "reasoning_content": "plan",
          "tool_calls": [
              {"id": "a", "type": "function", "function": {
                  "name": "f", "arguments": '{"s":"x\\ny\\u00e9\\ud83d\\ude00\\/\\"","n":-0,"f":1E5,"g":2.50,'
                                            '"l":[1,{"k":null}],"b":true,"o":{}}'}},
              {"id": "b", "type": "function", "function": {"name": "g", "arguments": json.dumps(
                  {"path": "C:\\dir", "nested": {"a": [1.5, "é\u0001"], "e": []}}, ensure_ascii=True, indent=2)}},
              {"id": "c", "type": "function", "function": {"name": "h", "arguments": "{}"}}]},
         {"role": "tool", "tool_call_id": "c", "content": "C"},
         {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "A"}, {"type": "image"},
                                                          {"type": "video"}]},
         {"role": "tool", "tool_call_id": "b", "content": "B"},
         {"role": "user", "content": "and?"}]),
    "tool_calls_dict_arguments_kwarg_tools": (
        {"thinking_mode": "chat", "tools": TOOLS},
        [{"role": "user", "content": "go"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"function": {"name": "f", "arguments": {"x": "1", "y": [1, 2], "z": True, "w": None, "u": "é"}}},
             {"name": "bare_fn", "arguments": {}}]},
         {"role": "tool", "tool_call_id": "", "content": "r"}]),
    "developer_response_format_reminder": (
        {"thinking_mode": "thinking", "reasoning_effort": "max", "drop_thinking": False},
        [{"role": "system", "content": "S", "response_format": {"type": "json_schema", "schema": {"a": "é"}}},
         {"role": "developer", "content": "D"},
         {"role": "user", "content": "Q1"},
         {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
         {"role": "developer", "content": "D2"},
         {"role": "user", "content": "Q2"},
         {"role": "latest_reminder", "content": "REM"}]),
    "drop_developer_before_last_user": (
        {"thinking_mode": "thinking", "reasoning_effort": "xhigh"},
        [{"role": "developer", "content": "D"},
         {"role": "user", "content": "Q1"},
         {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
         {"role": "user", "content": "Q2", "task": "title"},
         {"role": "assistant", "content": "T"},
         {"role": "user", "content": "Q3", "task": "action"}]),
    "effort_none_is_chat": (
        {"thinking_mode": "thinking", "reasoning_effort": "none"},
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]),
    "no_bos": ({"thinking_mode": "chat", "add_bos": False}, [{"role": "user", "content": "Hi"}]),
}

CASES = {**{n: (s, MESSAGES[n]) for n, (s, _) in EXPECTED.items()}, **EXTRA}


def _fuzz_conversations(n: int, seed: int = 0):
    """Random conversations mixing every role and feature (deterministic)."""
    r = random.Random(seed)
    words = ["Hi", "é ü", "a\nb", 'q"uote', "back\\slash", "", "tab\there", "😀", "<tag>", "x&y", "\u0001c"]

    def val(d=0):
        k = r.randrange(7 if d < 2 else 4)
        return [lambda: r.choice(words), lambda: r.choice([0, -3, 12345678901234567890]),
                lambda: r.choice([1.5, 1e-07, 100000.0, 1e22]), lambda: r.choice([True, False, None]),
                lambda: [val(d + 1) for _ in range(r.randrange(3))],
                lambda: {r.choice(words) or "k": val(d + 1) for _ in range(r.randrange(3))},
                lambda: r.choice(words)][k]()

    def args():
        a = {f"p{i}" + r.choice(["", "é", '"q']): val() for i in range(r.randrange(4))}
        return r.choice([a, json.dumps(a), json.dumps(a, separators=(",", ":")),
                         json.dumps(a, ensure_ascii=True, indent=2)])

    for _ in range(n):
        msgs = []
        if r.random() < 0.5:
            msgs.append({"role": "system", "content": r.choice(words), **({"tools": TOOLS} if r.random() < 0.3 else {})})
        for _ in range(r.randrange(1, 6)):
            x = r.random()
            if x < 0.35:
                msgs.append({"role": "user", "content": r.choice(words + [[{"type": "text", "text": "t"},
                                                                           {"type": "image"}]])})
            elif x < 0.6:
                m = {"role": "assistant", "content": r.choice(words + [None])}
                if r.random() < 0.5:
                    m["reasoning_content"] = r.choice(words)
                if r.random() < 0.4:
                    m["tool_calls"] = [{"id": f"c{j}", "type": "function",
                                        "function": {"name": f"f{j}", "arguments": args()}} for j in range(r.randrange(1, 4))]
                    msgs.append(m)
                    ids = [c["id"] for c in m["tool_calls"]]
                    r.shuffle(ids)
                    msgs += [{"role": "tool", "tool_call_id": i, "content": r.choice(words)} for i in ids]
                    continue
                msgs.append(m)
            elif x < 0.7:
                msgs.append({"role": "developer", "content": "dev"})
            elif x < 0.8:
                msgs.append({"role": "system", "content": "mid"})
            elif x < 0.87:
                msgs.append({"role": "latest_reminder", "content": "REM"})
            else:
                msgs.append({"role": "user", "content": "Q", "task": r.choice(["query", "action", "title"])})
        kw = {"thinking_mode": r.choice(["chat", "thinking"]),
              "reasoning_effort": r.choice([None, "low", "high", "xhigh", "max", "none", 1, 42, 100])}
        if r.random() < 0.3:
            kw["drop_thinking"] = False
        if r.random() < 0.2:
            kw["tools"] = TOOLS
        yield msgs, kw


# ----------------------------------------------------------------------------- the template

def test_every_documented_example_is_a_case():
    assert set(EXPECTED) <= set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_template_with_jinja2_equals_the_encoder(name):
    settings, msgs = CASES[name]
    want = encode_chat(msgs, **settings)
    if name in EXPECTED:
        assert want == EXPECTED[name][1]
    assert render(msgs, add_generation_prompt=True, **settings) == want


def test_template_fuzz_equals_the_encoder():
    tmpl = jinja_environment().from_string(chat_template())
    for msgs, kw in _fuzz_conversations(300):
        assert tmpl.render(messages=msgs, add_generation_prompt=True, **kw) == encode_chat(msgs, **kw), (msgs, kw)


def test_template_variables_and_generation_prompt():
    user = [{"role": "user", "content": "Hi"}]
    # thinking=True / enable_thinking=True are the vLLM / DeepSeek spellings of thinking mode
    for kw in ({"thinking": True}, {"enable_thinking": True}):
        assert render(user, add_generation_prompt=True, **kw) == encode_chat(user, thinking_mode="thinking")
    # Without add_generation_prompt (transformers' default) the final assistant prefix is left out.
    for settings, _ in EXPECTED.values():
        for msgs in MESSAGES.values():
            full = encode_chat(msgs, **settings)
            bare = render(msgs, **settings)
            assert full.startswith(bare)
            if msgs[-1]["role"] in ("assistant", "latest_reminder"):
                assert bare == full
    assert render(user) == BOS + "<｜User｜>Hi"
    assert render([{"role": "user", "content": "Q", "task": "query"}]) == BOS + "<｜User｜>Q"


@pytest.mark.parametrize("kw,msgs", [
    ({"thinking_mode": "deep"}, [{"role": "user", "content": "Hi"}]),
    ({"thinking_mode": "thinking", "reasoning_effort": "medium"}, [{"role": "user", "content": "Hi"}]),
    ({"thinking_mode": "thinking", "reasoning_effort": 0}, [{"role": "user", "content": "Hi"}]),
    ({}, [{"role": "user", "content": "Hi", "task": "bogus"}]),
    ({}, [{"role": "robot", "content": "Hi"}]),
    ({}, [{"role": "developer", "content": ""}]),
    ({}, [{"role": "user", "content": "<｜deepseek_image｜>"}]),
    ({}, [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]),
])
def test_template_refuses_what_the_encoder_refuses(kw, msgs):
    import jinja2

    with pytest.raises(ValueError):
        encode_chat(msgs, **kw)
    with pytest.raises(jinja2.exceptions.TemplateError):
        render(msgs, add_generation_prompt=True, **kw)


# ----------------------------------------------------------------------------- shipped files

@pytest.mark.parametrize("d", TOKENIZER_DIRS, ids=lambda d: d.name)
def test_shipped_tokenizer_files_are_generated(d):
    tok = load_tokenizer(d)
    cfg = json.loads((d / "tokenizer_config.json").read_text("utf-8"))
    assert cfg["chat_template"] == chat_template()
    assert cfg["add_bos_token"] is True and cfg["add_eos_token"] is False
    assert (d / "tokenizer_config.json").read_text("utf-8") == json.dumps(tok.config(), indent=2, ensure_ascii=False) + "\n"
    assert (d / "tokenizer.json").read_text("utf-8") == tok.to_json()


def test_shipped_model_dir_is_generated():
    """Every generated file of cedlm/assets/model equals what the code writes today (regenerate with
    `python -m cedlm.train.model_card cedlm/assets/model`)."""
    want = expected_files(MODEL_DIR)
    assert set(want) == {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "README.md"}
    for name, text in want.items():
        assert (MODEL_DIR / name).read_text("utf-8") == text, name


def test_generation_config():
    from cedlm.train.model_card import GENERATION_DEFAULTS

    tok = load_tokenizer(MODEL_DIR)
    gc = json.loads((MODEL_DIR / "generation_config.json").read_text("utf-8"))
    cfg = json.loads((MODEL_DIR / "config.json").read_text("utf-8"))
    assert (gc["bos_token_id"], gc["eos_token_id"], gc["pad_token_id"]) == (tok.bos_id, tok.eos_id, tok.pad_id) \
        == (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"])
    # the sampling defaults chosen for the shipped model (docs/serving.md, "Sampling defaults"),
    # which `cedlm serve` and vLLM apply to requests that leave them unset
    assert {k: gc[k] for k in GENERATION_DEFAULTS} == GENERATION_DEFAULTS
    assert gc["max_new_tokens"] == DEFAULT_MAX_NEW_TOKENS > 0


def test_model_card_copies_the_measured_numbers():
    card = (MODEL_DIR / "README.md").read_text("utf-8")
    summary = json.loads((MODEL_DIR / "summary.json").read_text("utf-8"))
    for key, fmt in (("val_perplexity", "{:.1f}"), ("val_bits_per_byte", "{:.3f}"), ("tokens", "{:,}"),
                     ("val_tokens", "{:,}"), ("twin_val_perplexity", "{:.1f}"), ("unigram_val_perplexity", "{:.1f}")):
        if key in summary or not key.startswith(("twin", "unigram")):
            assert fmt.format(summary[key]) in card, key
    joint = "joint_stages" in summary                # the default model: one joint run in stages
    chat = "chat_steps" in summary                   # a chat stage on top of a pretrained model
    for needle in ("22,662,584", "5,160,896", "license: mit", "## Limitations",
                   "## Joint pretraining" if joint else "## Chat stage" if chat else
                   "No chat or instruction fine-tune",
                   "## How to load", "Public domain".lower(), "PSF-2.0", "CC0-1.0", "## Intended use"):
        assert needle.lower() in card.lower(), needle
    assert ("No chat or instruction fine-tune" in card) is not (chat or joint)
    if joint:                                        # every target with its measured value
        for t in summary["joint_targets"]:
            assert f"| {t['target']} | {t['goal']} | {t['measured']} |" in card, t
        assert f"{summary['heldout_bits_per_byte']:.3f} bits/byte" in card
    assert ("## Lightning indexer (distilled)" in card) is ("indexer_steps" in summary)
    if "indexer_steps" in summary:                  # the distilled indexer's stage and its measured KL
        assert f"{summary['indexer_steps']} steps of {summary['indexer_seq_len']}-token" in card
        assert f"{summary['indexer_fidelity_kl']:.6g} distilled" in card
    from cedlm.data.sources import SOURCES

    assert all(f"`{name}`" in card for name in SOURCES)


def test_package_data_covers_the_model_dir():
    py = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))
    patterns = py["tool"]["setuptools"]["package-data"]["cedlm"]
    for f in MODEL_DIR.iterdir():
        rel = f.relative_to(ROOT / "cedlm").as_posix()
        assert any(fnmatch.fnmatch(rel, p) for p in patterns), rel
    # transformers (the HF-loading tests below) comes with the eval extra, its version in the lock
    assert any(r.startswith("transformers") for r in py["project"]["optional-dependencies"]["eval"])
    assert "transformers==" in (ROOT / "requirements.lock").read_text("utf-8")


# ----------------------------------------------------------------------------- transformers

@pytest.fixture(scope="module")
def hf_tok():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(MODEL_DIR))


@pytest.mark.parametrize("name", sorted(CASES))
def test_transformers_apply_chat_template_equals_the_encoder(hf_tok, name):
    settings, msgs = CASES[name]
    want = encode_chat(msgs, **settings)
    if name in EXPECTED:
        assert want == EXPECTED[name][1]
    assert hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **settings) == want
    ids = hf_tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, **settings)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert list(ids) == encode_chat_ids(msgs, load_tokenizer(MODEL_DIR), **settings)


TEXTS = ["It is a truth universally acknowledged", "", "  leading spaces\n\ttabs 3.14159 café 😀",
         "def f(x):\n    return x  # é"]


def test_transformers_text_ids_equal_cedlm(hf_tok):
    """BOS handling: AutoTokenizer adds BOS to a text as cedlm does to a text prompt
    (/v1/completions, LLM.generate), and add_special_tokens=False leaves it out as the server's
    `add_special_tokens: false` does. (Special-token strings typed in a text differ on purpose: the
    server reads them as text, transformers as control tokens.)"""
    tok = load_tokenizer(MODEL_DIR)
    for text in TEXTS:
        assert hf_tok(text).input_ids == [tok.bos_id] + tok.encode_plain(text) == tok.encode(text, add_bos=True)
        assert hf_tok(text, add_special_tokens=False).input_ids == tok.encode_plain(text)
        assert hf_tok.decode(hf_tok(text).input_ids, skip_special_tokens=True) == text


def test_transformers_text_ids_equal_the_server(hf_tok):
    from starlette.testclient import TestClient

    from cedlm.engine.llm import LLM
    from cedlm.server.app import create_app

    llm = LLM(str(MODEL_DIR), kv_budget_bytes=16 << 20, num_threads=1)
    for text in TEXTS:
        assert llm.encode(text) == hf_tok(text).input_ids           # LLM.generate("text")
    app = create_app(llm, served_model_name="m")
    with TestClient(app) as c:
        for text in TEXTS[:1] + TEXTS[2:]:
            for special in (True, False):
                r = c.post("/tokenize", json={"model": "m", "prompt": text, "add_special_tokens": special})
                assert r.status_code == 200, r.text
                assert r.json()["tokens"] == hf_tok(text, add_special_tokens=special).input_ids
            r = c.post("/v1/completions", json={"model": "m", "prompt": text, "max_tokens": 1})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(hf_tok(text).input_ids)


def test_transformers_generation_config():
    transformers = pytest.importorskip("transformers")
    gc = transformers.GenerationConfig.from_pretrained(str(MODEL_DIR))
    assert (gc.bos_token_id, gc.eos_token_id, gc.pad_token_id) == (0, 1, 2)
    from cedlm.train.model_card import GENERATION_DEFAULTS
    assert gc.max_new_tokens == DEFAULT_MAX_NEW_TOKENS and gc.do_sample is GENERATION_DEFAULTS["do_sample"]
    assert (gc.temperature, gc.top_p) == (GENERATION_DEFAULTS["temperature"], GENERATION_DEFAULTS["top_p"])


# ----------------------------------------------------------------------------- export

def test_export_writes_the_hf_files(tmp_path):
    import torch

    from cedlm.checkpoint import save_checkpoint, set_token_map
    from cedlm.config import ModelConfig
    from cedlm.model.model import CEDModel
    from cedlm.train.export import main as export_main

    tok = load_tokenizer("default")
    torch.manual_seed(0)
    model = CEDModel(ModelConfig.preset("tiny"))
    set_token_map(model, tok)
    run = tmp_path / "run"
    save_checkpoint(run / "checkpoint", model, tok, training_args={"preset": "tiny", "data": "data/corpus",
                                                                    "steps": 3, "batch_size": 2, "seq_len": 8})
    summary = {"preset": "tiny", "steps": 3, "val_perplexity": 4321.5, "val_bits_per_byte": 9.876}
    (run / "summary.json").write_text(json.dumps(summary))
    for fmt in ("bf16", "official"):
        out = tmp_path / fmt
        extra = ["--allow-cedlm-fields"] if fmt == "official" else []    # the preset's float64 RoPE
        assert export_main([str(run), str(out), "--format", fmt, *extra]) == 0
        files = {p.name for p in out.iterdir()}
        assert {"generation_config.json", "README.md", "tokenizer.json", "tokenizer_config.json"} <= files
        for name, text in expected_files(out).items():
            assert (out / name).read_text("utf-8") == text, (fmt, name)
        card = (out / "README.md").read_text("utf-8")
        assert "4321.5" in card and "9.876" in card and "cedlm `tiny`" in card
        assert ("official DeepSeek-V4.1 layout" in card) == (fmt == "official")
        cfg = json.loads((out / "tokenizer_config.json").read_text("utf-8"))
        assert cfg["chat_template"] == chat_template()
        assert json.loads((out / "generation_config.json").read_text("utf-8")) == generation_config(model.cfg, tok)


def test_model_card_joint_pretraining_section():
    """A joint run's summary.json (`joint_*`, as experiments/joint_pretraining/assemble.py writes it)
    gives the card its stages, retrieval rows and targets; a summary without them has no such section."""
    from cedlm.config import ModelConfig
    from cedlm.train.model_card import model_card

    stage = {"stage": "1", "mixture": "m.json", "steps": 781, "tokens": 3_198_976, "wall_s": 8618.4, "threads": 1,
             "weights": {"corpus": 0.55, "chat": 0.2, "retrieval": 0.15, "repeat": 0.1}, "answer_weight": 5.0,
             "seq_lens": [256, 512, 4096]}
    s = {"preset": "tiny", "tokens": 3_198_976, "joint_stages": [stage, {**stage, "stage": "2", "tokens": 1000,
                                                                           "wall_s": 3600.0, "seq_lens": [1024]}],
         "joint_passkey": [{"length": 1024, "n": 16, "exact": 0.1875, "exact_init": 0.0, "token_acc": 0.775,
                            "token_acc_init": 0.45}],
         "joint_targets": [{"target": "passkey exact at 1,024 tokens", "goal": ">= 90%", "measured": "0.19 of 16",
                            "met": False, "why": "too few steps at 1,024"},
                           {"target": "validation perplexity", "goal": "<= 60", "measured": "22.3", "met": True}],
         "chat_finished_greedy": 0.854, "chat_finished_sampled": 0.979, "chat_heldout_n": 48, "chat_source_n": 16,
         "chat_source_accuracy_greedy": 0.5625, "chat_heldout_loss": 1.55, "chat_eval_max_tokens": 64,
         "joint_notes": ["No scaling sweep was run."], "heldout_text": "GPL-3", "heldout_bits_per_byte": 1.8346, "bzip2_heldout_bits_per_byte": 2.437,
         "joint_curves": "docs/c.png",
         "joint_curve_points": [{"stage": 1, "step": 100, "tokens": 409600, "seq_len": 256, "phase": "dense",
                                 "loss": 6.005, "val_ppl": 350.8},
                                {"stage": 2, "step": 831, "tokens": 3403776, "seq_len": 256, "phase": "sparse",
                                 "loss": 3.782, "val_ppl": 32.1, "retrieval_acc": 0.2439, "retrieval_exact": 0.0,
                                 "retrieval_len": 1024}],
         "joint_sweep": {"steps": 60, "batch_tokens": 4096, "threads": 2, "equal_time_s": 400.0,
                         "rows": [{"width": 128, "params": {"total": 10976312, "active_decode": 3522296.0},
                                   "tokens": 245760, "tokens_per_s": 610.2, "train_s": 402.7, "val_ppl": 120.5,
                                   "train_loss_at_fastest_s": 5.123}],
                         "conclusion": "Width 128 wins.", "command": "python sweep.py"}}
    cfg = ModelConfig.preset("tiny")
    card = model_card(cfg, summary=s, training_args={"preset": "tiny", "steps": 55, "batch_size": 8, "seq_len": 256,
                                                     "lr": 3e-4, "min_lr": 3e-5, "init_from": "runs/joint3c"})
    assert "## Joint pretraining" in card and "## Chat stage" not in card
    assert "| 1 | `m.json`: 0.55 / 0.20 / 0.15 / 0.10 | x5 | 256 → 512 → 4096 | 781 | 3,198,976 | 2.39 h | 1 |" in card
    assert "In all: 3,199,976 tokens, 3.39 hours" in card
    assert "| 1,024 | 16 | 3 / 16 | 0 / 16 | 0.78 / 0.45 |" in card
    assert "| passkey exact at 1,024 tokens | >= 90% | 0.19 of 16 | **missed** | too few steps at 1,024 |" in card
    assert "| validation perplexity | <= 60 | 22.3 | met |" in card
    assert "85% of the greedy replies end their turn" in card and "source questions right 9 / 16" in card
    assert "1.835 bits/byte (bzip2 -9: 2.437)" in card and "\n- No scaling sweep was run.\n" in card
    assert "| 1 | 100 | 409,600 | 256 | dense | 6.005 | 350.8 | - |" in card              # the curves
    assert "| 2 | 831 | 3,403,776 | 256 | sparse | 3.782 | 32.1 | 0.24 / 0.00 (1,024) |" in card
    assert "plotted in `docs/c.png`" in card
    assert "### Scaling sweep" in card and "training loss at 400 s |" in card                # the sweep
    assert "| 128 | 11.0M | 3.5M | 245,760 | 610 | 6.7 min | 120.5 | 5.123 |" in card
    assert "\nWidth 128 wins.\n" in card and "Reproduce: `python sweep.py`" in card
    assert '| `joint_sweep` | (the "Scaling sweep" table above) |' in card       # not dumped as JSON again
    assert "55 steps of 8 x 256" not in card and "sequences of at most 4,096 tokens" in card
    assert "## Joint pretraining" not in model_card(cfg, summary={"preset": "tiny"})


def _experiment(name: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / "joint_pretraining" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_shipped_card_matches_the_joint_spec_and_docs(tmp_path, monkeypatch):
    """`assemble.py --card-only` on a copy of the shipped directory changes nothing: the shipped
    summary's curves, sweep, notes, commands, DSpark figures and reasons are those of ship.json and
    docs/joint_pretraining (edit those, then refresh the directory with it)."""
    import shutil
    out = tmp_path / "model"
    out.mkdir()
    for f in MODEL_DIR.iterdir():
        (out / f.name).symlink_to(f) if f.suffix == ".safetensors" else shutil.copy(f, out / f.name)
    monkeypatch.chdir(ROOT)
    assemble = _experiment("assemble")
    assert assemble.main(["experiments/joint_pretraining/ship.json", str(out), "--card-only"]) == 0
    for name in ("summary.json", "README.md", "config.json", "generation_config.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (MODEL_DIR / name).read_bytes(), name
    s = json.loads((MODEL_DIR / "summary.json").read_text("utf-8"))
    assert s["joint_sweep"]["rows"] and s["joint_curve_points"][-1]["tokens"] == s["tokens"]


def test_sweep_widths_keep_the_shipped_shape_but_the_width(monkeypatch):
    monkeypatch.chdir(ROOT)
    sweep = _experiment("sweep")
    base = json.loads((ROOT / "experiments/joint_pretraining/config.json").read_text())["text_config"]
    tc = sweep.width_config(192)["text_config"]
    assert (tc["hidden_size"], tc["moe_intermediate_size"], tc["q_lora_rank"], tc["o_lora_rank"]) == (192, 96, 96, 96)
    assert {k: v for k, v in tc.items() if k not in ("hidden_size", "moe_intermediate_size", "q_lora_rank",
                                                      "o_lora_rank")} == \
        {k: v for k, v in base.items() if k not in ("hidden_size", "moe_intermediate_size", "q_lora_rank", "o_lora_rank")}
    with pytest.raises(ValueError, match="--widths: 129"):
        sweep.width_config(129)
    cmd = sweep.command(Path("runs/sweep/w192/c.json"), Path("runs/sweep/w192"), 60, 2)
    assert cmd[1:3] == ["train", "pretrain"] and "experiments/joint_pretraining/mixture.json" in cmd
    assert cmd[cmd.index("--steps") + 1] == "60" and cmd[cmd.index("--dense-steps") + 1] == "60"
