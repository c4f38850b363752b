"""Tokenizing chat-prompt pieces so that only the encoder's markup becomes control tokens:
message text is encoded as plain text, and refused if the vocabulary spells a control token
from it."""
from __future__ import annotations

import re
import weakref

_CONTROL: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _control_table(tokenizer):
    """(added token -> id, a regex matching them (longest first) or None, every control id)."""
    got = _CONTROL.get(tokenizer)
    if got is None:
        added = dict(tokenizer.added_tokens)
        ctl = re.compile("|".join(re.escape(t) for t in sorted(added, key=len, reverse=True))) if added else None
        got = _CONTROL[tokenizer] = (added, ctl, set(added.values()) | set(tokenizer.special_ids.values()))
    return got


def tokenize_parts(parts: list[tuple[str, bool]], tokenizer) -> list[int]:
    """Token ids of ``encode_chat_parts`` pieces with a ``cedlm.text.tokenizer.Tokenizer``.

    The encoder's markup is matched against the tokenizer's added tokens (so ``<｜User｜>`` there is
    its control token); message text never is: runs of text between control tokens are encoded
    with ``tokenizer.encode_plain``. Without special-token strings in the messages the ids equal
    ``tokenizer.encode(encode_chat(...))``."""
    added, ctl, control_ids = _control_table(tokenizer)
    ids: list[int] = []
    run: list[str] = []

    def flush() -> None:
        if run:
            text = "".join(run)
            if not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as e:   # a lone surrogate, e.g. from an escaped one
                    raise ValueError(f"messages: the text has a lone surrogate "
                                     f"({ascii(e.object[e.start])}), which is not a character; "
                                     f"the JSON strings of tool-call arguments are unescaped") from None
            got = tokenizer.encode_plain(text)
            if control_ids.intersection(got):   # the vocabulary can spell a control token: refuse
                raise ValueError("messages: text in the messages encodes to a control token")
            ids.extend(got)
            run.clear()

    for text, is_content in parts:
        if is_content or ctl is None:
            run.append(text)
            continue
        pos = 0
        for mt in ctl.finditer(text):
            run.append(text[pos:mt.start()])
            flush()
            ids.append(added[mt.group()])
            pos = mt.end()
        run.append(text[pos:])
    flush()
    return ids
