"""The corpus text format: documents separated by a line holding only the EOS token string.

``tokenizer.encode(file_text)`` of such a file yields EOS ids at document boundaries;
``iter_documents`` splits a file back into its documents and ``write_documents`` writes them.
The corpus builder (`cedlm.data.corpus`), the tokenizer trainer and the training token cache all
read and write this format.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

DOC_SEPARATOR = "<｜end▁of▁sentence｜>"      # the EOS token string (cedlm.text.tokenizer.EOS)


def iter_documents(path: str | Path) -> Iterator[str]:
    """Yield the documents of a ``train.txt``/``val.txt`` file (separator lines removed)."""
    sep = DOC_SEPARATOR + "\n"
    buf: list[str] = []
    with open(path, encoding="utf-8", newline="\n") as f:
        for line in f:
            if line == sep or line == DOC_SEPARATOR:
                yield "".join(buf).removesuffix("\n")
                buf = []
            else:
                buf.append(line)
    if "".join(buf).strip():
        yield "".join(buf).removesuffix("\n")


def write_documents(f, docs: Iterable[str]) -> int:
    """Write each document followed by a separator line to the open text file `f`; -> bytes."""
    n = 0
    for d in docs:
        data = d + "\n" + DOC_SEPARATOR + "\n"
        f.write(data)
        n += len(data.encode("utf-8"))
    return n
