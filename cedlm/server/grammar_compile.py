"""Compiling a request's output constraint to an llguidance grammar, and the compiler process.

`compile_constraint(kind, value, param, lltok)` turns a constraint (JSON schema, JSON object,
regex, Lark / GBNF grammar, choice) into a grammar string that llguidance has validated against
the served tokenizer, and builds one matcher and its first token mask from it, so that any crash
or runaway of llguidance's compiler happens here. An invalid constraint is a `GrammarError`
(a 400 naming ``param``) whose message is llguidance's first line, never an internal panic text.

The server never runs this in its own process: `python -m cedlm.server.grammar_compile` is the
compiler process `grammar_pool.GrammarPool` talks to (one JSON object per line on stdin and
stdout). It builds the `LLTokenizer` once from the tokenizer JSON of its first message, then
compiles each request in a thread with half the stack of the server's threads, under an
address-space limit; a crash or a runaway costs only the request it was compiling. This module
imports only llguidance and the standard library (no torch), so the process starts in about a
second.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import threading
from typing import Any

try:                                    # a pinned dependency; a clear 400 if it is missing
    import llguidance
except ImportError:                     # pragma: no cover - reported when a grammar is requested
    llguidance = None

JSON_OPTIONS = {"whitespace_flexible": False}
MAX_MESSAGE_CHARS = 300
_INTERNAL = ("panick", "RUST_BACKTRACE", "stack backtrace", ".rs:", "thread '")


class GrammarError(ValueError):
    """An invalid grammar or schema in a request (the handler answers 400 naming ``param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def clean_message(err: Any) -> str:
    """The part of a compiler message fit for a client: its first line, at most
    MAX_MESSAGE_CHARS characters; an internal panic becomes a plain sentence."""
    text = str(err).strip()
    if any(s in text for s in _INTERNAL):
        return "the compiler could not process it"
    line = text.splitlines()[0] if text else "rejected by the compiler"
    return line if len(line) <= MAX_MESSAGE_CHARS else line[:MAX_MESSAGE_CHARS] + "..."


def grammar_source(kind: str, value: Any, param: str) -> str:
    """The llguidance grammar string of a constraint (not yet validated)."""
    if llguidance is None:
        raise GrammarError(param, "structured output needs the 'llguidance' package (pip install llguidance)")
    if kind == "json_object":
        kind, value = "json_schema", {"type": "object"}
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(o, str) for o in value):
            raise GrammarError(param, "must be a non-empty array of strings")
        kind, value = "grammar", "start: " + " | ".join(json.dumps(o) for o in value)
    try:
        if kind == "json_schema":
            if not isinstance(value, (dict, bool)):
                raise GrammarError(param, f"a JSON schema must be an object, got {type(value).__name__}")
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(value), defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(value)
        return llguidance.grammar_from("grammar", value)       # Lark, or GBNF converted to Lark
    except GrammarError:
        raise
    except Exception as e:               # noqa: BLE001 - llguidance reports bad input as exceptions
        what = {"json_schema": "JSON schema", "regex": "regex"}.get(kind, "grammar")
        raise GrammarError(param, f"invalid {what}: {clean_message(e)}") from None


def compile_constraint(kind: str, value: Any, param: str, lltok) -> str:
    """A validated grammar string for the constraint; GrammarError when it is invalid."""
    g = grammar_source(kind, value, param)
    what = {"json_schema": "JSON schema", "json_object": "JSON schema", "regex": "regex"}.get(kind, "grammar")
    err = llguidance.LLMatcher.validate_grammar(g, lltok)
    if err and not err.startswith("WARNING"):
        raise GrammarError(param, f"invalid {what}: {clean_message(err)}")
    m = llguidance.LLMatcher(lltok, g, log_level=0)
    if m.is_error():
        raise GrammarError(param, f"the {what} could not be compiled: {clean_message(m.get_error())}")
    m.compute_bitmask()
    return g


# ---------------------------------------------------------------------------- compiler process
def _serve(stdin, stdout, stack_bytes: int) -> None:
    hello = json.loads(stdin.readline())
    lltok = llguidance.LLTokenizer(hello["tokenizer"], n_vocab=hello["n_vocab"], eos_token=hello["eos"])
    stdout.write(json.dumps({"ready": True}) + "\n")
    stdout.flush()
    threading.stack_size(stack_bytes)
    for line in stdin:
        req = json.loads(line)
        out: dict[str, Any] = {}

        def work():
            try:
                out["grammar"] = compile_constraint(req["kind"], req["value"], req["param"], lltok)
            except GrammarError as e:
                out["error"], out["param"] = str(e), e.param
            except MemoryError:
                out["error"] = f"{req['param']}: compiling it needs more memory than the compiler's budget"
                out["param"] = req["param"]
        th = threading.Thread(target=work)
        th.start()
        th.join()
        if not out:                       # the thread died without an answer
            out = {"error": f"{req['param']}: the compiler could not process it", "param": req["param"]}
        stdout.write(json.dumps(out) + "\n")
        stdout.flush()


def main() -> None:
    mem = int(os.environ.get("CEDLM_GRAMMAR_MEMORY_BYTES", 0))
    if mem > 0:
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    stack = int(os.environ.get("CEDLM_GRAMMAR_STACK_BYTES", 4 << 20))
    _serve(sys.stdin, sys.stdout, stack)


if __name__ == "__main__":
    main()
