"""Request value types and shape checks, run by the request models: the typed values whose
constraints generate both the validation and `/openapi.json` (``TokenId``, ``Effort``, ``Tools``,
...), body-wide checks (valid Unicode, nesting depth, message count) and the checks of free-form
values types cannot describe (content parts, tool calls, ``response_format``,
``structured_outputs``, ``logit_bias``). Each check raises a ``ValueError`` naming the field."""
from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, WrapValidator
from pydantic_core import PydanticCustomError, ValidationError

from cedlm.server.protocol.json_depth import check_json_text
from cedlm.server.protocol.params import EFFORT_TIERS, MAX_DEPTH, MAX_MESSAGES, MAX_N

_SURROGATE = re.compile("[\ud800-\udfff]")


def _where(path: list) -> str:
    """The path as text a message can carry: a lone surrogate in a key is written as its escape
    (a message holding one cannot be encoded, which was a 500 and a dropped connection)."""
    text = ".".join(str(p) for p in path) or "request body"
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _json_int(v: Any) -> Any:
    """An integer as JSON schema defines it: 3 and 3.0 alike (the same number); never a boolean
    or a string (those stay errors)."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, bool) or not isinstance(v, int):     # a wrong type, as pydantic's own int_type
        raise PydanticCustomError("int_type", "must be an integer, got {got}", {"got": type_name(v)})
    return v


def bound(name: str) -> dict:
    """A bound known once the model is loaded (``token``: below the vocabulary, ``context``: within
    the context, ``samples``: the sample cap), marked for server/openapi_rules.py to write in."""
    return {"x-bound": name}


JsonInt = Annotated[int, BeforeValidator(_json_int)]
# (the bounds first: in the JSON schema)
TokenId = Annotated[int, Field(ge=0, json_schema_extra=bound("token")), BeforeValidator(_json_int)]
OutputTokens = Annotated[int, Field(ge=1, json_schema_extra=bound("context"))]
Samples = Annotated[int, Field(ge=1, le=MAX_N, json_schema_extra=bound("samples")), BeforeValidator(_json_int)]
_LEVEL = Annotated[int, Field(ge=1, le=100), BeforeValidator(_json_int)]


def _allowed(allowed: str) -> WrapValidator:
    """One error naming what is allowed, in place of one per alternative of a union."""
    def check(v: Any, handler):
        try:
            return handler(v)
        except ValidationError:
            raise PydanticCustomError("not_allowed", "{got} is not valid; allowed: " + allowed,
                                      {"got": show(v)}) from None
    return WrapValidator(check)


EffortLevel = Annotated[_LEVEL, _allowed("an integer 1..100")]                   # the V4.1 effort
Effort = Annotated[Literal[tuple(EFFORT_TIERS)] | _LEVEL,                         # a tier or a level
                   _allowed(", ".join(repr(k) for k in EFFORT_TIERS) + " or an integer 1..100")]


class Combination(ValueError):
    """A rule between fields that JSON schema cannot state (best_of >= n, min_tokens <=
    max_tokens, one constraint at most, ...): a 400 with code `invalid_combination`; each
    operation's description in /openapi.json lists its rules (server/openapi_rules.py)."""


def check_body(body: Any) -> None:
    """Reject strings (values or keys) holding a lone UTF-16 surrogate, and nesting deeper than
    ``MAX_DEPTH``, naming where."""
    def bad(path: tuple) -> ValueError:
        return ValueError(f"{_where(list(path))}: contains an unpaired surrogate (e.g. a lone \\ud800 "
                          f"escape); strings must be valid Unicode")

    if isinstance(body, str):
        if _SURROGATE.search(body):
            raise bad(())
        return
    stack = [(body, ())]
    while stack:                                # iterative: nesting depth costs no recursion
        v, path = stack.pop()
        if isinstance(v, dict):
            items = v.items()
        elif isinstance(v, list):
            items = enumerate(v)
        else:
            continue
        if len(path) >= MAX_DEPTH:
            raise ValueError(f"{_where(list(path[:3]))}: nested deeper than {MAX_DEPTH} levels")
        for k, x in items:
            if isinstance(k, str) and _SURROGATE.search(k):
                raise bad(path + (k,))
            if isinstance(x, str):
                if _SURROGATE.search(x):
                    raise bad(path + (k,))
            elif isinstance(x, (dict, list)):
                stack.append((x, path + (k,)))


def check_count(data: Any, field: str, limit: int = MAX_MESSAGES) -> None:
    """Refuse a body whose `field` array holds more than `limit` items, before anything walks or
    validates them (220,000 empty messages took 7 s of validation before the prompt limit refused
    them)."""
    v = data.get(field) if isinstance(data, dict) else None
    if isinstance(v, list) and len(v) > limit:
        raise ValueError(f"{field}: at most {limit} items per request, got {len(v)}")


def show(v: Any, limit: int = 40) -> str:
    """A client's value for an error message, cut to `limit` characters (a number of 4,000 digits
    is not repeated back whole)."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 64:
        return f"an integer of about {int(v.bit_length() * 0.30103) + 1} digits"
    text = repr(v)
    return text if len(text) <= limit else text[:limit] + "..."


def type_name(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(v), type(v).__name__)


def check_parts(v: Any, where: str) -> None:
    """Content as a list of parts: objects with a string "type"; text parts have a string "text";
    tool_result parts have string content or a list of parts."""
    if not isinstance(v, list):
        raise ValueError(f"{where}: must be a string, null or an array of content parts, got {type_name(v)}")
    for i, b in enumerate(v):
        w = f"{where}[{i}]"
        if not isinstance(b, dict):
            raise ValueError(f"{w}: a content part must be an object, got {type_name(b)}")
        t = b.get("type")
        if not isinstance(t, str):
            raise ValueError(f"{w}.type: must be a string")
        if t == "text" and not isinstance(b.get("text", ""), str):
            raise ValueError(f"{w}.text: must be a string, got {type_name(b.get('text'))}")
        if t == "tool_result":
            c = b.get("content", "")
            if c is not None and not isinstance(c, str):
                check_parts(c, f"{w}.content")


def check_tool_call(tc: Any, where: str) -> None:
    if not isinstance(tc, dict):
        raise ValueError(f"{where}: a tool call must be an object, got {type_name(tc)}")
    fn, w = (tc["function"], f"{where}.function") if "function" in tc else (tc, where)
    if not isinstance(fn, dict):
        raise ValueError(f"{w}: must be an object with 'name' and 'arguments', got {type_name(fn)}")
    if not isinstance(fn.get("name"), str):
        raise ValueError(f"{w}.name: must be a string")
    for k in ("id",):
        if tc.get(k) is not None and not isinstance(tc[k], str):
            raise ValueError(f"{where}.{k}: must be a string")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        check_json_text(args, f"{w}.arguments")
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            raise ValueError(f"{w}.arguments: must be a JSON object (as a string or an object)") from None
    if not isinstance(args, dict):
        raise ValueError(f"{w}.arguments: must be a JSON object, got {type_name(args)}")


def check_response_format(v: Any) -> Any:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ValueError(f"response_format: must be an object, got {type_name(v)}")
    t = v.get("type")
    if t not in ("text", "json_object", "json_schema"):
        raise ValueError(f"response_format.type: {t!r} is not valid; allowed: 'text', 'json_object', 'json_schema'")
    if t == "json_schema":
        js = v.get("json_schema")
        if not isinstance(js, dict):
            raise ValueError("response_format.json_schema: must be an object with 'name' and 'schema'")
        if js.get("name") is not None and not isinstance(js["name"], str):
            raise ValueError("response_format.json_schema.name: must be a string")
        schema = js.get("schema", js.get("json_schema"))
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"response_format.json_schema.schema: must be a JSON schema object, "
                             f"got {type_name(schema)}")
        if js.get("strict") is not None and not isinstance(js["strict"], bool):
            raise ValueError("response_format.json_schema.strict: must be a boolean")
    return v


def check_structured(v: Any) -> Any:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ValueError(f"structured_outputs: must be an object, got {type_name(v)}")
    keys = [k for k in ("json", "regex", "choice", "grammar", "json_object") if v.get(k) not in (None, False)]
    unknown = [k for k in v if k not in ("json", "regex", "choice", "grammar", "json_object",
                                         "disable_fallback", "disable_any_whitespace",
                                         "disable_additional_properties", "whitespace_pattern")
               and v[k] is not None]
    if unknown:
        raise ValueError(f"structured_outputs.{unknown[0]}: not supported")
    if len(keys) != 1:
        raise ValueError("structured_outputs: give exactly one of json, regex, choice, grammar, json_object")
    return v


def check_logit_bias(v: dict[str, float] | None) -> dict[int, float] | None:
    """The biases by token id (the type checked the values and the count)."""
    if v is None:
        return None
    for k in v:
        if not (k.isascii() and k.isdigit() and len(k.lstrip("0")) <= 18):
            raise ValueError(f"logit_bias: key {show(k)} is not a token id (a non-negative integer as a string)")
    return {int(k): b for k, b in v.items()}
