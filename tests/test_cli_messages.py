"""Clear command-line errors: a mistyped sub-command flag is reported with that
sub-command's usage; a missing model dir and an empty text file are one error line, no traceback;
the shipped model card describes the drafter it ships."""
from __future__ import annotations

from pathlib import Path

import pytest

from cedlm.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv,prog", [(["serve", "--bogus-flag"], "cedlm serve"),
                                       (["eval", "ppl", "--text", "x", "--bogus"], "cedlm eval ppl"),
                                       (["generate", "--prompt", "x", "--nope"], "cedlm generate")])
def test_mistyped_flag_names_the_subcommand(argv, prog, capsys):
    with pytest.raises(SystemExit) as ei:
        main(argv)
    err = capsys.readouterr().err
    assert ei.value.code == 2
    assert err.startswith(f"usage: {prog} ") and f"{prog}: error: unrecognized arguments: {argv[-1]}" in err


def test_serve_missing_model_dir_is_one_line(tmp_path, capsys):
    rc = main(["serve", "--model", str(tmp_path / "no-such-model"), "--port", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("cedlm serve: error: model: ") and "no-such-model" in err[0]
    assert "Traceback" not in err[0]


@pytest.mark.parametrize("content", ["", " \n"])
def test_eval_ppl_empty_file_is_one_line(tmp_path, capsys, content):
    f = tmp_path / "empty.txt"
    f.write_text(content, encoding="utf-8")
    rc = main(["eval", "ppl", "--text", str(f), "--model", "tiny"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [f"cedlm eval ppl: error: text: {f} is empty; nothing to score"]


def test_model_card_describes_the_shipped_drafter():
    card = (ROOT / "cedlm/assets/model/README.md").read_text(encoding="utf-8")
    assert (ROOT / "cedlm/assets/model/mtp.safetensors").exists()
    assert "not built or trained by cedlm" not in card
    assert "| DSpark drafter |" in card and "shipped as `mtp.safetensors`" in card
    from cedlm.config import ModelConfig
    from cedlm.train.model_card import model_card
    cfg = ModelConfig.preset("small")
    assert cfg.num_nextn_predict_layers
    assert "is not in this checkpoint" in model_card(cfg)          # no dspark_steps: no drafter, said so
