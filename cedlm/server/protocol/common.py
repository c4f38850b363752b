"""The fields both generation endpoints (chat and text completions) share: sampling, stop
conditions, choices, structured output, and accepted-without-effect hints."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel, ConfigDict, Field, StrictBool, StringConstraints, WrapValidator, field_validator, model_validator,
)
from pydantic_core import PydanticCustomError, ValidationError

from cedlm.server.protocol.checks import (
    Combination, JsonInt, OutputTokens, Samples, TokenId, bound, check_body, check_logit_bias, check_response_format,
    check_structured,
)
from cedlm.server.protocol.json_depth import check_json_text
from cedlm.server.protocol.params import (
    GUIDED, MAX_CACHE_SALT_CHARS, MAX_TEMPERATURE, MAX_LOGIT_BIAS, MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS,
)

# The rules between fields both endpoints check (a 400 with code `invalid_combination` unless noted;
# each operation's description in /openapi.json lists its own: server/openapi_rules.py)
COMMON_RULES = [
    "`best_of` >= `n`; `best_of` > `n` not with `stream`", "`min_tokens` <= `max_tokens`",
    "at most one of `response_format`, `structured_outputs`, `guided_*`; `ignore_eos` not with any of them",
    "`allowed_token_ids` must allow the output a structured-output constraint requires (`constraint_conflict`)",
    "prompt tokens + `max_tokens` <= the context (`context_length_exceeded`, known after tokenizing)",
    "prompts x max(`n`, `best_of`) within the engine's slots + queue (`request_too_large`)",
]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]
StopTokenId = Annotated[int, Field(ge=0, json_schema_extra=bound("token"))]     # (as pydantic converts: "5" too)


def _bias(v: Any, handler) -> float:
    try:
        return handler(v)
    except ValidationError:         # (the value is not repeated: it may be a number of 4,000 digits)
        raise PydanticCustomError("bias_range", "must be a number in [-100, 100]") from None


# {token id as a string: a bias}; each bias compared with the bounds before any conversion (strict)
LogitBias = Annotated[dict[Annotated[str, Field(json_schema_extra=bound("token_key"))],
                           Annotated[float, Field(strict=True, ge=-100, le=100), WrapValidator(_bias)]],
                      Field(max_length=MAX_LOGIT_BIAS)]


class CommonRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: OutputTokens | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    n: Samples = 1
    best_of: Samples | None = None
    seed: int | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: list[StopTokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    min_tokens: JsonInt = Field(default=0, ge=0)
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True      # vLLM's default: special tokens left out of the text
    stream: StrictBool = False
    stream_options: "StreamOptions | None" = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=100.0)     # (the engine's bounds)
    logit_bias: LogitBias | None = None
    allowed_token_ids: list[TokenId] | None = Field(default=None, min_length=1, max_length=MAX_LOGIT_BIAS)
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # accepted, no effect on generation (as with OpenAI: tracking, routing and tier hints)
    user: str | None = None
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "default"] | None = None      # one tier
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)

    @model_validator(mode="before")
    @classmethod
    def _body(cls, data):
        check_body(data)
        return data

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        return check_logit_bias(v)

    @field_validator("response_format", mode="before")
    @classmethod
    def _response_format(cls, v):
        return check_response_format(v)

    @field_validator("structured_outputs", mode="before")
    @classmethod
    def _structured(cls, v):
        return check_structured(v)

    @model_validator(mode="after")
    def _choices(self):
        if self.best_of is not None:
            if self.best_of < self.n:
                raise Combination(f"best_of: must be >= n ({self.n}), got {self.best_of}")
            if self.stream and self.best_of > self.n:
                raise Combination("best_of: cannot stream when best_of > n (the best are known only at the end)")
        if self.min_tokens and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise Combination(f"min_tokens: must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        given = [k for k in ("response_format", "structured_outputs", *GUIDED) if getattr(self, k) is not None
                 and not (k == "response_format" and self.response_format.get("type") == "text")]
        if len(given) > 1:
            raise Combination(f"{given[1]}: give only one of response_format, structured_outputs, guided_* "
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
                check_json_text(v, "structured_outputs.json")
                try:
                    v = json.loads(v)
                except (ValueError, RecursionError):
                    raise ValueError("structured_outputs.json: not valid JSON") from None
            return "structured_outputs", kind, v
        for k, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
            v = getattr(self, k)
            if v is not None:
                if kind == "json_schema" and isinstance(v, str):
                    check_json_text(v, k)
                    try:
                        v = json.loads(v)
                    except (ValueError, RecursionError):
                        raise ValueError(f"{k}: not valid JSON") from None
                return k, kind, v
        return None


class StreamOptions(BaseModel):
    """include_usage: a last chunk with the usage and no choices; continuous_usage_stats (vLLM's
    extension, sent by guidellm): every chunk also carries the usage so far."""
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False

    @property
    def continuous(self) -> bool:
        """Usage on every chunk (honoured with or without include_usage, never ignored)."""
        return self.continuous_usage_stats


CommonRequest.model_rebuild()
