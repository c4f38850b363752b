"""Bounds on a request's output constraint, checked before anything is compiled.

llguidance compiles grammars recursively: a deep enough JSON schema, `$ref` chain or Lark rule
chain overflows its stack and takes the whole process down (a `$defs` chain of 1,000 nested
objects, about 94 KB, segfaults llguidance; 700 compile). A huge `guided_choice` cost
minutes of CPU. `check_constraint(param, kind, value)` measures the constraint with plain
iterative Python and raises `GrammarLimit` (a 400 naming the limit) when one is exceeded:

- JSON schema: its serialized size (`MAX_SCHEMA_BYTES`), its depth counted through `$ref`s
  (`MAX_SCHEMA_DEPTH`: each nested object / array level and each `$ref` hop is one level), and
  its longest chain of `$ref` hops (`MAX_REF_CHAIN`). A recursive schema (a `$ref` back to a
  schema on the current path) is fine: the cycle is not unfolded.
- regex: its length (`MAX_REGEX_CHARS`) and its size with counted repetitions multiplied out
  (`regex_unrolled`, at most `MAX_REGEX_UNROLLED`): llguidance compiles `a{60}` as 60 copies of
  `a`, so `((a{60}){60}){60}` is 216,000 of them (0.6 s of compiling; one more level of 60 runs
  past the compiler's time budget, and costs its process). The same bound applies to the
  `pattern`s of a JSON schema and the regex terminals (`/.../`) of a Lark grammar.
- Lark / GBNF grammar: its length (`MAX_GRAMMAR_CHARS`) and number of rules (`MAX_GRAMMAR_RULES`).
- choice: the number of options (`MAX_CHOICES`) and their total length (`MAX_CHOICE_CHARS`).

The limits sit far below the measured crash points (the compiler's subprocess, `grammar_pool`,
also runs with half the stack of the server's threads) and far above real schemas.
"""
from __future__ import annotations

import json
import re
from typing import Any

MAX_SCHEMA_BYTES = 256 << 10
MAX_SCHEMA_DEPTH = 128
MAX_REF_CHAIN = 64
MAX_REGEX_CHARS = 8192
MAX_REGEX_UNROLLED = 65536
MAX_GRAMMAR_CHARS = 128 << 10
MAX_GRAMMAR_RULES = 1000
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 64 << 10

# A counted repetition: {m}, {m,}, {m,n}.
_COUNT = re.compile(r"\{(\d+)(,)?(\d*)\}")
# A regex terminal of a Lark grammar: /.../flags.
_LARK_REGEX = re.compile(r"/((?:[^/\\\n]|\\.)+)/[imslux]*")
# A rule (or terminal) definition at the start of a line: Lark `name:` / `?name:` / `NAME.2:`,
# GBNF `name ::=`.
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w.-]*(?:\.-?\d+)?[ \t]*(?::|::=)", re.MULTILINE)


class GrammarLimit(ValueError):
    """A constraint over one of the bounds (the handler answers 400 naming ``param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def check_constraint(param: str, kind: str, value: Any) -> None:
    """Raise GrammarLimit when the constraint (kind: json_schema, json_object, regex, choice,
    grammar) exceeds a bound; type errors are left to the compiler's own messages."""
    if kind == "json_schema":
        check_schema(param, value)
    elif kind == "regex" and isinstance(value, str):
        if len(value) > MAX_REGEX_CHARS:
            raise GrammarLimit(param, f"the regex has {len(value)} characters, more than the limit of "
                                      f"{MAX_REGEX_CHARS}")
        check_regex(param, value)
    elif kind == "grammar" and isinstance(value, str):
        check_grammar(param, value)
    elif kind == "choice" and isinstance(value, list):
        if len(value) > MAX_CHOICES:
            raise GrammarLimit(param, f"{len(value)} choices, more than the limit of {MAX_CHOICES}")
        total = sum(len(o) for o in value if isinstance(o, str))
        if total > MAX_CHOICE_CHARS:
            raise GrammarLimit(param, f"the choices have {total} characters in all, more than the limit "
                                      f"of {MAX_CHOICE_CHARS}")


def check_grammar(param: str, grammar: str) -> None:
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise GrammarLimit(param, f"the grammar has {len(grammar)} characters, more than the limit of "
                                  f"{MAX_GRAMMAR_CHARS}")
    rules = len(_RULE.findall(grammar))
    if rules > MAX_GRAMMAR_RULES:
        raise GrammarLimit(param, f"the grammar has {rules} rules, more than the limit of {MAX_GRAMMAR_RULES}")
    for m in _LARK_REGEX.finditer(grammar):
        check_regex(param, m.group(1), "a regex terminal of the grammar")


def check_regex(param: str, pattern: str, what: str = "the regex") -> None:
    n = regex_unrolled(pattern)
    if n > MAX_REGEX_UNROLLED:
        raise GrammarLimit(param, f"{what} unrolls to {n} items (counted repetitions such as {{60}} multiplied "
                                  f"out), more than the limit of {MAX_REGEX_UNROLLED}")


def regex_unrolled(pattern: str) -> int:
    """The size of a regex with its counted repetitions multiplied out: each literal, class or
    escape is 1, a sequence and an alternation add up, `x{m,n}` is x times max(m, n) (`x{m,}`: m
    times), `*`, `+` and `?` leave x as it is. No recursion (a deep nest of groups costs none)."""
    stack: list[tuple[int, int]] = []
    alt = seq = last = 0
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            j = i + 2
            if j < n and pattern[i + 1] in "pPxuU" and pattern[j] == "{":
                close = pattern.find("}", j)
                j = n if close < 0 else close + 1
            atom, i = 1, j
        elif c == "[":
            j = i + 1
            j += j < n and pattern[j] == "^"
            j += j < n and pattern[j] == "]"
            depth = 1
            while j < n and depth:
                if pattern[j] == "\\":
                    j += 2
                    continue
                depth += {"[": 1, "]": -1}.get(pattern[j], 0)
                j += 1
            atom, i = 1, j
        elif c == "(":
            stack.append((alt, seq))
            alt = seq = last = 0
            i += 1
            continue
        elif c == ")":
            inner = max(alt + seq, 1)
            alt, seq = stack.pop() if stack else (0, 0)
            atom, i = inner, i + 1
        elif c == "|":
            alt, seq, last = alt + seq, 0, 0
            i += 1
            continue
        elif c == "{" and (m := _COUNT.match(pattern, i)) and last:
            lo, comma, hi = m.groups()
            k = _count(hi) if hi else _count(lo)
            k = max(k, _count(lo)) if comma else k
            seq += last * (k - 1)
            last *= k
            i = m.end()
            continue
        elif c in "*+?":
            i += 1
            continue
        else:
            atom, i = 1, i + 1
        seq += atom
        last = atom
    total = alt + seq
    for a, s in stack:                          # unclosed groups (the compiler reports them)
        total += a + s
    return total


def _count(digits: str) -> int:
    return int(digits) if len(digits) <= 9 else 10**9


def _pointer(root: Any, ref: str) -> Any:
    """The subschema a local `$ref` ("#", "#/$defs/x", ...) points at; None if it is not local
    or does not resolve (the compiler reports those)."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isascii() and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def check_schema(param: str, schema: Any) -> None:
    """Size, depth through `$ref`s and `$ref` chain length of a JSON schema (see module doc)."""
    size = len(json.dumps(schema))
    if size > MAX_SCHEMA_BYTES:
        raise GrammarLimit(param, f"the JSON schema has {size} bytes, more than the limit of {MAX_SCHEMA_BYTES}")
    # Memoised walk over (node) -> (depth below it, $ref hops below it). The walk is iterative
    # (an explicit stack), so a deep schema costs no Python recursion. A `$ref` to a node on the
    # current path is a cycle and counts nothing further.
    memo: dict[int, tuple[int, int]] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, list, bool]] = [(schema, [], False)]
    while stack:
        node, kids, expanded = stack.pop()
        key = id(node)
        if not expanded:
            if key in memo:
                continue
            kids = _children(schema, node)
            on_path.add(key)
            stack.append((node, kids, True))
            for child, _hop in kids:
                if id(child) not in memo and id(child) not in on_path:
                    stack.append((child, [], False))
            if len(on_path) > MAX_SCHEMA_DEPTH:
                raise GrammarLimit(param, f"the JSON schema is nested deeper than {MAX_SCHEMA_DEPTH} levels "
                                          f"(counting $ref hops)")
            continue
        depth = hops = 0
        for child, hop in kids:
            d, h = memo.get(id(child), (0, 0))      # absent: a cycle back onto the path
            depth, hops = max(depth, d + 1), max(hops, h + hop)
        on_path.discard(key)
        memo[key] = (depth, hops)
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarLimit(param, f"the JSON schema is nested deeper than {MAX_SCHEMA_DEPTH} levels "
                                      f"(counting $ref hops)")
        if hops > MAX_REF_CHAIN:
            raise GrammarLimit(param, f"the JSON schema has a chain of more than {MAX_REF_CHAIN} $ref hops")
    _check_patterns(param, schema)


def _check_patterns(param: str, schema: Any) -> None:
    """The regex bound for every `pattern` and `patternProperties` key of a JSON schema."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                check_regex(param, node["pattern"], "a pattern of the JSON schema")
            if isinstance(node.get("patternProperties"), dict):
                for k in node["patternProperties"]:
                    check_regex(param, k, "a patternProperties key of the JSON schema")
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))


def _children(root: Any, node: Any) -> list[tuple[Any, int]]:
    """The containers directly under node, and the target of its `$ref` (hop 1)."""
    out: list[tuple[Any, int]] = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str):
                target = _pointer(root, v)
                if isinstance(target, (dict, list)):
                    out.append((target, 1))
            elif isinstance(v, (dict, list)):
                out.append((v, 0))
    elif isinstance(node, list):
        out.extend((v, 0) for v in node if isinstance(v, (dict, list)))
    return out
