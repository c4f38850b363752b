"""The validators' rules written into `/openapi.json`: what JSON schema can say
about a request body is said there, so that a request valid under the published schema is one the
server accepts (schemathesis' `positive_data_acceptance`, tests/test_schemathesis.py).

`refine(schema, bounds)` patches the schemas FastAPI generated from the pydantic models of
server/protocol: bounds the validators check (non-empty lists, the effort values, the shapes of
`thinking`, `chat_template_kwargs`, `logit_bias`, `tool_choice`, ...), the run-time bounds of the
loaded model and engine (`RuntimeBounds`: token ids below the vocabulary, `max_tokens` within
`max_model_len`, `n` / `best_of` within the sample cap), and, in each operation's description,
the rules between fields JSON schema cannot state. A request broken only by such a rule gets a
400 with code `invalid_combination` (the validators raise `protocol.checks.Combination`), or
`context_length_exceeded` / `request_too_large` (a prompt + max_tokens beyond the context or a
request beyond the queue: known only after tokenizing), or `constraint_conflict`
(`allowed_token_ids` against a structured-output constraint: known only after compiling it).

Free-form values (JSON schemas, regexes and grammars of structured output, tools, content
parts, tool calls) are published as the subset whose every value the server accepts: the
schema names the shape, the description says what more the server takes.
"""
from __future__ import annotations

from dataclasses import dataclass

from cedlm.server.auth import OPEN_PATHS
from cedlm.server.protocol.params import (
    EFFORT_TIERS, MAX_CACHE_SALT_CHARS, MAX_LOGIT_BIAS, MAX_PROMPTS, MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS,
)

RUNTIME_CODES = ("invalid_combination", "context_length_exceeded", "request_too_large", "constraint_conflict")

_COMMON_RULES = [
    "`best_of` >= `n`; `best_of` > `n` not with `stream`",
    "`min_tokens` <= `max_tokens`",
    "at most one of `response_format`, `structured_outputs`, `guided_*`; `ignore_eos` not with any of them",
    "`allowed_token_ids` must allow the output a structured-output constraint requires (`constraint_conflict`)",
    "prompt tokens + `max_tokens` <= the context (`context_length_exceeded`, known after tokenizing)",
    "prompts x max(`n`, `best_of`) within the engine's slots + queue (`request_too_large`)",
]
RULES = {
    "/v1/completions": _COMMON_RULES + [
        "`max_tokens` 0 only with `echo` or `prompt_logprobs`, and then `min_tokens` 0",
        "`best_of` > `n` not with `echo`",
    ],
    "/v1/chat/completions": _COMMON_RULES + [
        "`tool_choice` other than none / auto needs `tools`, names one of them, and not with structured output",
        "`top_logprobs` needs `logprobs: true`",
    ],
    "/tokenize": ["exactly one of `prompt` / `messages`; with `messages`, `add_generation_prompt` true",
                  "the tokens within the context (`context_length_exceeded`, known after tokenizing)"],
}


@dataclass(frozen=True)
class RuntimeBounds:
    """The bounds known once the model and engine are loaded."""
    vocab_size: int
    max_model_len: int
    max_samples: int


def _nullable(s: dict) -> dict:
    return {"anyOf": [s, {"type": "null"}], "default": None}


def _token_id(b: RuntimeBounds) -> dict:
    return {"type": "integer", "minimum": 0, "maximum": b.vocab_size - 1}


_TEXT = {"type": "string", "minLength": 1, "maxLength": 4096, "pattern": r"^[^\x00]*$"}
_EFFORT = {"anyOf": [{"enum": list(EFFORT_TIERS)}, {"type": "integer", "minimum": 1, "maximum": 100},
                     {"type": "null"}], "default": None}
_THINKING = {"anyOf": [{"type": "boolean"}, {"type": "null"},
                       {"type": "object", "properties": {"type": {"enum": ["enabled", "disabled"]}},
                        "required": ["type"], "additionalProperties": False}], "default": None}
_TEMPLATE_KWARGS = _nullable({"type": "object", "additionalProperties": False, "properties": {
    "thinking": {"type": ["boolean", "null"]}, "enable_thinking": {"type": ["boolean", "null"]},
    "drop_thinking": {"type": ["boolean", "null"]},
    "reasoning_effort": {"anyOf": [{"enum": list(EFFORT_TIERS)}, {"type": "integer", "minimum": 1, "maximum": 100}]},
}})


def _ids_below(vocab_size: int) -> str:
    """A pattern of decimal token ids all below vocab_size (those of fewer digits than its
    largest id: a subset, exact up to the leading digit)."""
    d = len(str(vocab_size - 1))
    return r"^[0-9]$" if d <= 1 else rf"^(0|[1-9][0-9]{{0,{d - 2}}})$"


def _common(p: dict, b: RuntimeBounds) -> None:
    """The fields both generation endpoints share (protocol/common.py)."""
    # (completions also takes 0 to score a prompt: with echo or prompt_logprobs, a rule between fields)
    p["max_tokens"] = _nullable({"type": "integer", "minimum": 1, "maximum": b.max_model_len - 1})
    for k in ("n", "best_of"):
        p[k] = {**p[k], "maximum": b.max_samples} if "anyOf" not in p[k] else \
            _nullable({"type": "integer", "minimum": 1, "maximum": b.max_samples})
    p["stop"] = {"anyOf": [{"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                           {"type": "array", "maxItems": MAX_STOP,
                            "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}},
                           {"type": "null"}], "default": None}
    p["stop_token_ids"] = _nullable({"type": "array", "maxItems": MAX_STOP_TOKEN_IDS, "items": _token_id(b)})
    p["allowed_token_ids"] = _nullable({"type": "array", "minItems": 1, "maxItems": MAX_LOGIT_BIAS,
                                        "items": _token_id(b)})
    p["logit_bias"] = _nullable({"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                                 "propertyNames": {"pattern": _ids_below(b.vocab_size)},
                                 "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}})
    p["repetition_penalty"] = _nullable({"type": "number", "minimum": 0.01, "maximum": 100})
    p["service_tier"] = _nullable({"enum": ["auto", "default"]})
    p["cache_salt"] = _nullable({"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT_CHARS})
    # structured output: the choice list is published; JSON schemas, regexes and grammars are
    # free text the compiler judges (a 400 naming the field when it cannot compile them)
    p["guided_choice"] = _nullable({"type": "array", "minItems": 1, "maxItems": 64, "items": _TEXT})
    p["response_format"] = _nullable({"type": "object", "additionalProperties": False, "required": ["type"],
                                      "properties": {"type": {"enum": ["text", "json_object"]}}})
    for k in ("structured_outputs", "guided_json", "guided_regex", "guided_grammar"):
        p[k] = {"type": "null", "default": None,
                "description": "free text judged by the grammar compiler (see the operation's description)"}


def _message() -> dict:
    """A chat message as published: a system / user / assistant / developer text (the server
    also takes tool messages, content parts, tool calls and reasoning; see the description)."""
    return {"type": "object", "required": ["role", "content"], "additionalProperties": False, "properties": {
        "role": {"enum": ["system", "user", "assistant", "developer"]},
        "content": {"type": "string", "minLength": 1, "maxLength": 4096},
    }}


def _chat_fields(p: dict, b: RuntimeBounds, comps: dict) -> None:
    p["reasoning_effort"] = _EFFORT
    p["cedlm_reasoning_effort"] = _nullable({"type": "integer", "minimum": 1, "maximum": 100})
    p["thinking"] = _THINKING
    p["chat_template_kwargs"] = _TEMPLATE_KWARGS
    p["tools"] = {"type": "null", "default": None, "description": "function tools (see the description)"}
    comps["ChatMessage"] = _message()


def refine(schema: dict, b: RuntimeBounds) -> None:
    """Patch `schema` (FastAPI's OpenAPI dict) in place with the validators' rules and `b`."""
    comps = schema.get("components", {}).get("schemas", {})
    if "CompletionRequest" in comps:
        p = comps["CompletionRequest"]["properties"]
        _common(p, b)
        ids = {"type": "array", "minItems": 1, "maxItems": b.max_model_len, "items": _token_id(b)}
        p["prompt"] = {"anyOf": [{"type": "string", "minLength": 1, "maxLength": 4096}, ids,
                                 {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS,
                                  "items": {"type": "string", "minLength": 1, "maxLength": 4096}},
                                 {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": ids}]}
    if "ChatCompletionRequest" in comps:
        p = comps["ChatCompletionRequest"]["properties"]
        _common(p, b)
        _chat_fields(p, b, comps)
        p["max_completion_tokens"] = _nullable({"type": "integer", "minimum": 1, "maximum": b.max_model_len - 1})
        p["tool_choice"] = _nullable({"enum": ["none", "auto"]})
    if "TokenizeRequest" in comps:
        t = comps["TokenizeRequest"]
        _chat_fields(t["properties"], b, comps)
        t["properties"]["messages"] = _nullable({"type": "array", "minItems": 1, "items": _message()})
        t["oneOf"] = [{"required": ["prompt"], "properties": {"prompt": {"type": "string"},
                                                              "messages": {"type": "null"}}},
                      {"required": ["messages"], "properties": {"messages": {"type": "array"},
                                                                "prompt": {"type": "null"},
                                                                "add_generation_prompt": {"const": True},
                                                                "add_special_tokens": {"enum": [False, None]}}}]
    if "DetokenizeRequest" in comps:
        comps["DetokenizeRequest"]["properties"]["tokens"] = {"type": "array", "items": _token_id(b)}
    unauthorized = {"description": "Missing or incorrect API key (with --api-key; /metrics unless "
                                   "--metrics-public)",
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    for path, ops in schema.get("paths", {}).items():
        if path not in OPEN_PATHS:
            for op in ops.values():
                op.setdefault("responses", {}).setdefault("401", unauthorized)
    for path, rules in RULES.items():
        op = schema.get("paths", {}).get(path, {}).get("post")
        if op is not None:
            op["description"] = (op.get("description") or "").rstrip() + (
                "\n\nRules between fields (JSON schema cannot state them; a 400 with code "
                "`invalid_combination` unless noted):\n" + "".join(f"\n- {r}" for r in rules)
                + "\n\nThe schema publishes a subset of the free-form values (structured output, tools, "
                "content parts, tool calls): the server accepts more, as the README describes.")
