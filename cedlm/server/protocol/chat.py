"""Chat requests: messages, the fields that decide the chat prompt (thinking, effort, tools;
shared with /tokenize), and ``ChatCompletionRequest``."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, field_validator, model_validator

from cedlm.server.protocol.checks import (
    Combination, Effort, EffortLevel, OutputTokens, check_count, check_parts, check_tool_call, type_name,
)
from cedlm.server.protocol.common import COMMON_RULES, CommonRequest
from cedlm.server.protocol.params import DEFAULT_THINKING_EFFORT, EFFORT_TIERS, MAX_TOP_LOGPROBS, REFUSED, refuse
from cedlm.server.tools import check_tools
from cedlm.server.tools import names as tool_names

RULES = COMMON_RULES + ["`tool_choice` other than none / auto needs `tools`, names one of them, and not "
                        "with structured output", "`top_logprobs` needs `logprobs: true`"]


def _tools(v: Any) -> Any:
    check_tools(v, "tools")
    return v


Tools = Annotated[list[dict[str, Any]], BeforeValidator(_tools)]     # function tools (tools.py: check_tools)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer", "latest_reminder"]
    content: str | list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    tools: Tools | None = None                      # on a system / developer message
    task: str | None = None                         # on a user message (cedlm.text.chat.TASK_TOKENS)
    wo_eos: StrictBool | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v):
        if v is not None and not isinstance(v, str):
            check_parts(v, "content")
        return v

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _tool_calls(cls, v):
        if v is not None:
            if not isinstance(v, list):
                raise ValueError(f"tool_calls: must be an array of tool calls, got {type_name(v)}")
            for i, tc in enumerate(v):
                check_tool_call(tc, f"tool_calls[{i}]")
        return v


class ThinkingSwitch(BaseModel):
    """DeepSeek's ``thinking``: ``{"type": "enabled" | "disabled"}`` (the effort is set with
    ``reasoning_effort``)."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["enabled", "disabled"]


class TemplateKwargs(BaseModel):
    """vLLM's ``chat_template_kwargs``, as far as the V4.1 encoding has them."""
    model_config = ConfigDict(extra="forbid")
    thinking: StrictBool | None = None
    enable_thinking: StrictBool | None = None
    drop_thinking: StrictBool | None = None
    reasoning_effort: Effort | None = None


class ChatTemplateFields(BaseModel):
    """The fields that decide the chat prompt (shared by chat completions and /tokenize)."""
    model_config = ConfigDict(extra="allow")

    messages: list[ChatMessage] | None = None
    reasoning_effort: Effort | None = None
    cedlm_reasoning_effort: EffortLevel | None = None
    thinking: StrictBool | ThinkingSwitch | None = None
    chat_template_kwargs: TemplateKwargs | None = None
    tools: Tools | None = None

    @property
    def drop_thinking(self) -> bool:
        v = self.chat_template_kwargs.drop_thinking if self.chat_template_kwargs else None
        return True if v is None else v

    def resolve_thinking(self) -> tuple[bool, int | None]:
        """(thinking mode?, V4.1 effort 1..100 or None in chat mode).

        Precedence: cedlm_reasoning_effort; reasoning_effort (``"none"`` = chat mode); an explicit
        thinking switch (``thinking`` / ``chat_template_kwargs``), with the effort from
        ``chat_template_kwargs.reasoning_effort`` or the default (high)."""
        if self.cedlm_reasoning_effort is not None:
            return True, self.cedlm_reasoning_effort
        kw = self.chat_template_kwargs or TemplateKwargs()
        switch = self.thinking.type == "enabled" if isinstance(self.thinking, ThinkingSwitch) else self.thinking
        for v in (kw.thinking, kw.enable_thinking):
            if switch is None and v is not None:
                switch = v
        e = self.reasoning_effort if self.reasoning_effort is not None else kw.reasoning_effort
        if e is not None:
            e = EFFORT_TIERS[e] if isinstance(e, str) else e
            if e is None or switch is False:        # "none", or thinking explicitly disabled
                return False, None
            return True, e
        return (True, DEFAULT_THINKING_EFFORT) if switch else (False, None)


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: the output is a call of that tool."""
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(CommonRequest, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: OutputTokens | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data):
        check_count(data, "messages")            # first: before anything walks the messages
        refuse(data, [k for k in REFUSED if k not in ("suffix",)])
        return data

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v):
        return v.model_dump() if isinstance(v, NamedToolChoice) else v      # read as OpenAI's dict

    @model_validator(mode="after")
    def _tool_rules(self):
        tc = self.tool_choice
        if tc not in (None, "none", "auto") and not self.tools:
            raise Combination("tool_choice: requires 'tools'")
        if isinstance(tc, dict):
            want = tc["function"]["name"]
            if want not in tool_names(self.tools):
                raise Combination(f"tool_choice.function.name: {want!r} is not one of the tools "
                                 f"({', '.join(tool_names(self.tools))})")
        if tc not in (None, "none", "auto") and self.guided() is not None:
            raise Combination(f"tool_choice: {tc if isinstance(tc, str) else 'a named function'} cannot be "
                             f"combined with response_format / structured outputs")
        if self.top_logprobs and not self.logprobs:
            raise Combination("top_logprobs: requires logprobs=true")
        return self

    def forced_tools(self) -> bool:
        """tool_choice is "required" or a named function (the output is constrained to a call)."""
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, dict))


ChatCompletionRequest.model_rebuild()
