"""The peer figure's second peer: llama.cpp (through llama-cpp-python) on the same HF Llama.

The equal-parameter `LlamaForCausalLM` the peer figure builds is saved with `save_pretrained`
(plus a synthetic Llama-style tokenizer of its vocabulary size: the converter needs one, the
benchmark never tokenizes text) and converted to GGUF F32 and F16 by llama.cpp's own
`convert_hf_to_gguf.py`, the one vendored in the llama-cpp-python sdist of LLAMA_CPP_PIN (kept in
`converter_dir()`), run with the `gguf` package of the same llama.cpp: the sdist's vendored
gguf-py, installed from there (PyPI's newest gguf, 0.19.0, predates this converter). Each GGUF is
loaded with `llama_cpp.Llama(n_threads=<the bench's threads>, n_ctx=context + new)`, prefilled
with `context` random tokens once (timed apart, not in the decode figure), and every timed run
rewinds to the prefilled context and decodes `new` tokens greedily (argmax of the last logits),
batch 1: llama-cpp-python decodes one sequence, so batch 8 is reported as n/a.

Opt-in like the HF peer: `--install-peer` pip-installs LLAMA_CPP_PIN (an sdist: cmake/gcc build,
minutes), that gguf and sentencepiece (which the converter imports) when absent, unpacks the converter from the sdist; without them the
llama.cpp columns are skipped with a one-line reason, and nothing is installed unasked.
"""
from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from cedlm.bench.common import md_table, target

LLAMA_CPP_VERSION = "0.3.36"
LLAMA_CPP_PIN = f"llama-cpp-python=={LLAMA_CPP_VERSION}"
# the converter imports sentencepiece before it looks for a tokenizer.model (its requirements:
# sentencepiece>=0.1.98,<0.3.0)
SENTENCEPIECE_PIN = "sentencepiece==0.2.3"
OUTTYPES = ("f32", "f16")
TARGETS = {512: 1.0, 2048: 1.0, 8192: 1.5, 32768: 3.0}   # CED / llama.cpp F32, batch 1
BANDWIDTH_TARGET = 0.5                  # CED's weight-read bandwidth fraction, batch 1
CONVERTER = "convert_hf_to_gguf.py"
_VENDOR = "vendor/llama.cpp/"


def converter_dir() -> Path:
    """Where llama.cpp's converter is kept: `$CEDLM_LLAMA_CPP_CONVERTER_DIR`, else
    `$XDG_CACHE_HOME/cedlm/llama.cpp-<version>` (`~/.cache/cedlm/...`)."""
    env = os.environ.get("CEDLM_LLAMA_CPP_CONVERTER_DIR", "").strip()
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "cedlm" / f"llama.cpp-{LLAMA_CPP_VERSION}"


def _pip(args: list[str], log, timeout: int = 3600) -> str | None:
    """Run pip in this interpreter; None on success, else a one-line reason."""
    cmd = [sys.executable, "-m", "pip", *args]
    log(f"  pip {' '.join(args)} ...")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as e:
        return f"pip {args[0]} failed: {e}"
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return f"pip {args[0]} failed: {' / '.join(tail)}"
    return None


def unpack_converter(sdist: Path, dest: Path) -> Path:
    """Extract llama.cpp's `convert_hf_to_gguf.py`, its `conversion/` package and its `gguf-py/`
    (the gguf package it is written against) from a llama-cpp-python sdist into `dest`; the
    script's path."""
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            rel = m.name.split("/", 1)[1] if "/" in m.name else ""
            if not rel.startswith(_VENDOR) or not m.isfile():
                continue
            rel = rel[len(_VENDOR):]
            if rel != CONVERTER and not rel.startswith(("conversion/", "gguf-py/")):
                continue
            if ".." in Path(rel).parts:
                raise ValueError(f"unpack_converter: unsafe path {m.name!r} in {sdist}")
            out = tmp / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(tar.extractfile(m).read())
    if not (tmp / CONVERTER).is_file() or not (tmp / "gguf-py" / "pyproject.toml").is_file():
        raise ValueError(f"unpack_converter: {sdist} has no {_VENDOR}{CONVERTER} or gguf-py")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest / CONVERTER


def _gguf_missing() -> str | None:
    """Why the installed `gguf` cannot run the converter, or None. PyPI's newest gguf (0.19.0)
    predates this converter (it lacks `LazyChunkedTensor`, which the converter's writer calls):
    the matching package is the sdist's own `gguf-py`, installed from `converter_dir()`."""
    if importlib.util.find_spec("gguf") is None:
        return f"gguf (the {LLAMA_CPP_PIN} sdist's vendored gguf-py)"
    import gguf
    if not hasattr(gguf, "LazyChunkedTensor"):
        return (f"a gguf matching the converter (gguf {md.version('gguf')} is installed, without "
                f"LazyChunkedTensor: the sdist's vendored gguf-py is needed)")
    return None


def ensure_llama_cpp(install: bool, log=print) -> tuple[object | None, str, Path | None]:
    """(the llama_cpp module, how it was found, the converter script), or (None, the one-line
    reason, None) when something is missing and `install` is False or installing failed."""
    script = converter_dir() / CONVERTER
    need_lc = importlib.util.find_spec("llama_cpp") is None
    need_sp = importlib.util.find_spec("sentencepiece") is None
    need_gguf = _gguf_missing()
    need_script = not script.is_file()
    missing = ([LLAMA_CPP_PIN] if need_lc else []) + ([need_gguf] if need_gguf else []) + (
        [SENTENCEPIECE_PIN] if need_sp else []) + (
        [f"llama.cpp's {CONVERTER} (from the {LLAMA_CPP_PIN} sdist, kept in {converter_dir()})"]
        if need_script else [])
    if missing and not install:
        return None, (f"llama.cpp peer skipped: missing {'; '.join(missing)} (nothing is "
                      f"installed unasked: pass --install-peer)"), None
    if missing:
        cons = []
        for dist in ("torch", "numpy"):
            try:
                cons.append(f"{dist}=={md.version(dist).split('+')[0]}")
            except md.PackageNotFoundError:
                pass
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "c.txt").write_text("\n".join(cons) + "\n")
            sdists = []
            if need_lc or need_gguf or need_script:
                err = _pip(["download", "--quiet", "--no-deps", "--no-binary", ":all:",
                            LLAMA_CPP_PIN, "-d", d], log, timeout=900)
                sdists = sorted(Path(d).glob("llama_cpp_python-*.tar.gz"))
                if err or not sdists:
                    return None, f"llama.cpp peer skipped: {err or 'no sdist downloaded'}", None
            if need_script or need_gguf:
                try:
                    script = unpack_converter(sdists[0], converter_dir())
                except (OSError, ValueError, tarfile.TarError) as e:
                    return None, f"llama.cpp peer skipped: {e}", None
            steps = ([("llama-cpp-python (builds from source with cmake/gcc: minutes)",
                       str(sdists[0]))] if need_lc else []) + (
                [("gguf (the sdist's gguf-py)", str(converter_dir() / "gguf-py"))]
                if need_gguf else []) + (
                [("sentencepiece (the converter imports it)", SENTENCEPIECE_PIN)] if need_sp else [])
            for what, src in steps:
                log(f"  installing {what}")
                err = _pip(["install", "--quiet", src, "-c", str(Path(d) / "c.txt")], log)
                if err:
                    return None, f"llama.cpp peer skipped: {err}", None
        importlib.invalidate_caches()
    try:
        import gguf  # noqa: F401  (the converter's writer; checked here so its absence is reported)
        import llama_cpp
    except ImportError as e:
        return None, f"llama.cpp peer skipped: llama_cpp / gguf do not import: {e}", None
    how = (f"llama-cpp-python {llama_cpp.__version__}, gguf {md.version('gguf')} (the sdist's "
           f"gguf-py), converter {script} ("
           f"{'installed by the benchmark' if missing else 'already installed'})")
    return llama_cpp, how, script


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A Llama-style (BPE with byte fallback) tokenizer of exactly `vocab_size` tokens in
    `directory`: <unk> <s> </s>, the 256 byte tokens, then filler words. The converter reads the
    vocabulary from it; no text is ever tokenized by the benchmark."""
    from tokenizers import Tokenizer, decoders, models
    specials = ["<unk>", "<s>", "</s>"]
    vocab = specials + [f"<0x{i:02X}>" for i in range(256)]
    if vocab_size < len(vocab) + 1:
        raise ValueError(f"write_tokenizer: vocab_size must be > {len(vocab)}, got {vocab_size}")
    vocab += [f"\u2581w{i}" for i in range(vocab_size - len(vocab))]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=[],
                               unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(specials)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": False, "add_eos_token": False}))


def convert(hf_model, script: Path, workdir: Path, outtypes=OUTTYPES, log=print) -> dict:
    """Save `hf_model` into `workdir/hf` and convert it with llama.cpp's converter: outtype ->
    GGUF path. Raises RuntimeError with the converter's last lines when it fails."""
    hf_dir = workdir / "hf"
    hf_model.save_pretrained(hf_dir)
    write_tokenizer(hf_dir, hf_model.config.vocab_size)
    env = {**os.environ, "NO_LOCAL_GGUF": "1"}      # the installed gguf, never a vendored copy
    paths = {}
    for t in outtypes:
        out = workdir / f"peer-{t}.gguf"
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, str(script), str(hf_dir), "--outtype", t,
                            "--outfile", str(out)], capture_output=True, text=True, env=env,
                           cwd=script.parent, timeout=1800)
        if p.returncode != 0 or not out.is_file():
            tail = (p.stderr or p.stdout).strip().splitlines()[-4:]
            raise RuntimeError(f"{CONVERTER} --outtype {t} failed: {' / '.join(tail)}")
        log(f"  converted to GGUF {t.upper()} in {time.perf_counter() - t0:.1f} s "
            f"({out.stat().st_size / 2**20:.1f} MiB)")
        paths[t] = out
    return paths


def gguf_weights(path: Path, vocab_size: int) -> dict:
    """Parameters of a GGUF file and the bytes of weights one decoded token reads: every tensor
    at its stored size (F32 / F16 weights, F32 norms) except the token embedding, of which one
    row is read."""
    import gguf
    params, per_token = 0, 0
    for t in gguf.GGUFReader(str(path)).tensors:
        params += int(t.n_elements)
        per_token += int(t.n_bytes) // vocab_size if t.name == "token_embd.weight" else int(t.n_bytes)
    return {"params": params, "bytes_per_token": per_token}


class LlamaCppStream:
    """One GGUF model in llama.cpp holding a prefilled context of `context` random tokens.

    `decode(n)` rewinds the KV cache to the prefilled tokens and decodes `n` tokens greedily,
    one `eval` (one llama.cpp decode call) per token, as CED's and HF's loops decode one step
    per token; `prefill_s` is the prefill's wall time (not part of the decode figure)."""

    def __init__(self, llama_cpp, path: Path, context: int, new: int, threads: int, seed: int):
        import numpy as np
        self._np, self._lc = np, llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=context + new, n_threads=threads,
                                   n_threads_batch=threads, seed=seed, verbose=False)
        self.vocab = self.llm.n_vocab()
        self.context = context
        rng = np.random.default_rng(seed)
        tokens = rng.integers(3, self.vocab, size=context).tolist()
        t0 = time.perf_counter()
        self.llm.eval(tokens)
        self.prefill_s = time.perf_counter() - t0
        self.first = self._argmax()

    def _argmax(self) -> int:
        logits = self._lc.llama_get_logits_ith(self.llm.ctx, -1)
        return int(self._np.ctypeslib.as_array(logits, shape=(self.vocab,)).argmax())

    def decode(self, n: int) -> list[int]:
        self.llm.n_tokens = self.context        # the next eval drops every later KV entry
        tok, out = self.first, []
        for _ in range(n):
            self.llm.eval([tok])
            tok = self._argmax()
            out.append(tok)
        return out

    def close(self) -> None:
        self.llm.close()


class LlamaCppPeer:
    """The converted GGUF files of one HF Llama and what each reads per token; `streams` loads
    them at one context. `close()` deletes the files."""

    def __init__(self, llama_cpp, how: str, hf_model, script: Path, log=print):
        self.llama_cpp, self.how = llama_cpp, how
        self._dir = Path(tempfile.mkdtemp(prefix="cedlm-peer-gguf-"))
        try:
            self.paths = convert(hf_model, script, self._dir, log=log)
            vocab = hf_model.config.vocab_size
            self.weights = {t: gguf_weights(p, vocab) for t, p in self.paths.items()}
        except BaseException:
            self.close()
            raise
        shutil.rmtree(self._dir / "hf", ignore_errors=True)

    def streams(self, context: int, new: int, threads: int, seed: int) -> dict:
        """outtype -> a LlamaCppStream prefilled with `context` tokens."""
        return {t: LlamaCppStream(self.llama_cpp, p, context, new, threads, seed)
                for t, p in self.paths.items()}

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)


def setup(ctx, hf_model) -> tuple[LlamaCppPeer | None, str]:
    """The llama.cpp peer for the figure, or None and the one-line reason it is skipped."""
    llama_cpp, how, script = ensure_llama_cpp(ctx.install, ctx.log)
    if llama_cpp is None:
        return None, how
    try:
        return LlamaCppPeer(llama_cpp, how, hf_model, script, ctx.log), how
    except (RuntimeError, OSError, ValueError, subprocess.SubprocessError) as e:
        return None, f"llama.cpp peer skipped: {e}"


def targets(rows: list[dict], contexts: list[int]) -> dict:
    """CED / llama.cpp F32 per context and CED's bandwidth fraction (batch 1 rows)."""
    one = {r["context"]: r for r in rows if r["batch"] == 1}
    out = {f"vs_llamacpp_f32_{C}": target(
        f"CED / llama.cpp F32 decode tokens/s at {C:,} context, batch 1", ">=",
        TARGETS.get(C, 1.0), one[C]["ratio_vs_llamacpp_f32"]) for C in contexts}
    C = min(contexts)
    r = one[C]
    out["bandwidth_fraction"] = target(
        f"CED weight-read bandwidth fraction at {C:,} context, batch 1", ">=", BANDWIDTH_TARGET,
        r["ced_bandwidth_fraction"],
        note="llama.cpp F32 / F16: " + " / ".join(
            "n/a" if r[f"llamacpp_{t}_bandwidth_fraction"] is None
            else f"{r[f'llamacpp_{t}_bandwidth_fraction']:.2f}" for t in OUTTYPES))
    return out


def _f(x, fmt="{:.2f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def table(res: dict) -> str:
    """The peer figure's batch-1 table against llama.cpp ('' when the figure has no llama.cpp
    columns): tokens/s of every engine, CED's ratios and the bandwidth fractions side by side."""
    c = res["config"]
    one = [r for r in res["rows"] if r["batch"] == 1]
    if not one or "ratio_vs_llamacpp_f32" not in one[0]:
        return ""
    body = [[r["context"], f"{r['ced_tokens_per_s']:.1f}", f"{r['hf_tokens_per_s']:.1f}",
             _f(r["llamacpp_f32_tokens_per_s"], "{:.1f}"), _f(r["llamacpp_f16_tokens_per_s"], "{:.1f}"),
             _f(r["ratio_vs_llamacpp_f32"]), f">= {r['target_vs_llamacpp_f32']}",
             _f(r["ratio_vs_llamacpp_f16"]), _f(r["ced_bandwidth_fraction"]),
             _f(r["llamacpp_f32_bandwidth_fraction"]), _f(r["llamacpp_f16_bandwidth_fraction"])]
            for r in one]
    bw = c["read_bandwidth"]
    sizes = "".join(f", llama.cpp {t.upper()} {w['bytes_per_token'] / 1e6:.1f} MB/token"
                    for t, w in (c.get("llamacpp_weights") or {}).items())
    return ("\n\nBatch 1 against llama.cpp (the same Llama as GGUF; batch 8: "
            f"{c['llamacpp_batch8']}). BW = bandwidth fraction: weight bytes per token x tok/s / "
            f"{bw['bytes_per_s'] / 1e9:.1f} GB/s (single-thread read, measured in this run; "
            f"CED {c['ced_bytes_per_token'] / 1e6:.1f} MB/token{sizes}):\n\n"
            + md_table(["context", "CED tok/s", "HF tok/s", "llama.cpp F32", "llama.cpp F16",
                        "CED / F32", "target", "CED / F16", "BW CED", "BW F32", "BW F16"], body)
            + f"\n\n{c['llama_cpp']}.")
