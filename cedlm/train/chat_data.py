"""Chat-stage data: short supervised conversations built from the corpus, in the V4.1 chat encoding.

Every example is a message list rendered with cedlm's own encoder (`cedlm.text.chat`, the one the
server uses), so the prompt a model sees in training is byte for byte the prompt `cedlm serve` builds
for the same messages. The loss mask covers the assistant turns only: their content and the EOS
token that closes each turn (the token the engine stops on, `tokenizer.eos_id`), plus the
`</think>`-terminated reasoning of a thinking-mode turn.

Tasks, all from corpus documents (`corpus_documents`: each document with the source it came from,
recovered from the manifest, whose per-source document counts are in file order):

- `source`: which book or source a quote is from (Austen, the KJV, the Python docs, the standard
  library code, a State of the Union address, Moby-Dick);
- `bible_book`: which book and chapter of the Bible a verse is from;
- `continue`: the next sentence of a passage;
- `explain`: what a standard-library function does, from the first sentence of its docstring
  (the docstring is removed from the code shown);
- `smalltalk`: greetings, identity, thanks, what it can do;
- `novel`: which Austen novel, or which chapter of Moby-Dick, a passage is from (the title
  tracked through the source's documents in file order);
- `fact`: questions answered from the corpus without a quote: who wrote a novel, what a chapter
  of Moby-Dick is called, what a standard-library function does (named, no code shown), what a
  section of the Python documentation says (its first sentence);
- `names`: which people and places a passage names (its capitalised names, in order): an answer
  read from the prompt;
- multi-turn conversations chaining two or three of the above.

`DEFAULT_WEIGHTS` (and so the held-out set of `heldout_examples`) draws the first five tasks;
a mixture's `chat_tasks` weighs all of them.

Answers are one short sentence, so a reply ends in a few dozen tokens. Everything is drawn from one
seeded `random.Random`: the same corpus, seed and count give the same examples.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cedlm.text.chat import encode_chat_ids
from cedlm.text.documents import iter_documents

# source name -> how an answer names it; the keyword that identifies it in a reply
SOURCE_NAMES = {
    "austen": ("a novel by Jane Austen", "Austen"),
    "kjv": ("the King James Bible", "King James"),
    "pydoc": ("the Python documentation", "Python documentation"),
    "pystdlib": ("the Python standard library source code", "standard library"),
    "sotu": ("a State of the Union address", "State of the Union"),
    "moby": ("Moby-Dick by Herman Melville", "Moby-Dick"),
}
TASKS = ("source", "bible_book", "continue", "explain", "smalltalk", "novel", "fact", "names")
DEFAULT_WEIGHTS = {"source": 0.3, "bible_book": 0.1, "continue": 0.25, "explain": 0.15, "smalltalk": 0.2}

SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are cedlm, a small language model. Answer briefly.",
                  "Answer in one sentence.", "You are a helpful, concise assistant."]

SOURCE_QUESTIONS = ["Which book or source is this quote from?\n\n{q}",
                    "Where does this passage come from?\n\n\"{q}\"",
                    "Identify the source of this text:\n\n{q}",
                    "{q}\n\nWhat is the source of the text above?",
                    "Which of the texts you know is this from?\n\n{q}"]
SOURCE_ANSWERS = ["It is from {name}.", "This passage is from {name}.", "That is from {name}."]
BIBLE_QUESTIONS = ["Which book of the Bible is this verse from?\n\n{q}",
                   "Where in the Bible is this verse?\n\n\"{q}\"",
                   "Name the book of the Bible this comes from: {q}"]
CONTINUE_QUESTIONS = ["Continue this passage:\n\n{q}", "What comes next?\n\n{q}",
                      "Continue the text with one sentence.\n\n{q}", "{q}\n\nContinue."]
EXPLAIN_QUESTIONS = ["What does this Python function do?\n\n```python\n{q}\n```",
                     "Explain this function briefly:\n\n```python\n{q}\n```",
                     "```python\n{q}\n```\n\nWhat is `{name}` for?"]
SMALLTALK = [
    (["Hello", "Hi", "Hi!", "Hello!", "Hey", "Good morning", "hello", "hi there", "Hello there!"],
     ["Hello! How can I help you today?", "Hi! What can I do for you?", "Hello! Ask me anything."]),
    (["Who are you?", "What are you?", "What is your name?", "Introduce yourself."],
     ["I am cedlm, a small DeepSeek-V4.1-style language model trained on a small corpus of books, "
      "speeches and Python documentation.",
      "I'm cedlm, a small language model with the DeepSeek-V4.1 architecture."]),
    (["What can you do?", "How can you help me?", "What do you know?"],
     ["I can continue a passage, tell which book a quote is from, and explain Python functions.",
      "I know Jane Austen, the King James Bible, Moby-Dick, State of the Union addresses and Python. "
      "Ask me about a quote or a function."]),
    (["Thanks!", "Thank you.", "Thanks a lot", "thank you"],
     ["You're welcome!", "Glad to help.", "You're welcome. Anything else?"]),
    (["Bye", "Goodbye!", "See you later."], ["Goodbye!", "Bye! Have a nice day."]),
    (["How are you?", "How are you doing?"], ["I'm fine, thank you. How can I help?"]),
]
THINKING = {"source": "The user asks where a quote comes from.", "bible_book": "A verse; which book?",
            "continue": "The user wants the next sentence.", "explain": "Summarise the docstring.",
            "smalltalk": "A short social message.", "novel": "Which novel or chapter is this passage from?",
            "fact": "A question about the texts I know.", "names": "List the names in the passage."}

AUSTEN_TITLES = {"EMMA": "Emma", "MANSFIELD PARK": "Mansfield Park", "PERSUASION": "Persuasion",
                 "PRIDE AND PREJUDICE": "Pride and Prejudice", "NORTHANGER ABBEY": "Northanger Abbey",
                 "SENSE AND SENSIBILITY": "Sense and Sensibility"}
NOVEL_QUESTIONS = ["Which Jane Austen novel is this passage from?\n\n{q}",
                   "Which novel is this from?\n\n\"{q}\"",
                   "{q}\n\nWhich book is this passage from?",
                   "Name the novel this comes from: {q}"]
MOBY_QUESTIONS = ["Which chapter of Moby-Dick is this from?\n\n{q}",
                  "{q}\n\nWhere in Moby-Dick is this passage?",
                  "In which chapter of Moby-Dick does this appear?\n\n\"{q}\""]
AUTHOR_QUESTIONS = ["Who wrote {t}?", "Who is the author of {t}?", "Who wrote the novel {t}?",
                    "{t} was written by whom?"]
CHAPTER_QUESTIONS = ["What is chapter {n} of Moby-Dick called?", "What is the title of chapter {n} of Moby-Dick?",
                     "Name chapter {n} of Moby-Dick."]
FUNCTION_QUESTIONS = ["What does the Python function `{name}` do?", "What is `{name}` for?",
                      "Explain the function `{name}` from the Python standard library.",
                      "What does `{name}()` do?"]
SECTION_QUESTIONS = ["What does the Python documentation say about \"{t}\"?",
                     "Summarise the Python documentation section \"{t}\".",
                     "In the Python docs, what is \"{t}\" about?"]
NAMES_QUESTIONS = ["Who or what is named in this passage?\n\n{q}", "{q}\n\nWhich names appear in this text?",
                   "List the names in this passage:\n\n\"{q}\""]
_NAME_STOP = {"I", "The", "A", "An", "And", "But", "It", "He", "She", "They", "We", "You", "His", "Her",
              "This", "That", "In", "Of", "O", "Lord", "God", "LORD", "Sir", "My", "Oh", "Yes", "No"}
_NAME = re.compile(r"\b((?:Mr|Mrs|Miss|Dr|Captain|Lady|Sir|Colonel)\.? [A-Z][a-z]+|[A-Z][a-z]{2,})\b")
_MOBY_HEAD = re.compile(r"^CHAPTER (\d+)\. (.+?)\.?\n")
_RST_TITLE = re.compile(r"(?:^|\n)([A-Za-z][^\n]{3,60})\n([=*\-~^]{4,})\n\n(.+?)(?:\n\n|$)", re.S)

_SENT = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")
_DEF = re.compile(r'^([ \t]*)def (\w+)\(([^)]*)\)(?:[ \t]*->[^:\n]+)?:\n\1[ \t]+[ru]?"""(.*?)"""[ \t]*\n'
                  r'((?:\1[ \t]+[^\n]*\n|[ \t]*\n){0,4})', re.M | re.S)


# ----------------------------------------------------------------------------- corpus


def corpus_documents(corpus_dir: str | Path, split: str = "train") -> list[tuple[str, str]]:
    """[(source, document text)] of `split` ("train" or "val") of a prepared corpus: the manifest
    lists each source's document count in file order (`cedlm.data.corpus.prepare`)."""
    corpus_dir = Path(corpus_dir)
    manifest = json.loads((corpus_dir / "manifest.json").read_text("utf-8"))
    docs = list(iter_documents(corpus_dir / f"{split}.txt"))
    counts = [(name, st[f"{split}_docs"]) for name, st in manifest["sources"].items()]
    if sum(n for _, n in counts) != len(docs):
        raise ValueError(f"data: {corpus_dir}/{split}.txt has {len(docs)} documents but the manifest "
                         f"lists {sum(n for _, n in counts)}; re-run `cedlm data prepare`")
    out, i = [], 0
    for name, n in counts:
        out += [(name, d) for d in docs[i: i + n]]
        i += n
    return out


def sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENT.split(" ".join(text.split())) if s.strip()]


def _paragraphs(doc: str, min_chars: int = 120) -> list[str]:
    return [p for p in doc.split("\n\n") if len(p) >= min_chars and not p.lstrip().startswith((".. ", "::"))]


def _clip(s: str, n: int) -> str:
    """At most n chars, cut at a word boundary."""
    if len(s) <= n:
        return s
    return s[:n].rsplit(" ", 1)[0]


# ----------------------------------------------------------------------------- tasks


def _quote(rng: random.Random, source: str, doc: str) -> str | None:
    if source in ("pystdlib", "pydoc"):       # a few consecutive non-blank lines
        lines = [ln for ln in doc.split("\n") if ln.strip()]
        if len(lines) < 4:
            return None
        k = rng.randrange(0, len(lines) - 3)
        q = "\n".join(lines[k: k + rng.randint(2, 4)])
        return q[:240] if len(q) >= 40 else None
    if source == "kjv":
        verses = [re.sub(r"^\d+ ", "", ln) for ln in doc.split("\n")[2:] if re.match(r"^\d+ ", ln)]
        return rng.choice(verses)[:240] if verses else None
    paras = _paragraphs(doc)
    if not paras:
        return None
    sents = sentences(rng.choice(paras))
    k = rng.randrange(len(sents))
    q = " ".join(sents[k: k + rng.randint(1, 2)])
    return _clip(q, 240) if len(q) >= 40 else None


def task_source(rng, docs_by_source) -> list[dict] | None:
    source = rng.choice(sorted(docs_by_source))
    q = _quote(rng, source, rng.choice(docs_by_source[source]))
    if q is None:
        return None
    return [{"role": "user", "content": rng.choice(SOURCE_QUESTIONS).format(q=q)},
            {"role": "assistant", "content": rng.choice(SOURCE_ANSWERS).format(name=SOURCE_NAMES[source][0]),
             "_source": source}]


def task_bible_book(rng, docs_by_source) -> list[dict] | None:
    doc = rng.choice(docs_by_source.get("kjv") or [""])
    head = re.match(r"^(.+?) (\d+)\n", doc)
    verses = [re.sub(r"^\d+ ", "", ln) for ln in doc.split("\n")[2:] if re.match(r"^\d+ ", ln)]
    if not head or not verses:
        return None
    book, chapter = head.group(1), head.group(2)
    return [{"role": "user", "content": rng.choice(BIBLE_QUESTIONS).format(q=rng.choice(verses)[:240])},
            {"role": "assistant", "content": f"It is from the book of {book}, chapter {chapter}."}]


def task_continue(rng, docs_by_source) -> list[dict] | None:
    source = rng.choice([s for s in ("austen", "kjv", "sotu", "moby") if s in docs_by_source])
    doc = rng.choice(docs_by_source[source])
    if source == "kjv":
        sents = [re.sub(r"^\d+ ", "", ln) for ln in doc.split("\n")[2:] if re.match(r"^\d+ ", ln)]
    else:
        paras = _paragraphs(doc, 300)
        if not paras:
            return None
        sents = sentences(rng.choice(paras))
    if len(sents) < 3:
        return None
    k = rng.randrange(1, len(sents) - 1)
    lo = k
    while lo > 0 and len(" ".join(sents[lo - 1: k])) < 200:
        lo -= 1
    passage, nxt = " ".join(sents[lo:k]), sents[k]
    if len(passage) < 60 or len(passage) > 320 or len(nxt) > 160:
        return None
    return [{"role": "user", "content": rng.choice(CONTINUE_QUESTIONS).format(q=passage)},
            {"role": "assistant", "content": nxt}]


def functions(doc: str) -> list[tuple[str, str, str]]:
    """[(name, code without its docstring, first docstring sentence)] of `def`s with a docstring."""
    out = []
    for m in _DEF.finditer(doc):
        indent, name, params, docstring, body = m.groups()
        first = sentences(docstring.strip().split("\n\n")[0])
        if not first or not 15 <= len(first[0]) <= 200:
            continue
        body_lines = [ln[len(indent):] for ln in body.split("\n") if ln.strip()][:3]
        sig = _clip(f"def {name}({' '.join(params.split())}):", 120)
        out.append((name, "\n".join([sig, *body_lines])[:300], first[0]))
    return out


def task_explain(rng, docs_by_source, _cache: dict | None = None) -> list[dict] | None:
    docs = docs_by_source.get("pystdlib")
    if not docs:
        return None
    fns = functions(rng.choice(docs))
    if not fns:
        return None
    name, code, what = rng.choice(fns)
    what = what[0].lower() + what[1:] if what[:1].isupper() and not what[1:2].isupper() else what
    return [{"role": "user", "content": rng.choice(EXPLAIN_QUESTIONS).format(q=code, name=name)},
            {"role": "assistant", "content": f"`{name}`: {what}"}]


def task_smalltalk(rng, docs_by_source) -> list[dict]:
    asks, answers = rng.choice(SMALLTALK)
    return [{"role": "user", "content": rng.choice(asks)}, {"role": "assistant", "content": rng.choice(answers)}]


def _titled(docs_by_source, source: str) -> list[tuple[str, str]]:
    """[(title, document)] of a source whose documents carry their work's title at its first
    chunk (Austen: the novel; Moby-Dick: "chapter N, Title"), the title carried over the chunks
    that follow in file order; documents before any title are left out. Cached per list."""
    docs = docs_by_source.get(source) or []
    key = (source, id(docs))
    if key in _TITLED:
        return _TITLED[key]
    out, title = [], None
    for d in docs:
        if source == "austen":
            head = d[:40].split("\n", 1)[0].strip().upper()
            title = AUSTEN_TITLES.get(head, title)
        else:
            m = _MOBY_HEAD.match(d)
            title = f"chapter {m.group(1)}, \"{m.group(2)}\"" if m else title
        if title:
            out.append((title, d))
    _TITLED[key] = out
    return out


_TITLED: dict = {}


def task_novel(rng, docs_by_source) -> list[dict] | None:
    source = rng.choice([s for s in ("austen", "moby") if s in docs_by_source] or ["austen"])
    titled = _titled(docs_by_source, source)
    if not titled:
        return None
    title, doc = rng.choice(titled)
    q = _quote(rng, source, doc)
    if q is None:
        return None
    if source == "austen":
        return [{"role": "user", "content": rng.choice(NOVEL_QUESTIONS).format(q=q)},
                {"role": "assistant", "content": f"It is from {title}, a novel by Jane Austen.", "_source": source}]
    return [{"role": "user", "content": rng.choice(MOBY_QUESTIONS).format(q=q)},
            {"role": "assistant", "content": f"It is from {title} of Moby-Dick.", "_source": source}]


def task_fact(rng, docs_by_source) -> list[dict] | None:
    kind = rng.choice(("author", "chapter", "function", "function", "section", "section"))
    if kind == "author":
        t = rng.choice(sorted(AUSTEN_TITLES.values()) + ["Moby-Dick"])
        who = "Herman Melville" if t == "Moby-Dick" else "Jane Austen"
        return [{"role": "user", "content": rng.choice(AUTHOR_QUESTIONS).format(t=t)},
                {"role": "assistant", "content": f"{t} was written by {who}."}]
    if kind == "chapter":
        docs = docs_by_source.get("moby") or []
        heads = [m for m in (_MOBY_HEAD.match(d) for d in docs) if m]
        if not heads:
            return None
        m = rng.choice(heads)
        return [{"role": "user", "content": rng.choice(CHAPTER_QUESTIONS).format(n=m.group(1))},
                {"role": "assistant", "content": f"Chapter {m.group(1)} of Moby-Dick is called \"{m.group(2)}\"."}]
    if kind == "function":
        docs = docs_by_source.get("pystdlib")
        fns = functions(rng.choice(docs)) if docs else []
        fns = [f for f in fns if not f[0].startswith("_")]
        if not fns:
            return None
        name, _, what = rng.choice(fns)
        what = what[0].lower() + what[1:] if what[:1].isupper() and not what[1:2].isupper() else what
        return [{"role": "user", "content": rng.choice(FUNCTION_QUESTIONS).format(name=name)},
                {"role": "assistant", "content": f"`{name}`: {what}"}]
    docs = docs_by_source.get("pydoc")
    if not docs:
        return None
    secs = [(t.strip(), body) for t, _, body in _RST_TITLE.findall(rng.choice(docs))
            if not body.lstrip().startswith((".. ", "::", "*", "=", "-")) and "`" not in t]
    if not secs:
        return None
    t, body = rng.choice(secs)
    first = sentences(body)
    if not first or not 20 <= len(first[0]) <= 200:
        return None
    return [{"role": "user", "content": rng.choice(SECTION_QUESTIONS).format(t=t)},
            {"role": "assistant", "content": first[0]}]


def task_names(rng, docs_by_source) -> list[dict] | None:
    source = rng.choice([s for s in ("austen", "moby", "kjv", "sotu") if s in docs_by_source] or ["austen"])
    q = _quote(rng, source, rng.choice(docs_by_source.get(source) or [""]))
    if q is None:
        return None
    found = []
    for m in _NAME.finditer(q):
        w = m.group(1)
        start = m.start(1)
        if w in _NAME_STOP or w in found or start == 0 or q[:start].rstrip().endswith((".", "!", "?", '"')):
            continue
        found.append(w)
    if not found:                       # a name may open a sentence: no answer rather than a wrong one
        return None
    if len(found) == 1:
        reply = f"It names {found[0]}."
    else:
        reply = f"It names {', '.join(found[:-1])} and {found[-1]}."
    if len(found) > 6:
        return None
    return [{"role": "user", "content": rng.choice(NAMES_QUESTIONS).format(q=q)},
            {"role": "assistant", "content": reply}]


TASK_FNS = {"source": task_source, "bible_book": task_bible_book, "continue": task_continue,
            "explain": task_explain, "smalltalk": task_smalltalk, "novel": task_novel, "fact": task_fact,
            "names": task_names}


# ----------------------------------------------------------------------------- examples


@dataclass
class ChatExample:
    """One tokenized conversation: `ids` and a same-length `mask` (1 = a token the assistant
    produced, trained on), plus what it was built from."""
    messages: list[dict]
    thinking_mode: str
    tasks: list[str]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    source: str | None = None          # the answer of a `source` task (held-out accuracy)

    @property
    def prompt_messages(self) -> list[dict]:
        """The messages before the last assistant turn (what a client sends)."""
        return [{k: v for k, v in m.items() if not k.startswith("_")} for m in self.messages[:-1]]

    @property
    def reply(self) -> str:
        return self.messages[-1]["content"]


def encode_example(messages: list[dict], tokenizer, thinking_mode: str = "chat") -> tuple[list[int], list[int]]:
    """(ids, mask) of a conversation: the ids of `encode_chat_ids(messages)`, and 1 for the tokens of
    every assistant turn (its reasoning in thinking mode, content and closing EOS), found as the
    ids the encoder adds between the generation prompt before the turn and the turn itself."""
    msgs = [{k: v for k, v in m.items() if not k.startswith("_")} for m in messages]
    ids = encode_chat_ids(msgs, tokenizer, thinking_mode)
    mask = [0] * len(ids)
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before = encode_chat_ids(msgs[:i], tokenizer, thinking_mode)
        upto = encode_chat_ids(msgs[: i + 1], tokenizer, thinking_mode)
        if upto[: len(before)] != before or ids[: len(upto)] != upto:
            raise ValueError(f"messages[{i}]: the encoding of the turn is not a prefix of the conversation")
        if upto[-1] != tokenizer.eos_id:
            raise ValueError(f"messages[{i}]: the assistant turn does not end with EOS")
        for j in range(len(before), len(upto)):
            mask[j] = 1
    return ids, mask


def build_examples(docs: list[tuple[str, str]], tokenizer, n: int, seed: int, max_len: int = 128,
                   weights: dict | None = None, multi_turn: float = 0.15, system: float = 0.2,
                   thinking: float = 0.1, max_tries: int = 50) -> list[ChatExample]:
    """`n` conversations of at most `max_len` tokens, drawn deterministically from `docs`."""
    weights = dict(weights or DEFAULT_WEIGHTS)
    unknown = set(weights) - set(TASKS)
    if unknown:
        raise ValueError(f"weights: unknown task(s) {sorted(unknown)}; known: {', '.join(TASKS)}")
    by_source: dict[str, list[str]] = {}
    for s, d in docs:
        by_source.setdefault(s, []).append(d)
    if not by_source:
        raise ValueError("data: no documents to build chat examples from")
    rng = random.Random(seed)
    names = [t for t in TASKS if weights.get(t, 0) > 0]
    w = [weights[t] for t in names]
    out: list[ChatExample] = []
    fails = 0
    while len(out) < n:
        turns = rng.choice((2, 3)) if rng.random() < multi_turn else 1
        mode = "thinking" if turns == 1 and rng.random() < thinking else "chat"
        msgs: list[dict] = []
        tasks: list[str] = []
        if rng.random() < system:
            msgs.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        for _ in range(turns):
            for _ in range(max_tries):
                t = rng.choices(names, w)[0]
                got = TASK_FNS[t](rng, by_source)
                if got:
                    break
            else:
                raise ValueError("data: the documents yield no chat examples (too few usable documents)")
            msgs += got
            tasks.append(t)
        if mode == "thinking":
            msgs[-1]["reasoning_content"] = THINKING[tasks[-1]]
        ids, mask = encode_example(msgs, tokenizer, mode)
        if len(ids) > max_len:
            fails += 1
            if fails > 20 * n + 100:
                raise ValueError(f"max_len: {max_len} tokens is too short for the chat examples")
            continue
        out.append(ChatExample(msgs, mode, tasks, ids, mask, msgs[-1].get("_source")))
    return out


# ----------------------------------------------------------------------------- batches


class ChatBatches:
    """Training batches: `batch_size` rows, of which round(batch_size * text_fraction) are plain
    corpus windows (loss on every token, as pretraining) and the rest conversations (loss on the
    assistant tokens). Conversations come in a seeded shuffled order, 8 batches at a time sorted by
    length so that rows of a batch have similar lengths; each batch is right-padded with PAD to its
    longest conversation, and its text windows have that same length."""

    POOL = 8

    def __init__(self, examples: list[ChatExample], docs: list[tuple[str, str]], tokenizer, batch_size: int,
                 max_len: int, text_fraction: float, seed: int):
        self.examples, self.tok, self.max_len = examples, tokenizer, max_len
        self.n_text = int(round(batch_size * text_fraction))
        self.n_chat = batch_size - self.n_text
        if self.n_chat < 1:
            raise ValueError(f"text_fraction: {text_fraction} leaves no conversation in a batch of {batch_size}")
        self.text_docs = [d for _, d in docs if len(d) >= 16 * max_len]
        if self.n_text and not self.text_docs:
            raise ValueError(f"data: no document is long enough for text windows of {max_len} tokens")
        self.rng = random.Random(seed)
        self.order: list[int] = []
        self.queue: list[list[int]] = []

    def _refill(self) -> None:
        need = self.POOL * self.n_chat
        while len(self.order) < need:
            more = list(range(len(self.examples)))
            self.rng.shuffle(more)
            self.order += more
        pool, self.order = self.order[:need], self.order[need:]
        pool.sort(key=lambda i: len(self.examples[i].ids))
        chunks = [pool[k: k + self.n_chat] for k in range(0, need, self.n_chat)]
        self.rng.shuffle(chunks)
        self.queue = chunks

    def text_window(self, length: int) -> list[int]:
        """`length` tokens of plain corpus text from a random place of a random long document."""
        while True:
            doc = self.rng.choice(self.text_docs)
            start = self.rng.randrange(0, len(doc) - 8 * length)
            ids = self.tok.encode_plain(doc[start: start + 8 * length])[1:]   # first token may be cut
            if len(ids) >= length:
                return ids[:length]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids [B, T] int64, mask [B, T] int64 (1 = a target token), is_text [B] bool), on the
        host (the stage moves them to its device)."""
        if not self.queue:
            self._refill()
        chat = [self.examples[i] for i in self.queue.pop()]
        length = max(len(e.ids) for e in chat)
        rows = [(e.ids, e.mask) for e in chat]
        rows += [(w, [1] * length) for w in (self.text_window(length) for _ in range(self.n_text))]
        ids = torch.full((len(rows), length), self.tok.pad_id, dtype=torch.int64, device="cpu")
        mask = torch.zeros((len(rows), length), dtype=torch.int64, device="cpu")
        for r, (i, m) in enumerate(rows):
            ids[r, : len(i)] = torch.tensor(i, device="cpu")
            mask[r, : len(m)] = torch.tensor(m, device="cpu")
        is_text = torch.tensor([False] * len(chat) + [True] * self.n_text, device="cpu")
        return ids, mask, is_text


# `cedlm train chat`'s defaults for the held-out set: how many conversations, the run's seed, the
# longest conversation in tokens (the held-out set is drawn with seed + 1)
HELDOUT, SEED, MAX_LEN = 48, 0, 128
EVAL_MAX_TOKENS = 64        # reply budget of the held-out generation (`cedlm train chat --eval-max-tokens`)


def heldout_examples(val_docs, tokenizer, n: int = HELDOUT, seed: int = SEED,
                     max_len: int = MAX_LEN) -> list[ChatExample]:
    """The held-out conversations of a chat run with `seed`: `n` built from the validation
    documents with seed + 1 (the training ones use `seed`), so that every checkpoint is scored on
    the same set."""
    return build_examples(val_docs, tokenizer, n, seed + 1, max_len) if n else []
