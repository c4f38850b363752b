"""DeepSeek-V4.1 tool markup: the tools instruction block with the functions' schemas, assistant
tool calls rendered as a ``<｜DSML｜ calls>`` block, and that block parsed back into OpenAI-style
calls. Rendering returns ``(text, is_content)`` prompt pieces as ``cedlm.text.chat`` does."""
from __future__ import annotations

import json
import re
from typing import Any

from cedlm.text.special_tokens import DSML

TOOLS_TEMPLATE = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    '"<{d} calls>" block like the following:\n\n'
    "<{d} calls>\n"
    '<{d} invoke name="$TOOL_NAME">\n'
    '<{d} parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d} parameter>\n'
    "...\n"
    "</{d} invoke>\n"
    '<{d} invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</{d} invoke>\n"
    "</{d} calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    "{schemas}\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)


def dump_json(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False)


def tool_function(tool: dict) -> dict:
    if not isinstance(tool, dict):
        raise ValueError(f"tools: each tool must be an object, got {type(tool).__name__}")
    fn = tool["function"] if tool.get("type") == "function" and "function" in tool else tool
    if not isinstance(fn, dict):
        raise ValueError(f"tools: 'function' must be an object, got {type(fn).__name__}")
    return fn


def check_tool_list(tools) -> list:
    if not isinstance(tools, list):
        raise ValueError(f"tools: must be a list of tool objects, got {type(tools).__name__}")
    return tools


_TOOLS_HEAD, _TOOLS_TAIL = TOOLS_TEMPLATE.split("{schemas}")


def tools_parts(tools: list[dict]) -> list[tuple[str, bool]]:
    schemas = "\n".join(dump_json(tool_function(t)) for t in check_tool_list(tools))
    return [(_TOOLS_HEAD.format(d=DSML), False), (schemas, True), (_TOOLS_TAIL, False)]


def render_tools(tools: list[dict]) -> str:
    """The tools instruction block with one JSON schema per line."""
    return "".join(t for t, _ in tools_parts(tools))


def unpack_call(tc: dict) -> tuple[str, Any, str]:
    if not isinstance(tc, dict):
        raise ValueError(f"tool_calls: each tool call must be an object, got {type(tc).__name__}")
    fn = tc.get("function", tc)
    if not isinstance(fn, dict):
        raise ValueError(f"tool_calls: 'function' must be an object, got {type(fn).__name__}")
    name, cid = fn.get("name"), tc.get("id") or fn.get("id") or ""
    if not isinstance(name, str) or not isinstance(cid, str):
        raise ValueError("tool_calls: 'function.name' and 'id' must be strings")
    return name, fn.get("arguments", {}), cid


def tool_calls_parts(tool_calls: list[dict]) -> list[tuple[str, bool]]:
    """``<｜DSML｜ calls>`` block as prompt pieces: the markup is the encoder's, names and values
    are message text."""
    if not isinstance(tool_calls, list):
        raise ValueError("tool_calls: must be a list")
    out: list[tuple[str, bool]] = [(f"<{DSML} calls>\n", False)]
    for j, tc in enumerate(tool_calls):
        name, args, _ = unpack_call(tc)
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                raise ValueError("tool_calls: 'function.arguments' is not valid JSON") from None
        if not isinstance(args, dict):
            raise ValueError("tool call arguments must be a JSON object")
        if j:
            out.append(("\n", False))
        out += [(f'<{DSML} invoke name="', False), (name, True), ('">\n', False)]
        for k, (key, v) in enumerate(args.items()):
            if k:
                out.append(("\n", False))
            out += [(f'<{DSML} parameter name="', False), (key, True),
                    (f'" string="{"true" if isinstance(v, str) else "false"}">', False),
                    (v if isinstance(v, str) else dump_json(v), True), (f"</{DSML} parameter>", False)]
        out.append((f"\n</{DSML} invoke>", False))
    out.append((f"\n</{DSML} calls>", False))
    return out


def render_tool_calls(tool_calls: list[dict]) -> str:
    """``<｜DSML｜ calls>`` block (without the leading blank line) for OpenAI-style or bare calls."""
    return "".join(t for t, _ in tool_calls_parts(tool_calls))


# ----------------------------------------------------------------------------- parsing

# One ``invoke`` of a calls block (name, body) and one parameter of an invoke (name, string?, value).
INVOKE = re.compile(rf'<{DSML} invoke name="([^"]*)">\n?(.*?)</{DSML} invoke>', re.S)
PARAM = re.compile(rf'<{DSML} parameter name="([^"]*)" string="(true|false)">(.*?)</{DSML} parameter>', re.S)


def parse_tool_calls(content: str) -> tuple[str, list[dict]]:
    """Split content into the text before a ``<｜DSML｜ calls>`` block and OpenAI-style tool calls
    (``arguments`` as a JSON string; ``string="false"`` values are parsed as JSON)."""
    start = content.find(f"<{DSML} calls>")
    if start < 0:
        return content, []
    calls = []
    for name, body in INVOKE.findall(content[start:]):
        args = {}
        for key, is_str, value in PARAM.findall(body):
            if is_str == "true":
                args[key] = value
            else:
                try:
                    parsed = json.loads(value)
                    dump_json(parsed)             # a value nested too deep cannot be written back
                    args[key] = parsed
                except (ValueError, RecursionError):      # not JSON, or nested too deep: its text
                    args[key] = value
        calls.append({"type": "function", "function": {"name": name, "arguments": dump_json(args)}})
    return content[:start].rstrip("\n"), calls
