"""The Responses API request (``POST /v1/responses``) and its translation to a chat request.

cedlm serves the Responses API by translating the request into the chat completion it stands for
(``to_chat``), so the same encoding, reasoning effort, tools, structured output, sampling and
limits apply; ``cedlm.server.responses`` turns the chat answer back into a Response object or its
typed stream events.

Served: ``input`` (a string, or a list of items: messages with ``input_text`` / ``input_image`` /
``output_text`` parts, ``function_call`` and ``function_call_output`` items), ``instructions`` (a
system message first), ``max_output_tokens``, ``reasoning.effort`` (the chat effort tiers;
without it, no reasoning, as on /v1/chat/completions), ``temperature``, ``top_p``, ``stream``,
``tools`` of type ``function`` (flat: name, description, parameters, strict), ``tool_choice``
("auto", "none", "required", ``{"type": "function", "name": ...}``), ``parallel_tool_calls``,
``text.format`` (text, json_object, json_schema), and the chat extensions listed in
``PASSED_THROUGH`` (seed, top_k, stop, ...). ``user``, ``metadata``, ``safety_identifier``,
``prompt_cache_key``, ``service_tier`` are accepted as on chat.

Not served, each a 501 ``unsupported_feature`` naming the field (``UNSUPPORTED``): stored
responses and conversations (``store: true``, ``previous_response_id``, ``conversation``),
``background``, prompt templates, ``include``, built-in tools (web search, file search, computer
use, code interpreter, MCP, image generation, custom tools), reasoning summaries, ``truncation:
"auto"``, ``max_tool_calls``, ``top_logprobs``, ``text.verbosity`` other than medium, other input
item types (reasoning items, file inputs, ...). OpenAI's ``store`` defaults to true; here
nothing is stored, so ``store`` must be omitted or false.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from cedlm.server.protocol.checks import check_body, check_count, type_name
from cedlm.server.protocol.params import MAX_TEMPERATURE

# Chat (and vLLM) request fields a Responses request may carry unchanged.
PASSED_THROUGH = ("seed", "top_k", "min_p", "stop", "stop_token_ids", "min_tokens", "ignore_eos",
                  "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                  "cache_salt", "skip_special_tokens", "cedlm_reasoning_effort", "user", "metadata",
                  "safety_identifier", "prompt_cache_key", "service_tier")

# field -> (is the value neutral?, why it is not served)
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "previous_response_id": (lambda v: v is None, "responses are not stored, so there is no previous "
                                                  "response to continue; send the whole conversation in 'input'"),
    "conversation": (lambda v: v is None, "conversations are not stored; send the whole conversation in 'input'"),
    "store": (lambda v: v in (None, False), "responses are not stored; leave 'store' unset or false"),
    "background": (lambda v: v in (None, False), "background responses are not supported"),
    "prompt": (lambda v: v is None, "prompt templates are not supported; send 'input' and 'instructions'"),
    "include": (lambda v: v in (None, []), "no extra output data can be included"),
    "truncation": (lambda v: v in (None, "disabled"), "truncation 'auto' is not supported (a prompt over "
                                                     "the context is a 400)"),
    "max_tool_calls": (lambda v: v is None, "max_tool_calls applies to built-in tools, which are not supported"),
    "top_logprobs": (lambda v: v in (None, 0), "log probabilities are not returned by /v1/responses; use "
                                               "/v1/chat/completions with logprobs"),
    "stream_options": (lambda v: v is None or not v.get("include_obfuscation"),
                       "stream obfuscation is not supported"),
    "context_management": (lambda v: v is None, "context management is not supported"),
}
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


class UnsupportedFeature(ValueError):
    """A Responses field or feature cedlm does not serve (a 501 naming `param`)."""

    def __init__(self, param: str, why: str):
        super().__init__(f"{param}: {why}")
        self.param = param


class ResponsesRequest(BaseModel):
    """A ``POST /v1/responses`` body (module docstring). Unknown fields are accepted and ignored,
    as on chat; the fields of ``UNSUPPORTED`` are a 501 unless neutral."""
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: StrictBool = False
    reasoning: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v):
        check_count({"input": v}, "input")
        check_body(v)
        if isinstance(v, list) and not v:
            raise ValueError("input: must not be empty")
        return v

    @field_validator("reasoning")
    @classmethod
    def _reasoning(cls, v):
        if v is None:
            return v
        e = v.get("effort")
        if e is not None and e not in _EFFORTS:
            raise ValueError(f"reasoning.effort: must be one of {', '.join(_EFFORTS)}, got {e!r}")
        return v


def unsupported_fields(body: ResponsesRequest) -> None:
    """Raise UnsupportedFeature for the first field cedlm does not serve (module docstring)."""
    extra = body.model_extra or {}
    for k, (neutral, why) in UNSUPPORTED.items():
        if k in extra:
            try:
                ok = neutral(extra[k])
            except AttributeError:          # e.g. stream_options not an object
                raise ValueError(f"{k}: must be an object, got {type_name(extra[k])}") from None
            if not ok:
                raise UnsupportedFeature(k, why)
    r = body.reasoning or {}
    for k in r:
        if k == "summary" and r[k] is not None:
            raise UnsupportedFeature("reasoning.summary", "reasoning summaries are not generated; the "
                                     "reasoning text comes whole in the reasoning item's content")
        if k not in ("effort", "summary", "generate_summary"):
            raise UnsupportedFeature(f"reasoning.{k}", "not supported (reasoning.effort is)")
    if r.get("generate_summary") is not None:
        raise UnsupportedFeature("reasoning.generate_summary", "reasoning summaries are not generated")
    t = body.text or {}
    for k in t:
        if k == "verbosity" and t[k] not in (None, "medium"):
            raise UnsupportedFeature("text.verbosity", "only 'medium' (the model's own length) is served")
        elif k not in ("format", "verbosity"):
            raise UnsupportedFeature(f"text.{k}", "not supported (text.format is)")


def _tool(t: Any, i: int) -> dict:
    w = f"tools[{i}]"
    if not isinstance(t, dict):
        raise ValueError(f"{w}: a tool must be an object, got {type_name(t)}")
    if not isinstance(t.get("type"), str):
        raise ValueError(f"{w}.type: must be a string ('function')")
    if t.get("type") != "function":
        raise UnsupportedFeature(f"{w}.type", f"{t.get('type')!r} tools are not supported; cedlm runs no "
                                 f"built-in tools, only 'function' tools the client executes")
    fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
    return {"type": "function", "function": fn}


def _tool_choice(tc: Any) -> Any:
    if tc is None or tc in ("none", "auto", "required"):
        return tc
    if isinstance(tc, dict) and tc.get("type") == "function":
        if not isinstance(tc.get("name"), str):
            raise ValueError("tool_choice.name: must be a string")
        return {"type": "function", "function": {"name": tc["name"]}}
    if isinstance(tc, dict) and isinstance(tc.get("type"), str):
        raise UnsupportedFeature("tool_choice.type", f"{tc.get('type')!r} is not supported; use 'auto', 'none', "
                                 f"'required' or {{\"type\": \"function\", \"name\": ...}}")
    raise ValueError(f"tool_choice: {tc!r} is not valid; use 'auto', 'none', 'required' or "
                     f"{{\"type\": \"function\", \"name\": ...}}")


def _format(f: Any) -> dict | None:
    if f is None:
        return None
    if not isinstance(f, dict):
        raise ValueError(f"text.format: must be an object, got {type_name(f)}")
    kind = f.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(f.get("schema"), dict):
            raise ValueError("text.format.schema: must be a JSON schema object")
        js = {k: f[k] for k in ("name", "schema", "strict", "description") if f.get(k) is not None}
        js.setdefault("name", "output")
        return {"type": "json_schema", "json_schema": js}
    raise ValueError(f"text.format.type: must be 'text', 'json_object' or 'json_schema', got {kind!r}")


_PART_TYPES = {"input_text": "text", "output_text": "text", "text": "text"}


def _content(c: Any, where: str) -> str | list[dict]:
    """A message's content as chat content: text parts and images (input_image)."""
    if isinstance(c, str):
        return c
    if not isinstance(c, list):
        raise ValueError(f"{where}: must be a string or an array of content parts, got {type_name(c)}")
    parts = []
    for j, p in enumerate(c):
        w = f"{where}[{j}]"
        if not isinstance(p, dict):
            raise ValueError(f"{w}: a content part must be an object, got {type_name(p)}")
        kind = p.get("type")
        if not isinstance(kind, str):
            raise ValueError(f"{w}.type: must be a string")
        if kind in _PART_TYPES:
            if not isinstance(p.get("text"), str):
                raise ValueError(f"{w}.text: must be a string")
            parts.append({"type": "text", "text": p["text"]})
        elif kind == "input_image":
            url = p.get("image_url")
            if not isinstance(url, str):
                raise UnsupportedFeature(f"{w}.image_url", "an image is accepted as an image_url (a data: URL, "
                                         "or http(s) when the server allows it); file_id is not supported")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise UnsupportedFeature(f"{w}.type", f"{kind!r} content is not supported (input_text, "
                                     f"output_text and input_image are)")
    return parts


def _messages(items: str | list[dict]) -> list[dict]:
    """The chat messages of a Responses ``input``."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    msgs: list[dict] = []
    for i, it in enumerate(items):
        w = f"input[{i}]"
        if not isinstance(it, dict):
            raise ValueError(f"{w}: an input item must be an object, got {type_name(it)}")
        kind = it.get("type", "message")
        if not isinstance(kind, str):
            raise ValueError(f"{w}.type: must be a string")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ValueError(f"{w}.role: must be user, system, developer or assistant, got {role!r}")
            content = _content(it.get("content"), f"{w}.content")
            if role == "assistant" and isinstance(content, list):
                content = "".join(p.get("text", "") for p in content)
            msgs.append({"role": role, "content": content})
        elif kind == "function_call":
            for k in ("call_id", "name", "arguments"):
                if not isinstance(it.get(k), str):
                    raise ValueError(f"{w}.{k}: must be a string")
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            if msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls") is not None:
                msgs[-1]["tool_calls"].append(call)          # parallel calls: one assistant turn
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(it.get("call_id"), str):
                raise ValueError(f"{w}.call_id: must be a string")
            out = it.get("output")
            if not isinstance(out, str):
                out = _content(out, f"{w}.output")
                out = "".join(p.get("text", "") for p in out) if isinstance(out, list) else out
            msgs.append({"role": "tool", "tool_call_id": it["call_id"], "content": out})
        else:
            raise UnsupportedFeature(f"{w}.type", f"{kind!r} input items are not supported (message, "
                                     f"function_call and function_call_output are)")
    return msgs


def effort_of(body: ResponsesRequest) -> str | None:
    return (body.reasoning or {}).get("effort")


def to_chat(body: ResponsesRequest) -> dict:
    """The /v1/chat/completions body a Responses request stands for. Raises UnsupportedFeature
    (501) or ValueError (400), each naming the field."""
    unsupported_fields(body)
    msgs = _messages(body.input)
    if body.instructions is not None:
        msgs.insert(0, {"role": "system", "content": body.instructions})
    chat: dict[str, Any] = {"messages": msgs, "stream": body.stream}
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    for k, v in (("model", body.model), ("max_tokens", body.max_output_tokens), ("temperature", body.temperature),
                 ("top_p", body.top_p), ("parallel_tool_calls", body.parallel_tool_calls),
                 ("reasoning_effort", effort_of(body))):
        if v is not None:
            chat[k] = v
    if body.tools:
        chat["tools"] = [_tool(t, i) for i, t in enumerate(body.tools)]
    tc = _tool_choice(body.tool_choice)
    if tc is not None:
        chat["tool_choice"] = tc
    fmt = _format((body.text or {}).get("format"))
    if fmt is not None:
        chat["response_format"] = fmt
    for k in PASSED_THROUGH:
        if k in (body.model_extra or {}):
            chat[k] = body.model_extra[k]
    return chat
