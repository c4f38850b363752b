"""Pydantic models of the OpenAI request / response shapes the server supports.

A validation error becomes a 400 in the OpenAI error shape (``{"error": {"message", "type",
"param", "code"}}``) naming the field.

Every parameter is either honoured or refused, never silently dropped. ``HONOURED`` below lists
each request parameter the server declares and what it does (the README's table); parameters
named in ``REFUSED`` (OpenAI / vLLM parameters cedlm does not implement) get a 400 naming them
when set to anything but their neutral value. Other unknown fields are accepted and ignored, since
OpenAI clients send new ones all the time (vLLM does the same).

Extensions beyond the OpenAI API (all optional):

- ``reasoning_effort``: the tiers of ``EFFORT_TIERS`` (DeepSeek's API names), or an integer
  1..100 (the V4.1 value, as vLLM's V4.1 encoder takes it).
- ``cedlm_reasoning_effort``: integer 1..100, the V4.1 reasoning effort; implies thinking mode
  and wins over ``reasoning_effort``. With the ``openai`` client: ``extra_body={"cedlm_reasoning_effort": 37}``.
- ``thinking``: DeepSeek's ``{"type": "enabled"|"disabled"}``, or a boolean; also vLLM's
  ``chat_template_kwargs={"thinking": bool}`` (or ``"enable_thinking"``). Thinking at the
  default effort (high = 75) unless an effort is given.
- vLLM's sampling extensions: ``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``,
  ``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``, ``best_of``; structured
  output as ``structured_outputs`` ({"json" | "regex" | "choice" | "grammar" | "json_object"}) or
  the older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``.
- ``/v1/completions``: vLLM's ``prompt_logprobs``, ``add_special_tokens`` (false: no BOS before a
  text prompt), ``return_tokens_as_token_ids``, ``response_format``.
- ``cache_salt`` (as in vLLM): a string; requests share prefix-cache blocks (and report
  ``cached_tokens``) only with requests carrying the same salt. Give each tenant its own.

Types are strict where a lax conversion would change the meaning: booleans must be JSON booleans
(``"thinking": "false"`` is a 400, not thinking on), strings in the body must be valid Unicode (a
lone ``\\ud800`` escape is a 400), message content, tool calls and tools must have the OpenAI
shapes, and the body may nest at most ``MAX_DEPTH`` levels. Bounded: at most ``MAX_STOP`` stop
strings of at most ``MAX_STOP_CHARS`` characters each, ``MAX_STOP_TOKEN_IDS`` stop token ids,
``MAX_CACHE_SALT_CHARS`` characters of cache salt, ``MAX_N`` choices (``n`` / ``best_of``),
``MAX_PROMPTS`` prompts per completions request, ``MAX_LOGIT_BIAS`` logit_bias entries.
"""
from __future__ import annotations

import json
import math
import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from cedlm.server.tools import check_tool_choice, check_tools
from cedlm.server.tools import names as tool_names

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
    check_tools(v, where)


# Reasoning-effort tiers -> V4.1 integer effort; None = no thinking (chat mode). The names are
# DeepSeek's API tiers, mapped as its API maps them (minimal -> low, medium / xhigh -> high,
# ultra -> max), onto the official V4.1 levels low=50, high=75, max=100
# (cedlm.text.chat.EFFORT_LEVELS; vLLM's V4.1 encoder takes low / high / xhigh / max or 1..100).
EFFORT_TIERS: dict[str, int | None] = {
    "none": None, "minimal": 50, "low": 50, "medium": 75, "high": 75, "xhigh": 75, "max": 100, "ultra": 100,
}
DEFAULT_THINKING_EFFORT = 75   # thinking requested without an effort (cedlm.text.chat.DEFAULT_EFFORT)

MAX_N = 16                     # n and best_of
MAX_PROMPTS = 256              # prompts in one /v1/completions request
MAX_CHOICES = 256              # prompts x max(n, best_of)
MAX_LOGIT_BIAS = 1024          # logit_bias entries
MAX_TOP_LOGPROBS = 20

# Parameters known from the OpenAI / vLLM APIs that cedlm does not implement: a 400 naming the
# parameter unless the value is the neutral one (name -> (is_neutral, why)).
REFUSED: dict[str, tuple[Any, str]] = {
    "suffix": (lambda v: v in (None, ""), "suffix (insertion) is not supported"),
    "use_beam_search": (lambda v: v in (None, False), "beam search is not supported"),
    "length_penalty": (lambda v: v in (None, 1, 1.0), "length_penalty applies to beam search, which is not supported"),
    "prompt_logprobs": (lambda v: v is None, "prompt_logprobs is supported on /v1/completions only"),
    "functions": (lambda v: v in (None, []), "the deprecated 'functions' is not supported; use 'tools'"),
    "function_call": (lambda v: v is None, "the deprecated 'function_call' is not supported; use 'tool_choice'"),
    "audio": (lambda v: v is None, "audio output is not supported"),
    "modalities": (lambda v: v in (None, ["text"]), "only the 'text' modality is supported"),
    "prediction": (lambda v: v is None, "predicted outputs are not supported"),
    "web_search_options": (lambda v: v is None, "web search is not supported"),
    "store": (lambda v: v in (None, False), "stored completions are not supported"),
    "verbosity": (lambda v: v is None, "verbosity is not supported"),
    "echo": (lambda v: v in (None, False), "echo is supported on /v1/completions only"),
    "add_generation_prompt": (lambda v: v in (None, True), "add_generation_prompt=false is not supported"),
    "continue_final_message": (lambda v: v in (None, False), "continue_final_message is not supported"),
    "chat_template": (lambda v: v is None, "a custom chat_template is not supported (cedlm uses the V4.1 encoding)"),
    "documents": (lambda v: v is None, "documents are not supported"),
    "priority": (lambda v: v in (None, 0), "request priorities are not supported"),
    "truncate_prompt_tokens": (lambda v: v is None, "truncate_prompt_tokens is not supported"),
    "logits_processors": (lambda v: v is None, "custom logits processors are not accepted over HTTP"),
    "guided_decoding_backend": (lambda v: v is None, "the grammar backend is fixed (llguidance)"),
    "guided_whitespace_pattern": (lambda v: v is None, "guided_whitespace_pattern is not supported"),
    "bad_words": (lambda v: v in (None, []), "bad_words is not supported; use logit_bias"),
    "n_logprobs": (lambda v: v is None, "unknown parameter; use logprobs"),
}
# Every request parameter the server declares, and what it does (the README's parameter table).
# tests/test_server_parity.py checks that this covers every declared field.
HONOURED: dict[str, str] = {
    # both endpoints
    "model": "served name or alias; unknown -> 404 model_not_found",
    "max_tokens": "omitted -> --default-max-tokens (256), within the context left; 0 on completions only to score",
    "temperature": "0 = greedy", "top_p": "nucleus", "top_k": "vLLM; 0 / -1 off", "min_p": "vLLM; at the temperature",
    "n": f"choices, 1..{MAX_N}; one engine group (the prompt is prefilled once)",
    "best_of": "that many sampled, the n with the highest cumulative logprob returned; not with stream",
    "seed": "sample i uses seed + i", "stop": f"up to {MAX_STOP} strings", "stop_token_ids": "vLLM",
    "min_tokens": "vLLM; EOS and stop_token_ids banned before", "ignore_eos": "vLLM",
    "include_stop_str_in_output": "vLLM", "stream": "SSE", "stream_options": "include_usage",
    "presence_penalty": "[-2, 2]", "frequency_penalty": "[-2, 2]", "repetition_penalty": "vLLM; > 0",
    "logit_bias": "{token id: bias in [-100, 100]}", "allowed_token_ids": "vLLM",
    "response_format": "text, json_object, json_schema (grammar-constrained)",
    "structured_outputs": "vLLM: json, regex, choice, grammar (Lark / GBNF), json_object",
    "guided_json": "vLLM (older name)", "guided_regex": "vLLM (older name)",
    "guided_choice": "vLLM (older name)", "guided_grammar": "vLLM (older name)",
    "cache_salt": "vLLM; prefix-cache isolation",
    "user": "accepted, no effect (as OpenAI: abuse tracking)", "metadata": "accepted, no effect",
    "service_tier": "'auto' / 'default' only (one tier)", "safety_identifier": "accepted, no effect",
    "prompt_cache_key": "accepted, no effect (the prefix cache needs no hint; cache_salt isolates)",
    # chat
    "messages": "V4.1 chat encoding", "max_completion_tokens": "as max_tokens",
    "logprobs": "chat: bool; completions: top-k 0..20", "top_logprobs": "0..20, with logprobs=true",
    "reasoning_effort": "the effort table", "cedlm_reasoning_effort": "integer 1..100, implies thinking",
    "thinking": "DeepSeek {type: enabled|disabled}, or a boolean",
    "chat_template_kwargs": "thinking / enable_thinking, reasoning_effort, drop_thinking",
    "tools": "function tools, validated", "tool_choice": "none, auto, required, or a named function",
    "parallel_tool_calls": "false: at most one call",
    # completions
    "prompt": f"text, token ids, or a list of either (up to {MAX_PROMPTS})",
    "prompt_logprobs": "vLLM; prompt scoring", "echo": "prompt first, in text and logprobs",
    "add_special_tokens": "vLLM; false: no BOS before a text prompt",
    "return_tokens_as_token_ids": "vLLM; tokens as 'token_id:N'",
}

CHAT_ONLY_REFUSED = ("echo", "prompt_logprobs", "suffix")
COMPLETIONS_ONLY_REFUSED = ("functions", "function_call", "audio", "modalities", "prediction",
                            "web_search_options", "add_generation_prompt", "continue_final_message",
                            "chat_template", "documents")
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _refuse(data: Any, names) -> None:
    if not isinstance(data, dict):
        return
    for k in names:
        if k in data:
            neutral, why = REFUSED[k]
            if not neutral(data[k]):
                raise ValueError(f"{k}: {why}")


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


def _check_response_format(v: Any) -> Any:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ValueError(f"response_format: must be an object, got {_type_name(v)}")
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
                             f"got {_type_name(schema)}")
        if js.get("strict") is not None and not isinstance(js["strict"], bool):
            raise ValueError("response_format.json_schema.strict: must be a boolean")
    return v


def _check_structured(v: Any) -> Any:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ValueError(f"structured_outputs: must be an object, got {_type_name(v)}")
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


def _check_logit_bias(v: Any) -> Any:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ValueError(f"logit_bias: must be an object mapping token ids to biases, got {_type_name(v)}")
    if len(v) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(v)}")
    out: dict[int, float] = {}
    for k, b in v.items():
        if not (isinstance(k, str) and k.isdigit()):
            raise ValueError(f"logit_bias: key {k!r} is not a token id (a non-negative integer as a string)")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or not -100 <= b <= 100:
            raise ValueError(f"logit_bias: the bias of token {k} must be a number in [-100, 100], got {b!r}")
        out[int(k)] = float(b)
    return out


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    best_of: StrictInt | None = Field(default=None, ge=1, le=MAX_N)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    min_tokens: StrictInt = Field(default=0, ge=0)
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False
    stream: StrictBool = False
    stream_options: "StreamOptions | None" = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    logit_bias: Any = None
    allowed_token_ids: list[StrictInt] | None = Field(default=None, min_length=1, max_length=MAX_LOGIT_BIAS)
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # accepted, no effect on generation (as with OpenAI: tracking, routing and tier hints)
    user: str | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
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

    @field_validator("allowed_token_ids")
    @classmethod
    def _allowed(cls, v):
        if v is not None and any(t < 0 for t in v):
            raise ValueError("allowed_token_ids: token ids must be >= 0")
        return v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, v):
        return _check_logit_bias(v)

    @field_validator("response_format", mode="before")
    @classmethod
    def _response_format(cls, v):
        return _check_response_format(v)

    @field_validator("structured_outputs", mode="before")
    @classmethod
    def _structured(cls, v):
        return _check_structured(v)

    @field_validator("service_tier")
    @classmethod
    def _tier(cls, v):
        if v not in (None, "auto", "default"):
            raise ValueError(f"service_tier: {v!r} is not available; this server has one tier ('auto' / 'default')")
        return v

    @model_validator(mode="after")
    def _choices(self):
        if self.best_of is not None:
            if self.best_of < self.n:
                raise ValueError(f"best_of: must be >= n ({self.n}), got {self.best_of}")
            if self.stream and self.best_of > self.n:
                raise ValueError("best_of: cannot stream when best_of > n (the best are known only at the end)")
        if self.min_tokens and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        given = [k for k in ("response_format", "structured_outputs", *GUIDED) if getattr(self, k) is not None
                 and not (k == "response_format" and self.response_format.get("type") == "text")]
        if len(given) > 1:
            raise ValueError(f"{given[1]}: give only one of response_format, structured_outputs, guided_* "
                             f"(got {', '.join(given)})")
        self.guided()                     # a JSON schema given as a string must parse
        return self

    def guided(self) -> tuple[str, str, Any] | None:
        """The requested output constraint as (param, kind, value) with kind in json_schema,
        json_object, regex, choice, grammar; None when unconstrained."""
        rf = self.response_format
        if rf is not None and rf.get("type") != "text":
            if rf["type"] == "json_object":
                return "response_format", "json_object", None
            js = rf["json_schema"]
            return "response_format", "json_schema", js.get("schema", js.get("json_schema"))
        so = self.structured_outputs
        if so is not None:
            k = next(k for k in ("json", "regex", "choice", "grammar", "json_object") if so.get(k) not in (None, False))
            kind = {"json": "json_schema"}.get(k, k)
            v = so[k]
            if kind == "json_schema" and isinstance(v, str):
                try:
                    v = json.loads(v)
                except ValueError:
                    raise ValueError("structured_outputs.json: not valid JSON") from None
            return "structured_outputs", kind, v
        for k, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
            v = getattr(self, k)
            if v is not None:
                if kind == "json_schema" and isinstance(v, str):
                    try:
                        v = json.loads(v)
                    except ValueError:
                        raise ValueError(f"{k}: not valid JSON") from None
                return k, kind, v
        return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False

    @field_validator("continuous_usage_stats")
    @classmethod
    def _continuous(cls, v):
        if v:
            raise ValueError("stream_options.continuous_usage_stats: not supported")
        return v


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


class _ChatTemplate(BaseModel):
    """The fields that decide the chat prompt (shared by chat completions and /tokenize)."""
    model_config = ConfigDict(extra="allow")

    messages: list[ChatMessage] | None = None
    reasoning_effort: Any = None
    cedlm_reasoning_effort: Any = None
    thinking: StrictBool | dict[str, Any] | None = None     # DeepSeek's {"type": ...} becomes a bool
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _tools(cls, v):
        if v is not None:
            _check_tools(v, "tools")
        return v

    @field_validator("thinking", mode="before")
    @classmethod
    def _thinking(cls, v):
        if v is None or isinstance(v, bool):
            return v
        if isinstance(v, dict):
            t = v.get("type")
            if t not in ("enabled", "disabled"):
                raise ValueError(f"thinking.type: must be 'enabled' or 'disabled', got {t!r}")
            extra = [k for k in v if k != "type"]
            if extra:
                raise ValueError(f"thinking.{extra[0]}: not supported (set the effort with reasoning_effort)")
            return t == "enabled"
        raise ValueError(f"thinking: must be {{\"type\": \"enabled\"|\"disabled\"}} or a boolean, got {_type_name(v)}")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v):
        for k in ("thinking", "enable_thinking", "drop_thinking"):
            if v and k in v and v[k] is not None and not isinstance(v[k], bool):
                raise ValueError(f"chat_template_kwargs.{k}: must be a boolean, got {_type_name(v[k])}")
        known = {"thinking", "enable_thinking", "reasoning_effort", "drop_thinking"}
        for k in v or {}:
            if k not in known:
                raise ValueError(f"chat_template_kwargs.{k}: not supported (known: {', '.join(sorted(known))})")
        if v and v.get("reasoning_effort") is not None:
            _effort_value(v["reasoning_effort"], "chat_template_kwargs.reasoning_effort", allow_tiers=True)
        return v

    @field_validator("reasoning_effort")
    @classmethod
    def _effort(cls, v):
        return _effort_value(v, "reasoning_effort", allow_tiers=True)

    @field_validator("cedlm_reasoning_effort")
    @classmethod
    def _cedlm_effort(cls, v):
        return _effort_value(v, "cedlm_reasoning_effort", allow_tiers=False)

    @property
    def drop_thinking(self) -> bool:
        v = (self.chat_template_kwargs or {}).get("drop_thinking")
        return True if v is None else v

    def resolve_thinking(self) -> tuple[bool, int | None]:
        """(thinking mode?, V4.1 effort 1..100 or None in chat mode).

        Precedence: cedlm_reasoning_effort; reasoning_effort (``"none"`` = chat mode); an explicit
        thinking switch (``thinking`` / ``chat_template_kwargs``), with the effort from
        ``chat_template_kwargs.reasoning_effort`` or the default (high)."""
        if self.cedlm_reasoning_effort is not None:
            return True, self.cedlm_reasoning_effort
        kw = self.chat_template_kwargs or {}
        switch = self.thinking
        for k in ("thinking", "enable_thinking"):
            if switch is None and kw.get(k) is not None:
                switch = kw[k]
        e = self.reasoning_effort if self.reasoning_effort is not None else kw.get("reasoning_effort")
        if e is not None:
            e = EFFORT_TIERS[e] if isinstance(e, str) else e
            if e is None or switch is False:        # "none", or thinking explicitly disabled
                return False, None
            return True, e
        return (True, DEFAULT_THINKING_EFFORT) if switch else (False, None)


class ChatCompletionRequest(_Request, _ChatTemplate):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data):
        _refuse(data, [k for k in REFUSED if k not in ("suffix",)])
        return data

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, v):
        return check_tool_choice(v)

    @model_validator(mode="after")
    def _tool_rules(self):
        tc = self.tool_choice
        if tc not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice: requires 'tools'")
        if isinstance(tc, dict):
            want = tc["function"]["name"]
            if want not in tool_names(self.tools):
                raise ValueError(f"tool_choice.function.name: {want!r} is not one of the tools "
                                 f"({', '.join(tool_names(self.tools))})")
        if tc not in (None, "none", "auto") and self.guided() is not None:
            raise ValueError(f"tool_choice: {tc if isinstance(tc, str) else 'a named function'} cannot be "
                             f"combined with response_format / structured outputs")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs=true")
        return self

    def forced_tools(self) -> bool:
        """tool_choice is "required" or a named function (the output is constrained to a call)."""
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, dict))


PromptType = str | list[StrictInt] | list[str] | list[list[StrictInt]]


class CompletionRequest(_Request):
    prompt: PromptType
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: StrictBool = False
    add_special_tokens: StrictBool = True
    return_tokens_as_token_ids: StrictBool = False

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data):
        _refuse(data, [k for k in REFUSED if k not in CHAT_ONLY_REFUSED + COMPLETIONS_ONLY_REFUSED] + ["suffix"])
        return data

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt: empty prompt")
        if isinstance(v, list) and isinstance(v[0], (str, list)):
            if len(v) > MAX_PROMPTS:
                raise ValueError(f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(v)}")
            for i, p in enumerate(v):
                if isinstance(p, list) and not p:
                    raise ValueError(f"prompt[{i}]: empty prompt")
        return v

    @model_validator(mode="after")
    def _zero(self):
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise ValueError("max_tokens: 0 is allowed only to score the prompt (with echo=true or prompt_logprobs)")
        if self.max_tokens == 0 and self.min_tokens:
            raise ValueError("min_tokens: must be 0 when max_tokens is 0")
        n = len(self.prompts()) * max(self.n, self.best_of or 1)
        if n > MAX_CHOICES:
            raise ValueError(f"n: {len(self.prompts())} prompts x {max(self.n, self.best_of or 1)} samples is "
                             f"{n} sequences; at most {MAX_CHOICES} per request")
        if self.echo and self.best_of is not None and self.best_of > self.n:
            raise ValueError("best_of: cannot be combined with echo when best_of > n")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per choice group (a text or a token-id list)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)


class TokenizeRequest(_ChatTemplate):
    """vLLM's /tokenize: ``{"model", "prompt"}`` (a text; ``add_special_tokens`` default true:
    a BOS first, as /v1/completions does) or ``{"model", "messages"}`` (the V4.1 chat prompt, as
    /v1/chat/completions encodes it; the same thinking / effort / tools fields)."""
    model: str | None = None
    prompt: str | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False

    @model_validator(mode="before")
    @classmethod
    def _body(cls, data):
        _check_body(data)
        _refuse(data, ["continue_final_message", "chat_template", "documents"])
        return data

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of 'prompt' (a text) or 'messages'")
        if self.messages is not None and not self.messages:
            raise ValueError("messages: must not be empty")
        if self.messages is not None and not self.add_generation_prompt:
            raise ValueError("add_generation_prompt: false is not supported (the V4.1 encoding always ends "
                             "with the assistant prefix)")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[StrictInt]

    @model_validator(mode="before")
    @classmethod
    def _body(cls, data):
        _check_body(data)
        return data


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
    tool_calls: list[dict[str, Any]] | None = None     # [{"index", "id", "type", "function": {...}}]


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
    """OpenAI's legacy shape; with echo the prompt comes first, its first token without a logprob
    (``None`` in token_logprobs and top_logprobs)."""
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's prompt_logprobs: one entry per prompt token, {token id: logprob} (None for the first)
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


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
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


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
TokenizeRequest.model_rebuild()
