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
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

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
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: "StreamOptions | None" = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    user: str | None = None

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
    include_usage: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer", "latest_reminder"]
    content: str | list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    reasoning_effort: Any = None
    cedlm_reasoning_effort: Any = None
    thinking: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None

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
            if want is None and k in kw:
                want = bool(kw[k])
        return (True, DEFAULT_THINKING_EFFORT) if want else (False, None)


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
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
