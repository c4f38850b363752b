"""Pydantic models of the OpenAI request / response shapes the server supports.

Requests accept unknown fields (OpenAI clients send new ones all the time) and ignore them; the
fields below are validated, and a validation error becomes a 400 in the OpenAI error shape
(``{"error": {"message", "type", "param", "code"}}``) naming the field.

Extensions beyond the OpenAI API (all optional):

- ``reasoning_effort``: besides OpenAI's tiers, an integer 1..100 (the V4.1 value) is accepted.
- ``cedlm_reasoning_effort``: integer 1..100, the V4.1 reasoning effort; implies thinking mode
  and wins over ``reasoning_effort``. With the ``openai`` client: ``extra_body={"cedlm_reasoning_effort": 37}``.
- ``thinking`` (bool) or vLLM's ``chat_template_kwargs={"thinking": bool}`` (also
  ``"enable_thinking"``): thinking mode at the default effort (high = 75).
- ``top_k``, ``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output`` (as in vLLM).
- ``cache_salt`` (as in vLLM): a string; requests share prefix-cache blocks (and report
  ``cached_tokens``) only with requests carrying the same salt. Give each tenant its own.

Types are strict where a lax conversion would change the meaning: booleans must be JSON booleans
(``"thinking": "false"`` is a 400, not thinking on), strings in the body must be valid Unicode (a
lone ``\\ud800`` escape is a 400), message content, tool calls and tools must have the OpenAI
shapes, and the body may nest at most ``MAX_DEPTH`` levels. Bounded: at most ``MAX_STOP`` stop
strings of at most ``MAX_STOP_CHARS`` characters each, ``MAX_STOP_TOKEN_IDS`` stop token ids,
``MAX_CACHE_SALT_CHARS`` characters of cache salt.
"""
from __future__ import annotations

import json
import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

MAX_STOP = 16                 # stop strings per request
MAX_STOP_CHARS = 256          # characters per stop string
MAX_STOP_TOKEN_IDS = 256      # stop token ids per request
MAX_CACHE_SALT_CHARS = 256

MAX_DEPTH = 100              # nesting of arrays / objects in a request body

_SURROGATE = re.compile("[\ud800-\udfff]")


def _where(path: list) -> str:
    return ".".join(str(p) for p in path) or "request body"


def _check_body(body: Any) -> None:
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


def _type_name(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(v), type(v).__name__)


def _check_parts(v: Any, where: str) -> None:
    """Content as a list of parts: objects with a string "type"; text parts have a string "text";
    tool_result parts have string content or a list of parts."""
    if not isinstance(v, list):
        raise ValueError(f"{where}: must be a string, null or an array of content parts, got {_type_name(v)}")
    for i, b in enumerate(v):
        w = f"{where}[{i}]"
        if not isinstance(b, dict):
            raise ValueError(f"{w}: a content part must be an object, got {_type_name(b)}")
        t = b.get("type")
        if not isinstance(t, str):
            raise ValueError(f"{w}.type: must be a string")
        if t == "text" and not isinstance(b.get("text", ""), str):
            raise ValueError(f"{w}.text: must be a string, got {_type_name(b.get('text'))}")
        if t == "tool_result":
            c = b.get("content", "")
            if c is not None and not isinstance(c, str):
                _check_parts(c, f"{w}.content")


def _check_tool_call(tc: Any, where: str) -> None:
    if not isinstance(tc, dict):
        raise ValueError(f"{where}: a tool call must be an object, got {_type_name(tc)}")
    fn, w = (tc["function"], f"{where}.function") if "function" in tc else (tc, where)
    if not isinstance(fn, dict):
        raise ValueError(f"{w}: must be an object with 'name' and 'arguments', got {_type_name(fn)}")
    if not isinstance(fn.get("name"), str):
        raise ValueError(f"{w}.name: must be a string")
    for k in ("id",):
        if tc.get(k) is not None and not isinstance(tc[k], str):
            raise ValueError(f"{where}.{k}: must be a string")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise ValueError(f"{w}.arguments: must be a JSON object (as a string or an object)") from None
    if not isinstance(args, dict):
        raise ValueError(f"{w}.arguments: must be a JSON object, got {_type_name(args)}")


def _check_tools(v: Any, where: str) -> None:
    if not isinstance(v, list):
        raise ValueError(f"{where}: must be an array of tools, got {_type_name(v)}")
    for i, t in enumerate(v):
        w = f"{where}[{i}]"
        if not isinstance(t, dict):
            raise ValueError(f"{w}: a tool must be an object, got {_type_name(t)}")
        if t.get("type") == "function" and "function" in t:
            t, w = t["function"], f"{w}.function"
            if not isinstance(t, dict):
                raise ValueError(f"{w}: must be an object, got {_type_name(t)}")
        if not isinstance(t.get("name"), str):
            raise ValueError(f"{w}.name: must be a string")

# OpenAI tiers -> V4.1 integer effort; None = no thinking (chat mode).
# low / high / xhigh / max follow cedlm.text.chat.EFFORT_LEVELS (the official V4.1 levels);
# "medium" (OpenAI's default tier, absent from V4.1) is the rounded midpoint of low and high;
# "minimal" is half of low.
EFFORT_TIERS: dict[str, int | None] = {
    "none": None, "minimal": 25, "low": 50, "medium": 62, "high": 75, "xhigh": 75, "max": 100,
}
DEFAULT_THINKING_EFFORT = 75   # thinking requested without an effort (cedlm.text.chat.DEFAULT_EFFORT)


def _effort_value(v: Any, field: str, allow_tiers: bool) -> Any:
    if v is None:
        return None
    if type(v) is int:
        if 1 <= v <= 100:
            return v
        raise ValueError(f"{field}: integer effort must be in 1..100, got {v}")
    if allow_tiers and isinstance(v, str) and v in EFFORT_TIERS:
        return v
    allowed = (", ".join(repr(k) for k in EFFORT_TIERS) + " or an integer 1..100") if allow_tiers \
        else "an integer 1..100"
    raise ValueError(f"{field}: {v!r} is not valid; allowed: {allowed}")


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False
    stream: StrictBool = False
    stream_options: "StreamOptions | None" = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    user: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)

    @model_validator(mode="before")
    @classmethod
    def _body(cls, data):
        _check_body(data)
        return data

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"stop: at most {MAX_STOP} stop strings, got {len(stops)}")
        for s in stops:
            if not s:
                raise ValueError("stop: stop strings must not be empty")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"stop: a stop string may have at most {MAX_STOP_CHARS} characters, "
                                 f"got {len(s)}")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if v != 1:
            raise ValueError("n: only n=1 is supported")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v, info):
        if v not in (None, 0, 0.0):
            raise ValueError(f"{info.field_name}: penalties are not supported (must be 0)")
        return v


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer", "latest_reminder"]
    content: str | list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    tools: list[dict[str, Any]] | None = None       # on a system / developer message
    task: str | None = None                         # on a user message (cedlm.text.chat.TASK_TOKENS)
    wo_eos: StrictBool | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v):
        if v is not None and not isinstance(v, str):
            _check_parts(v, "content")
        return v

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _tool_calls(cls, v):
        if v is not None:
            if not isinstance(v, list):
                raise ValueError(f"tool_calls: must be an array of tool calls, got {_type_name(v)}")
            for i, tc in enumerate(v):
                _check_tool_call(tc, f"tool_calls[{i}]")
        return v

    @field_validator("tools", mode="before")
    @classmethod
    def _tools(cls, v):
        if v is not None:
            _check_tools(v, "tools")
        return v


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    reasoning_effort: Any = None
    cedlm_reasoning_effort: Any = None
    thinking: StrictBool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None

    @field_validator("tools", mode="before")
    @classmethod
    def _tools(cls, v):
        if v is not None:
            _check_tools(v, "tools")
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v):
        for k in ("thinking", "enable_thinking"):
            if v and k in v and v[k] is not None and not isinstance(v[k], bool):
                raise ValueError(f"chat_template_kwargs.{k}: must be a boolean, got {_type_name(v[k])}")
        return v

    @field_validator("reasoning_effort")
    @classmethod
    def _effort(cls, v):
        return _effort_value(v, "reasoning_effort", allow_tiers=True)

    @field_validator("cedlm_reasoning_effort")
    @classmethod
    def _cedlm_effort(cls, v):
        return _effort_value(v, "cedlm_reasoning_effort", allow_tiers=False)

    def resolve_thinking(self) -> tuple[bool, int | None]:
        """(thinking mode?, V4.1 effort 1..100 or None in chat mode)."""
        if self.cedlm_reasoning_effort is not None:
            return True, self.cedlm_reasoning_effort
        if self.reasoning_effort is not None:
            e = self.reasoning_effort
            e = EFFORT_TIERS[e] if isinstance(e, str) else e
            return (e is not None), e
        kw = self.chat_template_kwargs or {}
        want = self.thinking
        for k in ("thinking", "enable_thinking"):
            if want is None and kw.get(k) is not None:
                want = kw[k]
        return (True, DEFAULT_THINKING_EFFORT) if want else (False, None)


class CompletionRequest(_Request):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: StrictBool = False
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _echo(cls, v):
        if v:
            raise ValueError("echo: echo=true is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        if v:
            raise ValueError("suffix: suffix is not supported")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("prompt: only one prompt per request is supported")
            v = v[0]
        if isinstance(v, list) and not v:
            raise ValueError("prompt: empty prompt")
        return v


# --------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    warning: str | None = None          # set when the client used a deprecated model alias


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    warning: str | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    warning: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "cedlm"
    root: str                            # the served model this name resolves to
    status: Literal["current", "deprecated"] = "current"
    replacement: str | None = None       # for deprecated aliases


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ready", "degraded", "failed"]
    reason: str | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


_Request.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()
