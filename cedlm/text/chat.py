"""DeepSeek-V4.1 chat encoding (strings only; no tokenizer dependency).

``encode_chat`` renders a message list into the exact prompt string of the official V4.1 encoder
(the V4.1 encoder shipped with vLLM, `deepseek_v41_encoding.py`; tests/test_chat.py checks its
rendered examples byte for byte). Messages are dicts:

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

Control tokens come only from this encoder. ``encode_chat_parts`` returns the same prompt as
``(text, is_content)`` pieces, where ``is_content`` marks text taken from the messages (content,
reasoning, tool calls and schemas, tool results); ``encode_chat_ids`` tokenizes those pieces as
plain text (special-token strings typed in them stay text), so a message can never forge a role,
``</think>`` or EOS token. Malformed messages raise ``ValueError`` naming the message and field.

The tool markup (schemas block, calls block, ``parse_tool_calls``) lives in ``chat_tools`` and the
tokenizing of prompt pieces (``tokenize_parts``) in ``chat_tokens``; both are re-exported here.
"""

from __future__ import annotations

import copy

from cedlm.text.chat_tokens import tokenize_parts
from cedlm.text.chat_tools import (TOOLS_TEMPLATE, check_tool_list, dump_json,  # noqa: F401
                                   parse_tool_calls, render_tool_calls, render_tools, tool_calls_parts,
                                   tools_parts, unpack_call)
from cedlm.text.special_tokens import (ASSISTANT, BOS, DSML, EOS, IMAGE_TOKEN,  # noqa: F401
                                      LATEST_REMINDER, SYSTEM, TASK_TOKENS, THINK_END, THINK_START,
                                      USER)

EFFORT_LEVELS = {"low": 50, "high": 75, "xhigh": 75, "max": 100}
DEFAULT_EFFORT = "high"
EFFORT_TEMPLATE = "Reasoning Effort: {n} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"

RESPONSE_FORMAT_TEMPLATE = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"


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


# ----------------------------------------------------------------------------- preprocessing


def _text_of(x, what: str) -> str:
    if x is None:
        return ""
    if not isinstance(x, str):
        raise ValueError(f"{what} must be a string, got {type(x).__name__}")
    return x


def _blocks_parts(blocks: list) -> list[tuple[str, bool]]:
    """Content blocks as prompt pieces (see ``encode_chat_parts``); blocks joined by a blank line."""
    if not isinstance(blocks, list):
        raise ValueError(f"content must be a string or a list of blocks, got {type(blocks).__name__}")
    out: list[tuple[str, bool]] = []
    for k, b in enumerate(blocks):
        if k:
            out.append(("\n\n", False))
        if isinstance(b, str):
            out.append((b, True))
            continue
        if not isinstance(b, dict):
            raise ValueError(f"content[{k}] must be an object, got {type(b).__name__}")
        t = b.get("type")
        if t == "text":
            out.append((_text_of(b.get("text", ""), f"content[{k}].text"), True))
        elif t in ("image", "image_url"):
            out.append((IMAGE_TOKEN, False))
        elif t == "tool_result":
            c = b.get("content", "")
            out.append(("<tool_result>", False))
            if isinstance(c, list):
                for j, x in enumerate(c):
                    if j:
                        out.append(("\n\n", False))
                    if not isinstance(x, dict):
                        raise ValueError(f"content[{k}].content[{j}] must be an object, got {type(x).__name__}")
                    xt = x.get("type")
                    if xt == "text":
                        out.append((_text_of(x.get("text", ""), f"content[{k}].content[{j}].text"), True))
                    elif xt in ("image", "image_url"):
                        out.append((IMAGE_TOKEN, False))
                    else:
                        out.append((f"[Unsupported {xt}]", True))
            else:
                out.append((_text_of(c, f"content[{k}].content"), True))
            out.append(("</tool_result>", False))
        else:
            out.append((f"[Unsupported {t}]", True))
    return out


def _blocks_text(blocks: list) -> str:
    return "".join(t for t, _ in _blocks_parts(blocks))


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
                if unpack_call(tc)[2]:
                    order[unpack_call(tc)[2]] = i
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


def _content_parts(m: dict) -> list[tuple[str, bool]]:
    c = m.get("content")
    if isinstance(c, list):
        return _blocks_parts(c)
    return [(_text_of(c, "content"), True)]


def _content(m: dict) -> str:
    return "".join(t for t, _ in _content_parts(m))


def _render(i: int, msgs: list[dict], thinking: bool, drop: bool, effort: int) -> list[tuple[str, bool]]:
    m = msgs[i]
    role = m.get("role")
    last_user = _last_user(msgs)
    effort_text = EFFORT_TEMPLATE.format(n=effort) if (i == 0 and thinking) else ""
    out: list[tuple[str, bool]] = []
    if i == 0 and (effort_text or role == "system"):
        out.append((SYSTEM, False))
    out.append((effort_text, False))

    if role in ("system", "developer"):
        extra: list[tuple[str, bool]] = []
        if m.get("tools"):
            extra += [("\n\n", False)] + tools_parts(m["tools"])
        if m.get("response_format"):
            head, tail = RESPONSE_FORMAT_TEMPLATE.split("{schema}")
            extra += [("\n\n" + head, False), (dump_json(m["response_format"]), True), (tail, False)]
        content = _content_parts(m)
        if role == "system":
            out += ([(SYSTEM, False)] if i > 0 else []) + content + extra
        else:
            if not "".join(t for t, _ in content):
                raise ValueError("a developer message needs content")
            out += [(USER, False)] + content + extra
    elif role == "user":
        out += [(USER, False)] + (_blocks_parts(m["blocks"]) if "blocks" in m else _content_parts(m))
    elif role == "latest_reminder":
        out += [(LATEST_REMINDER, False)] + _content_parts(m)
    elif role == "assistant":
        after_task = i > 0 and msgs[i - 1].get("task") is not None
        if thinking and not after_task and (not drop or i > last_user):
            out += [(_text_of(m.get("reasoning_content"), "reasoning_content"), True), (THINK_END, False)]
        out += _content_parts(m)
        if m.get("tool_calls"):
            out += [("\n\n", False)] + tool_calls_parts(m["tool_calls"])
        if not m.get("wo_eos"):
            out.append((EOS, False))
    elif role == "tool":  # pragma: no cover - merged away before rendering
        raise ValueError("tool messages must follow an assistant message with tool_calls")
    else:
        raise ValueError(f"unknown message role {role!r}")

    # Transition to the next turn: only when the next message is an assistant / reminder, or at the end.
    if i + 1 < len(msgs) and msgs[i + 1].get("role") not in ("assistant", "latest_reminder"):
        return out
    task = m.get("task")
    if task is not None:
        if not isinstance(task, str) or task not in TASK_TOKENS:
            raise ValueError(f"invalid task {task!r}: allowed values are {', '.join(TASK_TOKENS)}")
        if task == "action":
            out += [(ASSISTANT, False), (THINK_START if thinking else THINK_END, False), (TASK_TOKENS[task], False)]
        else:
            out.append((TASK_TOKENS[task], False))
    elif role in ("user", "developer") or (role == "system" and i > 0):
        out.append((ASSISTANT, False))
        if thinking and (not drop or i >= last_user):
            out.append((THINK_START, False))
        else:
            out.append((THINK_END, False))
    return out


def _check_messages(messages) -> None:
    if not isinstance(messages, list):
        raise ValueError("messages: must be a list of message objects")
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{k}]: must be an object, got {type(m).__name__}")
        if isinstance(m.get("content"), str) and IMAGE_TOKEN in m["content"]:
            raise ValueError(f"message content contains {IMAGE_TOKEN!r}; pass images as content blocks")
        if m.get("tool_calls") is not None and not isinstance(m["tool_calls"], list):
            raise ValueError(f"messages[{k}].tool_calls: must be a list")
        if m.get("tools") is not None and not isinstance(m["tools"], list):
            raise ValueError(f"messages[{k}].tools: must be a list of tool objects")


def encode_chat_parts(
    messages: list[dict],
    thinking_mode: str = "chat",
    reasoning_effort: str | int | None = None,
    drop_thinking: bool = True,
    tools: list[dict] | None = None,
    add_bos: bool = True,
) -> list[tuple[str, bool]]:
    """``encode_chat`` as ``(text, is_content)`` pieces whose concatenation is the prompt string.

    ``is_content`` is True for text taken from the messages, which must be tokenized as plain text
    (``encode_chat_ids``); False for the encoder's own markup (control tokens and templates)."""
    if thinking_mode not in ("chat", "thinking"):
        raise ValueError(f"invalid thinking_mode {thinking_mode!r}: allowed values are 'chat', 'thinking'")
    effort = resolve_effort(reasoning_effort)
    if effort is None:
        thinking_mode = "chat"
        effort = EFFORT_LEVELS[DEFAULT_EFFORT]
    thinking = thinking_mode == "thinking"

    _check_messages(messages)
    msgs = [dict(m) for m in messages]
    if tools:
        check_tool_list(tools)
        sys_idx = next((k for k, m in enumerate(msgs) if m.get("role") == "system"), None)
        if sys_idx is None:
            msgs.insert(0, {"role": "system", "content": ""})
            sys_idx = 0
        msgs[sys_idx]["tools"] = list(msgs[sys_idx].get("tools") or []) + list(tools)
    msgs = _merge_tools(msgs)
    drop = drop_thinking and not any(m.get("tools") for m in msgs)
    if thinking and drop:
        msgs = _drop_old_thinking(msgs)
    parts: list[tuple[str, bool]] = [(BOS, False)] if add_bos else []
    for i in range(len(msgs)):
        parts += _render(i, msgs, thinking, drop, effort)
    return [(t, c) for t, c in parts if t]


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
    return "".join(t for t, _ in encode_chat_parts(messages, thinking_mode, reasoning_effort,
                                                   drop_thinking, tools, add_bos))


def encode_chat_ids(messages: list[dict], tokenizer, thinking_mode: str = "chat",
                    reasoning_effort: str | int | None = None, drop_thinking: bool = True,
                    tools: list[dict] | None = None, add_bos: bool = True) -> list[int]:
    """``encode_chat`` tokenized so that only the encoder emits control tokens (``tokenize_parts``)."""
    return tokenize_parts(encode_chat_parts(messages, thinking_mode, reasoning_effort, drop_thinking,
                                            tools, add_bos), tokenizer)


# ----------------------------------------------------------------------------- parsing responses


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
