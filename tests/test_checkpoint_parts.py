"""Model directories with component weight files, and the `cedlm train STAGE` dispatch."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from cedlm import checkpoint as ck
from cedlm.config import ModelConfig
from cedlm.model import CEDModel
from cedlm.train.export import split_parts


@pytest.fixture()
def ckpt(tmp_path, tok):
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny").replace(vocab_size=tok.vocab_size,
                                             engram_compressed_vocab_size=tok.vocab_size)
    model = CEDModel(cfg).eval()
    ck.set_token_map(model, tok)
    return ck.save_checkpoint(tmp_path / "ckpt", model, tok), model


def test_split_parts_routes_by_prefix():
    t = torch.zeros(1)
    parts = split_parts({"embed.weight": t, "mtp.0.main_proj.weight": t, "vision.blocks.0.w": t,
                         "aligner.fc1.weight": t, "image_newline": t})
    assert sorted(parts["model"]) == ["embed.weight"]
    assert sorted(parts["mtp"]) == ["mtp.0.main_proj.weight"]
    assert sorted(parts["vision"]) == ["aligner.fc1.weight", "image_newline", "vision.blocks.0.w"]


def test_component_files_merge_and_load_strictly(ckpt):
    path, model = ckpt
    sd = load_file(str(path / "model.safetensors"))
    moved = {k: v for k, v in sd.items() if k.startswith("layers.1.")}
    save_file({k: v for k, v in sd.items() if k not in moved}, str(path / "model.safetensors"))
    save_file(moved, str(path / "extra.safetensors"))
    assert [f.name for f in ck.weight_files(path)] == ["model.safetensors", "extra.safetensors"]
    loaded, _ = ck.load_model(path)                       # strict: both files are needed
    x = torch.randint(0, model.cfg.vocab_size, (1, 12))
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    (path / "extra.safetensors").unlink()
    with pytest.raises(RuntimeError, match="Missing key"):
        ck.load_model(path)


def test_tensor_in_two_files_is_an_error(ckpt):
    path, _ = ckpt
    sd = load_file(str(path / "model.safetensors"))
    save_file({"embed.weight": sd["embed.weight"]}, str(path / "dup.safetensors"))
    with pytest.raises(ValueError, match="embed.weight.*model.safetensors.*dup.safetensors"):
        ck.read_weights(path)


def test_pretraining_flags_are_refused_with_a_stage(capsys):
    """Each stage has a parser of its own: a pretraining flag after a stage's name is an
    argparse error naming it, never a flag silently ignored."""
    from cedlm.cli import main
    with pytest.raises(SystemExit) as e:
        main(["train", "chat", "--out", "x", "--preset", "tiny"])
    assert e.value.code == 2 and "--preset" in capsys.readouterr().err
