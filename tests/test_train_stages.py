"""`cedlm train pretrain|chat|indexer|dspark|vision`: each stage's --help, the old spelling of
pretraining, the shared runner (schedule, time budget, loop), and a smoke run of every stage (a
tiny model, a few steps) that writes its checkpoint, metrics and summary."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from cedlm import checkpoint as ck
from cedlm.cli import main
from cedlm.train.optim import cosine_lr
from cedlm.train.runner import MetricsLog, StepLoop, TimeBudget, run_steps
from tests.test_chat_stage import make_corpus, save_tiny_checkpoint

STAGES = ["pretrain", "chat", "indexer", "dspark", "vision"]


@pytest.mark.parametrize("stage", STAGES)
def test_help(stage, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", stage, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and f"usage: cedlm train {stage}" in out and "--out" in out


def test_a_stage_is_required_and_flags_are_not_abbreviated(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train"])
    assert e.value.code == 2 and "STAGE" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:                  # --thread is not --threads
        main(["train", "chat", "--out", "x", "--thread", "1"])
    assert e.value.code == 2 and "--thread" in capsys.readouterr().err


def test_old_spelling_means_pretrain(capsys):
    from cedlm.cli import build_parser
    from cedlm.train.cli import legacy_argv
    argv = legacy_argv(["train", "--preset", "tiny", "--steps", "5"])
    assert argv[:2] == ["train", "pretrain"] and "deprecated" in capsys.readouterr().err
    a = build_parser().parse_args(argv)
    assert a.stage == "pretrain" and a.preset == "tiny" and a.steps == 5
    assert legacy_argv(["train", "chat", "--out", "x"]) == ["train", "chat", "--out", "x"]


def test_cosine_lr():
    lr = [cosine_lr(i, peak=1.0, min_lr=0.1, warmup=2, total=6) for i in range(8)]
    assert lr[:3] == [0.5, 1.0, 1.0] and lr[6] == lr[7] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lr[2:], lr[3:]))
    # a time budget ends the decay at its limit even when steps remain
    assert cosine_lr(3, peak=1.0, min_lr=0.1, warmup=2, total=100, time_frac=1.0) == pytest.approx(0.1)
    assert cosine_lr(3, peak=1.0, min_lr=0.1, warmup=2, time_frac=0.5) == pytest.approx(0.55)


def test_run_steps_evaluates_saves_and_stops_on_time(tmp_path):
    seen = {"eval": [], "save": 0}

    def loop(budget, stop=5):
        return StepLoop(name="t", step=lambda i: {"step": i + 1}, stop=stop,
                        metrics=MetricsLog(tmp_path / "m.jsonl"), budget=budget,
                        evaluate=lambda r: seen["eval"].append(r["step"]), eval_every=2, eval_at_end=True,
                        save=lambda: seen.__setitem__("save", seen["save"] + 1), save_every=3)
    assert run_steps(loop(TimeBudget())) == (5, False)
    assert seen == {"eval": [2, 4, 5], "save": 2}
    assert [json.loads(x)["step"] for x in (tmp_path / "m.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]
    seen["eval"].clear()
    assert run_steps(loop(TimeBudget(seconds=0.0))) == (1, True)    # at least one step, then stop
    assert seen["eval"] == [1]                                      # the last step is evaluated
    b = TimeBudget(seconds=0.05).begin()
    time.sleep(0.06)
    assert b.over() and b.frac() == 1.0 and not TimeBudget().begin().over()


# ----------------------------------------------------------------------------- smoke runs
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("stage_corpus"))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tok):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", tok)


def _run_dir_ok(out: Path, n_steps: int, summary: str = "summary.json") -> list[dict]:
    """The run directory has a loadable checkpoint, metrics.jsonl of n_steps records and a summary."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r][-n_steps:] == list(range(1, n_steps + 1))
    assert json.loads((out / summary).read_text())
    model, _ = ck.load_model(out)
    assert model is not None
    return rows


def test_pretrain_smoke(corpus, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "pretrain", "--preset", "tiny", "--data", str(corpus), "--out", str(out),
                 "--steps", "3", "--batch-size", "2", "--seq-len", "16", "--eval-every", "2",
                 "--eval-batches", "1", "--warmup", "1", "--threads", "1", "--no-progress"]) == 0
    rows = _run_dir_ok(out, 3, summary="checkpoint/training_args.json")
    assert [("val_loss" in r) for r in rows] == [False, True, True]    # every 2 steps and the last
    assert (out / "loss.png").exists()


def test_chat_smoke(tiny_dir, corpus, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "chat", "--init", str(tiny_dir), "--out", str(out), "--data", str(corpus),
                 "--steps", "2", "--batch-size", "2", "--max-len", "128", "--examples", "6",
                 "--heldout", "0", "--no-progress"]) == 0
    _run_dir_ok(out, 2)
    assert json.loads((out / "summary.json").read_text())["chat_steps"] == 2


def test_indexer_smoke(tiny_dir, corpus, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "indexer", "--init", str(tiny_dir), "--out", str(out), "--data", str(corpus),
                 "--seq-len", "96", "--items", "1", "--min-gap", "16", "--warmup-steps", "1", "--steps", "1",
                 "--no-progress"]) == 0
    rows = _run_dir_ok(out, 2)
    assert [r["phase"] for r in rows] == ["dense", "sparse"]
    assert json.loads((out / "summary.json").read_text())["steps"] == 2


def test_dspark_smoke(tiny_dir, corpus, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "dspark", "--init", str(tiny_dir), "--out", str(out), "--data", str(corpus),
                 "--cache-dir", str(tmp_path / "cache"), "--steps", "2", "--batch-size", "2",
                 "--seq-len", "24", "--anchors", "2", "--self-gen-seqs", "0"]) == 0
    _run_dir_ok(out, 2)
    assert json.loads((out / "summary.json").read_text())["dspark_steps"] == 2


def test_vision_smoke(tiny_dir, tmp_path):
    pytest.importorskip("sklearn")
    out = tmp_path / "run"
    assert main(["train", "vision", "--init", str(tiny_dir), "--out", str(out), "--minutes", "1", "--eval-limit", "4",
                 "--anchor-frac", "0", "--regress-frac", "0", "--steps", "2", "--batch", "2",
                 "--word-examples", "4", "--vision-layers", "1", "--vision-width", "32",
                 "--eval-every", "2", "--e2e-tasks", "digits"]) == 0
    rows = _run_dir_ok(out, 2, summary="eval.json")
    assert "digits_heldout_acc_100" in rows[-1]
    assert json.loads((out / "eval.json").read_text())["end_to_end_steps"] == 2
    assert (out / "export" / "vision.safetensors").exists()


def _documented_train_commands() -> list[tuple[str, list[str]]]:
    """(file, argv after `cedlm`) of every `cedlm train ...` command line in the docs' code blocks
    (continuation lines joined; lines using shell variables skipped)."""
    import shlex
    root = Path(__file__).resolve().parents[1]
    out = []
    names = ["README.md", "FIDELITY.md", "BENCHMARKS.md", "docs/fidelity/notes.md"]
    names += sorted(p.relative_to(root).as_posix() for p in (root / "docs").glob("*.md"))
    for name in names:
        path = root / name
        if not path.exists():
            continue
        text = path.read_text(encoding="utf-8").replace("\\\n", " ")
        for line in text.splitlines():
            line = line.split(" # ")[0].strip()
            for prefix in (".venv/bin/cedlm train ", "cedlm train "):
                if line.startswith(prefix) and "$" not in line:
                    out.append((name, ["train", *shlex.split(line[len(prefix):])]))
    return out


def test_documented_train_commands_parse():
    """Every `cedlm train` command of the README, docs/*.md (the shipped model's stages), FIDELITY and
    BENCHMARKS parses with the stage parsers as written."""
    from cedlm.cli import build_parser
    cmds = _documented_train_commands()
    assert len({a[1] for _, a in cmds}) == 5                  # all five stages are documented
    parser = build_parser()
    for name, argv in cmds:
        a = parser.parse_args(argv)
        assert a.stage == argv[1] and a.func, (name, argv)
