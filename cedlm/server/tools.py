"""Tools: validating ``tools``, the schema that forces a tool call, and parsing
tool calls out of generated text, streaming or not.

Two ways a tool call is produced:

- ``tool_choice`` "auto" (the default when tools are given): the model writes V4.1's
  ``<｜DSML｜ calls>`` block (the format the chat encoder teaches it), parsed by
  ``cedlm.text.chat.parse_tool_calls``; while streaming, ``DSMLStream`` holds back text that may
  be the start of the block and emits each call as soon as its ``</｜DSML｜ invoke>`` closes.
- ``tool_choice`` "required" or ``{"type": "function", "function": {"name": ...}}``: the output is
  constrained (``constrain.py``) to JSON, as vLLM does for every model: "required" to an array of
  ``{"name": ..., "parameters": {...}}`` (one of the tools, each with its own parameter schema;
  at most one item when ``parallel_tool_calls`` is false), a named function to its parameters
  object. ``ForcedStream`` / ``parse_forced`` turn that JSON into OpenAI tool calls, each as soon
  as its item closes (an array cut short by max_tokens still yields its complete calls; the
  finish reason then stays "length").

A forced call cut by max_tokens is never returned as plain ``content`` (LangChain's structured
output would quietly read ``None``). As vLLM does for a named function, the cut call is returned
in ``tool_calls`` with the arguments as far as they were generated (not valid JSON) and the
finish reason stays "length" (``ForcedStream.cut``); for "required" the same holds once the cut
item's name is complete. In addition (cedlm's choice: vLLM returns the partial call only) the
message carries a ``refusal`` saying the call was cut (``cut_refusal``), also when it was cut
before any function name: LangChain's structured output raises a refusal, while it turns a call
with invalid arguments into ``invalid_tool_calls`` and returns ``None``.

"none" keeps the tools in the prompt and parses nothing.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any

from cedlm.text.chat_tools import INVOKE, parse_tool_calls
from cedlm.text.special_tokens import DSML

NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
CALLS_OPEN = f"<{DSML} calls>"
INVOKE_CLOSE = f"</{DSML} invoke>"


def _tn(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(v), type(v).__name__)


def function_of(tool: dict) -> dict:
    """The function object of a tool entry (OpenAI ``{"type":"function","function":{...}}`` or a
    bare function schema)."""
    return tool["function"] if tool.get("type") == "function" and "function" in tool else tool


def check_tools(v: Any, where: str = "tools") -> None:
    """Raise ValueError naming the entry and field for a malformed ``tools`` list."""
    if not isinstance(v, list):
        raise ValueError(f"{where}: must be an array of tools, got {_tn(v)}")
    names = set()
    for i, t in enumerate(v):
        w = f"{where}[{i}]"
        if not isinstance(t, dict):
            raise ValueError(f"{w}: a tool must be an object, got {_tn(t)}")
        if "type" in t and t["type"] != "function":
            raise ValueError(f"{w}.type: only 'function' tools are supported, got {t['type']!r}")
        if "function" in t:
            if t.get("type") != "function":
                raise ValueError(f"{w}.type: must be 'function'")
            fn, w = t["function"], f"{w}.function"
            if not isinstance(fn, dict):
                raise ValueError(f"{w}: must be an object, got {_tn(fn)}")
        elif t.get("type") == "function":
            raise ValueError(f"{w}.function: missing (a function tool needs a 'function' object)")
        else:
            fn = t
        name = fn.get("name")
        if not isinstance(name, str):
            raise ValueError(f"{w}.name: must be a string")
        if not NAME_RE.match(name):
            raise ValueError(f"{w}.name: {name!r} must be 1-64 characters of a-z, A-Z, 0-9, _ . : -")
        if name in names:
            raise ValueError(f"{w}.name: duplicate tool name {name!r}")
        names.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ValueError(f"{w}.description: must be a string")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise ValueError(f"{w}.strict: must be a boolean")
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise ValueError(f"{w}.parameters: must be a JSON schema object, got {_tn(params)}")
            if "type" in params and params["type"] != "object":
                raise ValueError(f"{w}.parameters.type: must be 'object' (tool arguments are a JSON object)")
            if "properties" in params and not isinstance(params["properties"], dict):
                raise ValueError(f"{w}.parameters.properties: must be an object")
            req = params.get("required")
            if req is not None and (not isinstance(req, list) or not all(isinstance(r, str) for r in req)):
                raise ValueError(f"{w}.parameters.required: must be an array of strings")


def names(tools: list[dict] | None) -> list[str]:
    return [function_of(t)["name"] for t in tools or []]


def _params_schema(fn: dict) -> dict:
    p = fn.get("parameters")
    return p if isinstance(p, dict) and p else {"type": "object"}


def forced_schema(tools: list[dict], tool_choice: Any, parallel: bool = True) -> dict:
    """The JSON schema the output must follow for tool_choice "required" or a named function."""
    if isinstance(tool_choice, dict):
        want = tool_choice["function"]["name"]
        fn = next(function_of(t) for t in tools if function_of(t)["name"] == want)
        return _params_schema(fn)
    items = [{"type": "object",
              "properties": {"name": {"const": function_of(t)["name"]}, "parameters": _params_schema(function_of(t))},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, args: Any) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


class ForcedStream:
    """Tool calls out of the constrained JSON as it streams in: for "required", each complete
    item of the array is a call as soon as it closes (so an array cut short by max_tokens still
    yields the calls it completed); for a named function, the arguments object once complete."""

    _dec = json.JSONDecoder()

    def __init__(self, tool_choice: Any, parallel: bool = True):
        self.named = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
        self.parallel = parallel
        self.text, self.pos, self.n = "", 0, 0

    def feed(self, delta: str) -> list[dict]:
        self.text += delta
        out: list[dict] = []
        t = self.text
        if self.named is not None:
            if self.n == 0:
                try:
                    v, _ = self._dec.raw_decode(t.lstrip())
                except ValueError:
                    return []
                if isinstance(v, dict):
                    self.n = 1
                    out.append(_call(self.named, v))
            return out
        while self.parallel or self.n == 0:
            i = self.pos
            while i < len(t) and t[i] in " \t\r\n,[":
                i += 1
            if i >= len(t) or t[i] != "{" or "[" not in t[:i + 1]:
                break
            try:
                v, end = self._dec.raw_decode(t, i)
            except ValueError:
                break
            self.pos = end
            if isinstance(v, dict) and isinstance(v.get("name"), str):
                self.n += 1
                out.append(_call(v["name"], v.get("parameters", {})))
        return out


    _CUT_ITEM = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"parameters"\s*:\s*(.*)\Z', re.S)

    def cut(self) -> list[dict]:
        """The call cut short by max_tokens (after every complete one was fed), with its arguments
        as far as generated: for a named function, the unfinished arguments object; for
        "required", the unfinished array item once its name is complete. [] when there is none."""
        if self.named is not None:
            return [] if self.n else [{"type": "function", "function": {"name": self.named,
                                                                        "arguments": self.text.strip()}}]
        if not self.parallel and self.n:
            return []
        m = self._CUT_ITEM.search(self.text, self.pos)
        if m is None:
            return []
        try:
            name = json.loads(f'"{m.group(1)}"')
        except ValueError:
            return []
        return [{"type": "function", "function": {"name": name, "arguments": m.group(2).rstrip()}}]


CUT_REFUSAL = ("the forced tool call was cut by max_tokens before its function name was generated; "
               "raise max_tokens")
CUT_ARGS_REFUSAL = ("the forced tool call was cut by max_tokens: its arguments are incomplete JSON; "
                    "raise max_tokens")


def cut_refusal(stream: ForcedStream, cut: list[dict]) -> str | None:
    """The `refusal` of a forced output cut by max_tokens (after `cut = stream.cut()`): the call
    came back with incomplete arguments, or none came at all; None when every call is complete.
    LangChain's structured output raises it (OpenAIRefusalError) instead of returning None."""
    if cut:
        return CUT_ARGS_REFUSAL
    return CUT_REFUSAL if stream.n == 0 else None


def parse_forced(text: str, tool_choice: Any, parallel: bool = True) -> list[dict]:
    """OpenAI tool calls from the constrained JSON (every complete call, also of a cut array)."""
    return ForcedStream(tool_choice, parallel).feed(text)


def with_ids(calls: list[dict]) -> list[dict]:
    return [{"id": call_id(), **c} for c in calls]


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class DSMLStream:
    """Streaming counterpart of ``parse_tool_calls``: feed content deltas, get back
    (content delta, [new tool calls]); what it streams is always a prefix of the final parse.

    Content is streamed up to the calls block; a tail that may still begin the block (a prefix of
    ``<｜DSML｜ calls>``, and the newlines before it, which the parse strips) is held back. After
    the block opens, each complete ``invoke`` is parsed and returned once."""

    def __init__(self, parallel: bool = True):
        self.text, self.sent, self.calls_at, self.n_calls = "", 0, -1, 0
        self.parallel = parallel

    def _content_end(self, final: bool) -> int:
        if self.calls_at >= 0:
            return len(self.text[:self.calls_at].rstrip("\n"))
        if final:
            return len(self.text)
        t = self.text
        cut = len(t) - _held(t, CALLS_OPEN)
        return len(t[:cut].rstrip("\n"))

    def _new_calls(self) -> list[dict]:
        if self.calls_at < 0:
            return []
        _, calls = parse_tool_calls(self.text[self.calls_at:])
        done = len(INVOKE.findall(self.text[self.calls_at:]))
        calls = calls[:done]
        if not self.parallel:
            calls = calls[:1]
        new = calls[self.n_calls:]
        self.n_calls = len(calls) if len(calls) > self.n_calls else self.n_calls
        return new

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        self.text += delta
        if self.calls_at < 0:
            self.calls_at = self.text.find(CALLS_OPEN)
        end = self._content_end(final)
        out = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out, self._new_calls()

    def finish(self) -> tuple[str, list[dict]]:
        return self.feed("", final=True)
