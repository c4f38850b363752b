"""`cedlm train dspark`: a tiny end-to-end run (target frozen, drafter trained, exported as
mtp.safetensors beside the unchanged target files) and its option errors."""
from __future__ import annotations

import json

import pytest
import torch

from cedlm import checkpoint as ck
from tests.test_chat_stage import make_corpus, save_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tok):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", tok)


def test_tiny_run_trains_only_the_drafter_and_exports_it(tiny_dir, tmp_path, capsys):
    from cedlm.cli import main
    corpus = make_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    rc = main(["train", "dspark", "--init", str(tiny_dir), "--out", str(out), "--data", str(corpus),
               "--cache-dir", str(tmp_path / "cache"), "--steps", "4", "--batch-size", "2",
               "--seq-len", "24", "--anchors", "4", "--updates-per-batch", "2", "--self-gen-seqs", "2",
               "--self-gen-prompt", "8", "--export", str(out / "export")])
    assert rc == 0, capsys.readouterr().err
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["loss"] > 0 for r in rows)
    base, _ = ck.load_model(tiny_dir)
    assert not hasattr(base, "mtp")
    exp, _ = ck.load_model(out / "export")                            # strict load, mtp.* included
    assert hasattr(exp, "mtp")
    for k, v in base.state_dict().items():                             # the target is untouched
        assert torch.equal(exp.state_dict()[k], v), k
    assert (out / "export" / "model.safetensors").read_bytes() == (tiny_dir / "model.safetensors").read_bytes()
    from cedlm.engine.llm import LLM
    from cedlm.engine.sampling_params import SamplingParams
    llm = LLM(str(out / "export"), speculative="dspark", num_threads=1)
    plain = LLM(str(tiny_dir), num_threads=1)
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert llm.generate("It is", p)[0].token_ids == plain.generate("It is", p)[0].token_ids


@pytest.mark.parametrize("flags,msg", [(["--steps", "0"], "--steps"), (["--seq-len", "3"], "--seq-len")])
def test_bad_options(tiny_dir, tmp_path, capsys, flags, msg):
    from cedlm.cli import main
    rc = main(["train", "dspark", "--init", str(tiny_dir), "--out", str(tmp_path / "r"), *flags])
    assert rc == 2 and msg in capsys.readouterr().err
