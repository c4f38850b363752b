"""DeepSeek-V4.1 chat encoding (strings only; no tokenizer dependency).

``encode_chat`` renders a message list into the exact prompt string of the official V4.1 encoder
(shared/reference/chat-encoding.md holds the authoritative rendered examples). Messages are dicts:

- ``{"role": "system"|"user"|"developer"|"latest_reminder", "content": str}``
- ``{"role": "assistant", "content": str, "reasoning_content": str, "tool_calls": [...], "wo_eos": bool}``
- ``{"role": "tool", "tool_call_id": str, "content": str}``: merged into a user turn as
  ``<tool_result>…</tool_result>`` blocks, in the order of the preceding assistant's calls.
- optional ``"task"`` on a user message: one of ``TASK_TOKENS`` (classification tasks).
- optional ``"tools"`` on a system/developer message (OpenAI ``{"type":"function","function":…}``
  entries or bare function schemas); ``encode_chat(tools=…)`` attaches them to the first system
  message (one with empty content is inserted when there is none).

Content may also be a list of blocks: ``{"type":"text","text":…}``, ``{"type":"image"…}`` /
``{"type":"image_url"…}`` (rendered as ``IMAGE_TOKEN``) and ``{"type":"tool_result",…}``.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM = "<｜System｜>"
THINK_START = "<think>"
THINK_END = "</think>"
LATEST_REMINDER = "<｜latest_reminder｜>"
IMAGE_TOKEN = "<｜deepseek_image｜>"
DSML = "｜DSML｜"
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

EFFORT_LEVELS = {"low": 50, "high": 75, "xhigh": 75, "max": 100}
DEFAULT_EFFORT = "high"
EFFORT_TEMPLATE = "Reasoning Effort: {n} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"

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
RESPONSE_FORMAT_TEMPLATE = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"


def _json(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False)


# ----------------------------------------------------------------------------- effort


def resolve_effort(reasoning_effort: str | int | None) -> int | None:
    """Map a reasoning-effort setting to 1..100, or None for ``"none"`` (chat mode).

    Named levels: low=50, high=75 (default), xhigh=75, max=100; integers 1..100 pass through.
    """
    if reasoning_effort is None:
        return EFFORT_LEVELS[DEFAULT_EFFORT]
    if isinstance(reasoning_effort, str) and reasoning_effort in EFFORT_LEVELS:
        return EFFORT_LEVELS[reasoning_effort]
    if isinstance(reasoning_effort, str) and reasoning_effort == "none":
        return None
    if type(reasoning_effort) is int and 1 <= reasoning_effort <= 100:
        return reasoning_effort
    raise ValueError(
        f"invalid reasoning_effort {reasoning_effort!r}: allowed values are "
        f"{', '.join(repr(k) for k in [*EFFORT_LEVELS, 'none'])}, None, or an int in 1..100"
    )


# ----------------------------------------------------------------------------- tools


def _function(tool: dict) -> dict:
    return tool["function"] if tool.get("type") == "function" and "function" in tool else tool


def render_tools(tools: list[dict]) -> str:
    """The tools instruction block with one JSON schema per line."""
    return TOOLS_TEMPLATE.format(d=DSML, schemas="\n".join(_json(_function(t)) for t in tools))


def _call(tc: dict) -> tuple[str, Any, str]:
    fn = tc.get("function", tc)
    return fn.get("name"), fn.get("arguments", {}), tc.get("id") or fn.get("id") or ""


def render_tool_calls(tool_calls: list[dict]) -> str:
    """``<｜DSML｜ calls>`` block (without the leading blank line) for OpenAI-style or bare calls."""
    invokes = []
    for tc in tool_calls:
        name, args, _ = _call(tc)
        if isinstance(args, str):
            args = json.loads(args)
        if not isinstance(args, dict):
            raise ValueError("tool call arguments must be a JSON object")
        params = [
            f'<{DSML} parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else _json(v)}</{DSML} parameter>"
            for k, v in args.items()
        ]
        invokes.append(f'<{DSML} invoke name="{name}">\n' + "\n".join(params) + f"\n</{DSML} invoke>")
    return f"<{DSML} calls>\n" + "\n".join(invokes) + f"\n</{DSML} calls>"


# ----------------------------------------------------------------------------- preprocessing


def _blocks_text(blocks: list) -> str:
    parts = []
    for b in blocks:
        if isinstance(b, str):
            parts.append(b)
            continue
        t = b.get("type")
        if t == "text":
            parts.append(b.get("text", ""))
        elif t in ("image", "image_url"):
            parts.append(IMAGE_TOKEN)
        elif t == "tool_result":
            c = b.get("content", "")
            if isinstance(c, list):
                c = "\n\n".join(x.get("text", "") if x.get("type") == "text" else
                                (IMAGE_TOKEN if x.get("type") in ("image", "image_url") else f"[Unsupported {x.get('type')}]")
                                for x in c)
            parts.append(f"<tool_result>{c}</tool_result>")
        else:
            parts.append(f"[Unsupported {t}]")
    return "\n\n".join(parts)


def _merge_tools(messages: list[dict]) -> list[dict]:
    """Fold ``tool`` messages into user turns of blocks; order results by the calls that asked."""
    out: list[dict] = []
    order: dict[str, int] = {}
    for m in messages:
        m = copy.deepcopy(m)
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            order = {}
            for i, tc in enumerate(m["tool_calls"]):
                if _call(tc)[2]:
                    order[_call(tc)[2]] = i
        if role == "tool":
            block = {"type": "tool_result", "tool_use_id": m.get("tool_call_id", ""), "content": m.get("content", "")}
            if out and out[-1].get("role") == "user" and "blocks" in out[-1]:
                out[-1]["blocks"].append(block)
            else:
                out.append({"role": "user", "blocks": [block], "_order": order})
        elif role == "user":
            content = m.get("content", "")
            blocks = content if isinstance(content, list) else [{"type": "text", "text": content or ""}]
            if out and out[-1].get("role") == "user" and "blocks" in out[-1] and out[-1].get("task") is None:
                out[-1]["blocks"].extend(blocks)
                if m.get("task") is not None:
                    out[-1]["task"] = m["task"]
            else:
                m["blocks"] = list(blocks)
                m["_order"] = order
                out.append(m)
        else:
            out.append(m)
    for m in out:
        if "blocks" in m:
            order = m.pop("_order", {})
            results = [b for b in m["blocks"] if isinstance(b, dict) and b.get("type") == "tool_result"]
            if len(results) > 1 and order:
                results.sort(key=lambda b: order.get(b.get("tool_use_id", ""), 0))
                it = iter(results)
                m["blocks"] = [next(it) if isinstance(b, dict) and b.get("type") == "tool_result" else b
                               for b in m["blocks"]]
    return out


def _last_user(messages: list[dict]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        r = messages[i].get("role")
        if r in ("user", "developer") or (r == "system" and i > 0):
            return i
    return -1


def _drop_old_thinking(messages: list[dict]) -> list[dict]:
    last = _last_user(messages)
    keep = {"user", "system", "tool", "latest_reminder", "direct_search_results"}
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role in keep or i >= last:
            out.append(m)
        elif role == "assistant":
            m = dict(m)
            m.pop("reasoning_content", None)
            out.append(m)
        # other roles (developer) before the last user turn are dropped
    return out


# ----------------------------------------------------------------------------- rendering


def _content(m: dict) -> str:
    c = m.get("content")
    if isinstance(c, list):
        return _blocks_text(c)
    return c or ""


def _render(i: int, msgs: list[dict], thinking: bool, drop: bool, effort: int) -> str:
    m = msgs[i]
    role = m.get("role")
    last_user = _last_user(msgs)
    effort_text = EFFORT_TEMPLATE.format(n=effort) if (i == 0 and thinking) else ""
    out = SYSTEM if i == 0 and (effort_text or role == "system") else ""
    out += effort_text

    if role in ("system", "developer"):
        extra = ""
        if m.get("tools"):
            extra += "\n\n" + render_tools(m["tools"])
        if m.get("response_format"):
            extra += "\n\n" + RESPONSE_FORMAT_TEMPLATE.format(schema=_json(m["response_format"]))
        if role == "system":
            out += (SYSTEM if i > 0 else "") + _content(m) + extra
        else:
            if not _content(m):
                raise ValueError("a developer message needs content")
            out += USER + _content(m) + extra
    elif role == "user":
        out += USER + (_blocks_text(m["blocks"]) if "blocks" in m else _content(m))
    elif role == "latest_reminder":
        out += LATEST_REMINDER + _content(m)
    elif role == "assistant":
        calls = "\n\n" + render_tool_calls(m["tool_calls"]) if m.get("tool_calls") else ""
        reasoning = ""
        after_task = i > 0 and msgs[i - 1].get("task") is not None
        if thinking and not after_task and (not drop or i > last_user):
            reasoning = (m.get("reasoning_content") or "") + THINK_END
        out += reasoning + _content(m) + calls + ("" if m.get("wo_eos") else EOS)
    elif role == "tool":  # pragma: no cover - merged away before rendering
        raise ValueError("tool messages must follow an assistant message with tool_calls")
    else:
        raise ValueError(f"unknown message role {role!r}")

    # Transition to the next turn: only when the next message is an assistant / reminder, or at the end.
    if i + 1 < len(msgs) and msgs[i + 1].get("role") not in ("assistant", "latest_reminder"):
        return out
    task = m.get("task")
    if task is not None:
        if task not in TASK_TOKENS:
            raise ValueError(f"invalid task {task!r}: allowed values are {', '.join(TASK_TOKENS)}")
        if task == "action":
            out += ASSISTANT + (THINK_START if thinking else THINK_END) + TASK_TOKENS[task]
        else:
            out += TASK_TOKENS[task]
    elif role in ("user", "developer") or (role == "system" and i > 0):
        out += ASSISTANT
        if thinking and (not drop or i >= last_user):
            out += THINK_START
        else:
            out += THINK_END
    return out


def encode_chat(
    messages: list[dict],
    thinking_mode: str = "chat",
    reasoning_effort: str | int | None = None,
    drop_thinking: bool = True,
    tools: list[dict] | None = None,
    add_bos: bool = True,
) -> str:
    """Render ``messages`` into the DeepSeek-V4.1 prompt string (see module docstring).

    ``thinking_mode``: "chat" (generation prompt ends ``</think>``) or "thinking" (ends ``<think>``,
    with the reasoning-effort line in the first system section). ``reasoning_effort="none"`` switches
    to chat mode. ``drop_thinking`` drops the reasoning of assistant turns before the last user turn;
    it is turned off when any message carries tools.
    """
    if thinking_mode not in ("chat", "thinking"):
        raise ValueError(f"invalid thinking_mode {thinking_mode!r}: allowed values are 'chat', 'thinking'")
    effort = resolve_effort(reasoning_effort)
    if effort is None:
        thinking_mode = "chat"
        effort = EFFORT_LEVELS[DEFAULT_EFFORT]
    thinking = thinking_mode == "thinking"

    msgs = [dict(m) for m in messages]
    for m in msgs:
        if isinstance(m.get("content"), str) and IMAGE_TOKEN in m["content"]:
            raise ValueError(f"message content contains {IMAGE_TOKEN!r}; pass images as content blocks")
    if tools:
        sys_idx = next((k for k, m in enumerate(msgs) if m.get("role") == "system"), None)
        if sys_idx is None:
            msgs.insert(0, {"role": "system", "content": ""})
            sys_idx = 0
        msgs[sys_idx]["tools"] = list(msgs[sys_idx].get("tools") or []) + list(tools)
    msgs = _merge_tools(msgs)
    drop = drop_thinking and not any(m.get("tools") for m in msgs)
    if thinking and drop:
        msgs = _drop_old_thinking(msgs)
    return (BOS if add_bos else "") + "".join(_render(i, msgs, thinking, drop, effort) for i in range(len(msgs)))


# ----------------------------------------------------------------------------- parsing responses

_INVOKE = re.compile(rf'<{DSML} invoke name="([^"]*)">\n?(.*?)</{DSML} invoke>', re.S)
_PARAM = re.compile(rf'<{DSML} parameter name="([^"]*)" string="(true|false)">(.*?)</{DSML} parameter>', re.S)


def parse_assistant(text: str, thinking: bool = False) -> tuple[str, str]:
    """Split a generated response into ``(reasoning_content, content)`` at the first ``</think>``.

    A leading ``<think>`` and a trailing EOS are removed. Without ``</think>``, the text is all
    content, or all (unfinished) reasoning when ``thinking`` is true (the prompt ended in ``<think>``).
    """
    if text.endswith(EOS):
        text = text[: -len(EOS)]
    if text.startswith(THINK_START):
        text = text[len(THINK_START):]
    if THINK_END in text:
        reasoning, content = text.split(THINK_END, 1)
        return reasoning, content
    return (text, "") if thinking else ("", text)


def parse_tool_calls(content: str) -> tuple[str, list[dict]]:
    """Split content into the text before a ``<｜DSML｜ calls>`` block and OpenAI-style tool calls
    (``arguments`` as a JSON string; ``string="false"`` values are parsed as JSON)."""
    start = content.find(f"<{DSML} calls>")
    if start < 0:
        return content, []
    calls = []
    for name, body in _INVOKE.findall(content[start:]):
        args = {}
        for key, is_str, value in _PARAM.findall(body):
            if is_str == "true":
                args[key] = value
            else:
                try:
                    args[key] = json.loads(value)
                except ValueError:
                    args[key] = value
        calls.append({"type": "function", "function": {"name": name, "arguments": _json(args)}})
    return content[:start].rstrip("\n"), calls
