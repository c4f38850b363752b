"""The device option: `--device` / `LLM(device=...)` on serve, generate, train, eval and
bench (auto: CUDA when available, else the CPU; checked before the model loads; printed at start),
and the engine's own tensors (sampler, generators, speculative decoding, prompt scoring,
constrained decoding) built on the device of what they meet: checked on the CPU under
`implicit_device_guard()` (tests/devices.py), where a tensor created without a device lands on
`meta` and fails at once."""
from __future__ import annotations

import json

import pytest
import torch

from cedlm.cli import main
from cedlm.engine.sampler import Sampler, make_generator
from cedlm.engine.sampling_params import SamplingParams
from tests.devices import CUDA, implicit_device_guard

pytestmark = pytest.mark.skipif(CUDA, reason="these check the CPU wheel's answers (no CUDA device)")

TINY = ["--model", "tiny", "--random-weights"]


def _cli(argv, capsys):
    msg = ""
    try:
        rc = main(argv)
    except SystemExit as e:          # argparse's own errors; bench's: SystemExit(message), status 1
        rc, msg = (1, e.code + "\n") if isinstance(e.code, str) else (e.code, "")
    cap = capsys.readouterr()
    return rc, cap.out, cap.err + msg


# ============================================================================ LLM(device=...)
@pytest.mark.parametrize("device,words", [("cuda", "CUDA build of torch"), ("cuda:0", "CUDA build"),
                                          ("tpu", "not a device"), ("mps", "not supported")])
def test_llm_bad_device_is_a_value_error_before_loading(device, words, monkeypatch):
    from cedlm.engine import llm as llm_mod

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the device was checked")
    monkeypatch.setattr(llm_mod, "load", no_load)
    with pytest.raises(ValueError, match=r"^device: ") as ei:
        llm_mod.LLM("tiny", device=device)
    assert words in str(ei.value)
    if device.startswith("cuda"):
        assert "pip install torch==" in str(ei.value)       # the install hint


@pytest.mark.parametrize("device", [None, "auto", "cpu", torch.device("cpu")])
def test_llm_cpu_and_auto_run_on_the_cpu(device):
    from cedlm.engine.llm import LLM
    llm = LLM("tiny", device=device, kv_budget_bytes=8 << 20)
    assert llm.device == torch.device("cpu") and llm.engine.device == torch.device("cpu")
    assert all(p.device.type == "cpu" for p in llm.model.parameters())


def test_llm_given_a_model_keeps_it_where_it_is():
    from cedlm.engine.llm import LLM
    from cedlm.engine.loader import load
    m, _ = load("tiny")
    assert LLM(m, kv_budget_bytes=8 << 20).device == torch.device("cpu")
    assert LLM(m, device="cpu", kv_budget_bytes=8 << 20).device == torch.device("cpu")


def test_engram_offload_stays_in_host_ram(tmp_path):
    """`engram_mmap`: the tables are memory-mapped host files, no parameters (a move to the device
    leaves them on the host), and generation runs as before."""
    import numpy as np

    from cedlm.engine.llm import LLM
    ref = LLM("tiny", device="cpu", kv_budget_bytes=8 << 20)
    llm = LLM("tiny", device="cpu", kv_budget_bytes=8 << 20, engram_mmap=str(tmp_path))
    tables = [m.host_table for m in llm.model.modules() if hasattr(m, "host_table")]
    assert tables and all(isinstance(t, np.memmap) for t in tables)
    assert not any(".engram.embed." in n for n, _ in llm.model.named_parameters())
    sp = SamplingParams(max_tokens=4, temperature=0)
    assert llm.generate([[1, 2, 3]], sp)[0].token_ids == ref.generate([[1, 2, 3]], sp)[0].token_ids


# ============================================================================ the commands
CUDA_COMMANDS = [
    (["generate", *TINY, "--prompt", "hi", "--device", "cuda"], "cedlm generate"),
    (["serve", "--model", "tiny", "--port", "1", "--device", "cuda"], "cedlm serve"),
    (["train", "pretrain", "--preset", "tiny", "--steps", "1", "--device", "cuda"], "cedlm train pretrain"),
    (["eval", "ppl", "--text", __file__, "--model", "tiny", "--device", "cuda"], "cedlm eval ppl"),
    (["bench", "--quick", "--only", "kv_bytes", "--device", "cuda"], "cedlm bench"),
]


@pytest.mark.parametrize("argv,prog", CUDA_COMMANDS, ids=[p for _, p in CUDA_COMMANDS])
def test_cuda_on_the_cpu_wheel_is_one_error_line(argv, prog, capsys):
    rc, out, err = _cli(argv, capsys)
    lines = err.strip().splitlines()
    assert rc not in (0, None) and "Traceback" not in err, err
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: error: device: 'cuda' needs a CUDA build of torch"), lines[0]
    assert "--index-url https://download.pytorch.org/whl/cu" in lines[0]


@pytest.mark.parametrize("argv,prog", [
    (["generate", *TINY, "--prompt", "hi", "--device", "cuda:x"], "cedlm generate"),
    (["serve", "--model", "tiny", "--port", "1", "--device", "gpu"], "cedlm serve"),
    (["train", "pretrain", "--preset", "tiny", "--device", "metal"], "cedlm train pretrain"),
])
def test_not_a_device_is_one_error_line(argv, prog, capsys):
    rc, out, err = _cli(argv, capsys)
    assert rc == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [f"{prog}: error: device: {argv[-1]!r} is not a device; "
                                        f"use auto, cpu, cuda or cuda:N"]


@pytest.mark.parametrize("flags", [[], ["--device", "cpu"], ["--device", "auto"]])
def test_generate_reports_its_device(flags, capsys):
    rc, out, err = _cli(["generate", *TINY, "--prompt", "hi", "--max-tokens", "2", "--threads", "1",
                         *flags], capsys)
    assert rc == 0, err
    assert "cedlm generate: device cpu (1 torch threads)" in err.splitlines()
    rc, out, err = _cli(["generate", *TINY, "--prompt", "hi", "--max-tokens", "2", "--json", *flags], capsys)
    assert rc == 0 and json.loads(out)["stats"]["device"].startswith("cpu")


def test_serve_reports_its_device(monkeypatch, capsys, caplog):
    """The start-up log line and the start-up print name the device; /v1/models cards carry it."""
    import argparse
    import logging

    import uvicorn
    from starlette.testclient import TestClient

    from cedlm.server import cli
    p = argparse.ArgumentParser()
    cli.add_parser(p.add_subparsers())
    args = p.parse_args(["serve", "--model", "tiny", "--port", "0", "--kv-budget", "8M"])
    assert args.device is None                          # auto
    apps = []
    # the server's start without serving: the app it listens with loads the model at once
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: apps.append(self.config.app.build()))
    monkeypatch.delenv("CEDLM_API_KEY", raising=False)
    cli.configure_logging("info")                     # its handler in place, then let records reach caplog
    with caplog.at_level(logging.INFO, logger="cedlm.server"):
        monkeypatch.setattr(logging.getLogger("cedlm"), "propagate", True)
        assert cli.run(args) == 0
    out = capsys.readouterr().out
    assert ", device cpu (" in out, out
    assert any(r.getMessage().startswith("device: cpu") for r in caplog.records), caplog.text
    with TestClient(apps[0]) as c:
        cards = c.get("/v1/models").json()["data"]
        assert cards and all(card["device"] == "cpu" for card in cards)
        assert c.get(f"/v1/models/{cards[0]['id']}").json()["device"] == "cpu"


def _corpus(tmp_path):
    """A corpus dir (train.txt, val.txt) from the fixture texts."""
    from pathlib import Path

    from cedlm.data.corpus import write_documents
    fix = Path(__file__).parent / "fixtures" / "corpus"
    docs = [p.read_text() for p in sorted(fix.rglob("*")) if p.suffix in (".txt", ".py")]
    assert docs
    data = tmp_path / "corpus"
    data.mkdir()
    with open(data / "train.txt", "w") as f:
        write_documents(f, docs)
    with open(data / "val.txt", "w") as f:
        write_documents(f, docs[:2])
    return data


def _train_argv(data, out, *extra):
    return ["--preset", "tiny", "--data", str(data), "--out", str(out), "--steps", "2", "--batch-size", "2",
            "--seq-len", "16", "--eval-batches", "1", "--no-progress", "--threads", "1", *extra]


def test_train_reports_its_device(tmp_path, capsys):
    data = _corpus(tmp_path)
    rc = main(["train", "pretrain", *_train_argv(data, tmp_path / "run", "--steps", "1", "--device", "cpu")])
    err = capsys.readouterr().err
    assert rc == 0, err
    start = [l for l in err.splitlines() if l.startswith("cedlm train: ")]
    assert start and "device cpu (" in start[0], err


def test_training_steps_are_the_same_under_the_implicit_device_guard(tmp_path):
    """Pretraining steps (batches, forward + loss, backward, clipping, AdamW, MoE balancing) and a
    validation make every tensor on the model's device: the same losses under the guard."""
    from cedlm.train.train import build_parser, optimisation_step, setup, validate
    data = _corpus(tmp_path)

    def steps(out, guard):
        run = setup(build_parser().parse_args(_train_argv(data, out, "--device", "cpu")))
        with implicit_device_guard() if guard else __import__("contextlib").nullcontext():
            recs = [optimisation_step(run) for _ in range(2)]
            validate(run, recs[-1])
        return [(r["loss"], r["grad_norm"]) for r in recs], recs[-1]["val_loss"]
    assert steps(tmp_path / "a", True) == steps(tmp_path / "b", False)


def test_eval_ppl_is_the_same_under_the_implicit_device_guard():
    from cedlm.engine.loader import load
    from cedlm.eval.ppl import evaluate_ppl
    model, tok = load("tiny", device=torch.device("cpu"))       # with the shipped 512-token BPE
    text = "The quick brown fox jumps over the lazy dog. " * 6
    ref = evaluate_ppl(model, tok, text, seq_len=16, batch_size=2)
    with implicit_device_guard():
        assert evaluate_ppl(model, tok, text, seq_len=16, batch_size=2) == ref


@pytest.mark.parametrize("cmd", ["fidelity", "ablate"])
def test_eval_fidelity_and_ablate_check_the_device_first(cmd, monkeypatch, capsys):
    from cedlm.eval import ppl

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the device was checked")
    monkeypatch.setattr(ppl, "resolve_model", no_load)
    rc, out, err = _cli(["eval", cmd, "--model", "tiny", "--text", __file__, "--device", "cuda"], capsys)
    assert rc == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [l for l in err.strip().splitlines() if l.startswith("error: device: 'cuda'")]
    assert len(err.strip().splitlines()) == 1, err


def test_fidelity_measurement_is_the_same_under_the_implicit_device_guard():
    """The fidelity measurement (variant model, tail logits, a replay restore, KL / NLL / top-1,
    retrieval items) on the model's device: the same figures under the guard."""
    import numpy as np

    from cedlm.engine.loader import load
    from cedlm.eval.fidelity import Measurement, Setting
    model, tok = load("tiny", device=torch.device("cpu"))
    text = (__doc__ or "") * 8
    tokens = np.asarray(tok.encode(text), dtype=np.int64)
    setting = Setting("restore", {}, prefill="bounded", restore="bounded")

    def run():
        meas = Measurement(model, tok, tokens, [96], 1, [96], 1, tail=8, chunk=32)
        r = meas.run(setting)
        r.pop("wall_s")
        return r
    ref = run()
    with implicit_device_guard():
        assert run() == ref


@pytest.fixture(scope="module")
def stage_model(tmp_path_factory, tok):
    """A tiny model directory on the shipped tokenizer (the training stages' --init)."""
    from tests.test_chat_stage import save_tiny_checkpoint
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", tok)


def _stage_args(module, argv):
    import argparse
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return p.parse_args(argv)


def test_dspark_stage_steps_are_the_same_under_the_implicit_device_guard(stage_model, tmp_path):
    """`cedlm train dspark`: the target pass, the drafter's forward and loss, backward and AdamW on
    the model's device (host batches moved there): the same steps under the guard."""
    from cedlm.train import dspark
    from tests.test_chat_stage import make_corpus
    corpus = make_corpus(tmp_path / "corpus")

    def steps(out, guard):
        st = dspark.DsparkStage(_stage_args(dspark, [
            "--init", str(stage_model), "--out", str(out), "--data", str(corpus), "--cache-dir",
            str(tmp_path / "cache"), "--batch-size", "2", "--seq-len", "24", "--anchors", "4",
            "--updates-per-batch", "2", "--self-gen-seqs", "2", "--self-gen-prompt", "8", "--device", "cpu"]))
        with implicit_device_guard() if guard else __import__("contextlib").nullcontext():
            recs = [st.step(i) for i in range(3)]
        return [(r["loss"], r["grad_norm"], r["kl"]) for r in recs]
    assert steps(tmp_path / "a", True) == steps(tmp_path / "b", False)


def test_chat_stage_steps_are_the_same_under_the_implicit_device_guard(stage_model, tmp_path):
    """`cedlm train chat`: host batches moved to the device, masked loss, AdamW: the same steps
    under the guard; the held-out loss too."""
    from cedlm.train import chat
    from cedlm.train.chat_eval import heldout_loss
    from tests.test_chat_stage import make_corpus
    corpus = make_corpus(tmp_path / "corpus")

    def steps(out, guard):
        st = chat.ChatStage(_stage_args(chat, [
            "--init", str(stage_model), "--out", str(out), "--data", str(corpus), "--steps", "3",
            "--batch-size", "2", "--max-len", "160", "--examples", "6", "--heldout", "2",
            "--no-eval-before", "--no-progress", "--device", "cpu"]))
        with implicit_device_guard() if guard else __import__("contextlib").nullcontext():
            recs = [st.step(i) for i in range(2)]
            held = heldout_loss(st.model, st.tok, st.heldout)
        return [(r["loss"], r["grad_norm"]) for r in recs], held
    assert steps(tmp_path / "a", True) == steps(tmp_path / "b", False)


def test_indexer_stage_steps_are_the_same_under_the_implicit_device_guard(tmp_path):
    """`cedlm train indexer`: the dense warm-up and a whole-model sparse step (indexer probe, KL,
    LM loss, AdamW) on the model's device: the same steps under the guard."""
    from pathlib import Path

    from cedlm.checkpoint import save_checkpoint
    from cedlm.engine.loader import load_any
    from cedlm.train import indexer
    model, tok = load_any("tiny", seed=3)
    save_checkpoint(tmp_path / "init", model, tok)
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.txt").write_text((Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8"))

    def steps(out, guard):
        st = indexer.IndexerStage(_stage_args(indexer, [
            "--init", str(tmp_path / "init"), "--out", str(out), "--data", str(data), "--seq-len", "128",
            "--items", "1", "--min-gap", "16", "--warmup-steps", "1", "--steps", "1", "--no-progress",
            "--device", "cpu"]))
        with implicit_device_guard() if guard else __import__("contextlib").nullcontext():
            recs = [st.step(i) for i in range(2)]
        return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "elapsed")} for r in recs]
    assert steps(tmp_path / "a", True) == steps(tmp_path / "b", False)


def test_vision_stage_pieces_are_the_same_under_the_implicit_device_guard():
    """`cedlm train vision`: anchors (their loss through the text model), the end-to-end loss and
    the greedy accuracy check, with host batches and patches moved to the model's device: the same
    values under the guard."""
    pytest.importorskip("sklearn")

    from cedlm.config import ModelConfig
    from cedlm.config.vision import VisionConfig
    from cedlm.data import vision_tasks as T
    from cedlm.engine.loader import tokenizer_for_vocab
    from cedlm.model import CEDModel
    from cedlm.train.vision import Examples, accuracy, extend_with_vision, freeze_text, loss_of
    from cedlm.train.vision_anchors import Anchors
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny")
    tok = tokenizer_for_vocab(cfg.vocab_size)
    vc = VisionConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=48,
                      max_image_tokens=64, min_pixels=42 * 42)
    vlm = extend_with_vision(CEDModel(cfg).eval(), tok, vc).eval()
    freeze_text(vlm)
    ex = Examples(vlm, tok, T.digits_split(0)[0][:12], T.DIGIT_QUESTION)

    def run():
        torch.manual_seed(1)
        a = Anchors(vlm, ex)
        la, acc_a = a.loss(vlm, [0, 1, 2])
        return la.item(), acc_a, loss_of(vlm, ex, [0, 1, 2]).item(), accuracy(vlm, tok, ex, limit=3, max_new=2)
    ref = run()
    with implicit_device_guard():
        assert run() == ref


@pytest.mark.parametrize("stage", ["chat", "dspark", "indexer", "vision"])
def test_training_stages_check_the_device_first(stage, capsys):
    rc, out, err = _cli(["train", stage, "--init", "/nonexistent/model", "--out", "/nonexistent/run",
                         "--device", "cuda"], capsys)
    assert rc == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: device: 'cuda' needs a CUDA build"), err


def test_train_device_per_rank():
    from cedlm.train.train import train_device
    assert train_device(None, 1, 0) == torch.device("cpu") == train_device("cpu", 2, 1)
    with pytest.raises(ValueError, match="^device: 'cuda'"):
        train_device("cuda", 2, 1)


def test_eval_ppl_reports_its_device(tmp_path, capsys):
    f = tmp_path / "t.txt"
    f.write_text("The quick brown fox jumps over the lazy dog. " * 4, encoding="utf-8")
    rc, out, err = _cli(["eval", "ppl", "--text", str(f), "--model", "tiny", "--seq-len", "16",
                         "--device", "cpu", "--json"], capsys)
    assert rc == 0, err
    assert "cedlm eval ppl: device cpu (" in err and json.loads(out)["tokens"] > 0


def test_every_engine_command_has_the_option():
    parser = __import__("cedlm.cli", fromlist=["build_parser"]).build_parser()
    sub = next(a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction))
    for name in ("serve", "generate", "bench"):
        assert "--device" in sub.choices[name].format_help(), name
    from cedlm.engine.args import EngineArgs
    assert EngineArgs().device is None
    with pytest.raises(ValueError, match="^device: "):
        EngineArgs(device="cuda")


# ============================================================================ under the guard
@pytest.fixture(params=["torch", "auto"])
def kernel_backend(request):
    """The kernel backend under test: "torch" is the path every device but the CPU runs (the
    compiled kernels are CPU-only); "auto" the compiled CPU kernels where built."""
    from cedlm.kernels.gate import set_fast_backend
    prev = set_fast_backend(request.param)
    yield request.param
    set_fast_backend(prev)


GUARD_PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 40))]
GUARD_PARAMS = [SamplingParams(max_tokens=6, temperature=0),
                SamplingParams(max_tokens=6, temperature=0.8, top_k=20, seed=3, n=2),
                SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2, logprobs=2)]


def _generate(llm, guard: bool, prompts=GUARD_PROMPTS, params=GUARD_PARAMS):
    def run():
        return [(o.token_ids, [c.token_ids for c in o.outputs], o.logprobs, o.prompt_logprobs)
                for o in llm.generate(prompts, params)]
    if not guard:
        return run()
    with implicit_device_guard():            # only the generate call: the model is loaded
        return run()


def test_engine_greedy_is_the_same_under_the_implicit_device_guard(kernel_backend):
    """Every tensor the engine and the model make on the way to a token names its device: with the
    default device set to meta for the generate call alone, the same tokens come out (greedy,
    seeded samples of one prompt sharing its prefill, prompt scoring with top logprobs)."""
    from cedlm.engine.llm import LLM
    llm = LLM("tiny", device="cpu", kv_budget_bytes=8 << 20, max_num_seqs=4)
    ref = _generate(llm, guard=False)
    assert _generate(llm, guard=True) == ref


def test_speculative_engine_is_the_same_under_the_implicit_device_guard(kernel_backend):
    """DSpark speculative decoding (draft, verify, roll back, the drafter's context rows) under the
    guard: the same tokens."""
    from cedlm.config import ModelConfig
    from cedlm.engine.llm import LLM
    from cedlm.model import CEDModel
    torch.manual_seed(0)
    m = CEDModel(ModelConfig.preset("tiny").replace(initializer_range=0.08), dspark=True).eval()
    llm = LLM(m, device="cpu", kv_budget_bytes=8 << 20, speculative="dspark")
    params = [SamplingParams(max_tokens=8, temperature=0), SamplingParams(max_tokens=8, temperature=0.9, seed=7)]
    ref = _generate(llm, False, GUARD_PROMPTS[:2], params)
    assert _generate(llm, True, GUARD_PROMPTS[:2], params) == ref
    assert llm.stats()["spec_steps"] > 0


def _sample_all(logits, params, seeds, hist):
    gens = [make_generator(s, logits.device) for s in seeds]
    res = Sampler().sample(logits, params, gens, histories=hist)
    top = [None if t is None else (t[0].tolist(), t[1].tolist()) for t in res.top_logprobs]
    return res.token_ids.tolist(), res.logprobs.tolist(), top


def test_sampler_under_the_guard():
    """Greedy, seeded and unseeded random rows, top-k / top-p, penalties, logit bias, allowed ids
    and top logprobs: the same samples with the default device on meta."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 64, generator=g)
    params = [SamplingParams(temperature=0, logprobs=3),
              SamplingParams(temperature=0.8, top_k=10, seed=1),
              SamplingParams(temperature=1.0, top_p=0.7, seed=2, repetition_penalty=1.3,
                             frequency_penalty=0.5, presence_penalty=0.2),
              SamplingParams(temperature=0.5, seed=3, logit_bias={5: 3.0, 9: -2.0},
                             allowed_token_ids=[1, 5, 9, 20], logprobs=2),
              SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=4)]
    seeds = [p.seed for p in params]
    hist = [([1, 2], [3]), ([4], []), ([5, 6], [6, 7, 7]), ([], [5]), None]
    ref = _sample_all(logits, params, seeds, hist)
    with implicit_device_guard():
        got = _sample_all(logits, params, seeds, hist)
    assert got == ref
    assert make_generator(None) is None and make_generator(3, torch.device("cpu")).device.type == "cpu"


def test_speculative_pieces_under_the_guard():
    from cedlm.engine.speculative import accept_sampled, probs
    g = torch.Generator().manual_seed(1)
    draft_logits, target_logits = torch.randn(3, 32, generator=g), torch.randn(4, 32, generator=g)
    sp = SamplingParams(temperature=0.9, top_k=8, top_p=0.8, seed=5)

    def run():
        q, p = probs(draft_logits, sp), probs(target_logits, sp)
        return q.tolist(), p.tolist(), accept_sampled([3, 4, 5], q, p, make_generator(5, q.device))
    ref = run()
    with implicit_device_guard():
        assert run() == ref


def test_prompt_scoring_and_constraints_under_the_guard():
    from cedlm.engine.prompt_scoring import prompt_logprobs
    from cedlm.server.constrain import MinPProcessor, MinTokensProcessor
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 40, generator=g)
    ids = [1, 7, 3, 9, 2, 5]

    def run():
        scored = [None if e is None else tuple(e) for e in prompt_logprobs(logits, ids, 3)]
        row = MinTokensProcessor(4, [2, 7, 99])([1], logits[0].clone())
        row = MinPProcessor(0.1, 1.0)([1], row)
        return scored, row.tolist()
    ref = run()
    with implicit_device_guard():
        assert run() == ref


def test_grammar_masks_under_the_guard():
    """Structured output's token masks: built from the host bitmask, moved to the logits' device."""
    from cedlm.server.constrain import Grammars
    from cedlm.text.tokenizer import load_tokenizer
    tok = load_tokenizer("default")
    g = Grammars(tok, tok.vocab_size)
    if not g.available:
        pytest.skip("llguidance is not installed")
    grammar = g.regex("(ab|cd)+x", "guided_regex")
    seq = tok.encode_plain("ab")
    logits = torch.zeros(tok.vocab_size + 3)          # a model vocabulary wider than the tokenizer's

    def run():
        return torch.isfinite(g.processor(grammar, "guided_regex")(seq, logits)).tolist()
    ref = run()
    with implicit_device_guard():
        assert run() == ref
    assert 0 < sum(ref) < tok.vocab_size
