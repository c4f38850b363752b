"""Chat requests: messages, the fields that decide the chat prompt (thinking, effort, tools;
shared with /tokenize), and ``ChatCompletionRequest``."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from cedlm.server.protocol.checks import (
    Combination, check_count, check_parts, check_tool_call, effort_value, type_name,
)
from cedlm.server.protocol.common import CommonRequest
from cedlm.server.protocol.params import DEFAULT_THINKING_EFFORT, EFFORT_TIERS, MAX_TOP_LOGPROBS, REFUSED, refuse
from cedlm.server.tools import check_tool_choice, check_tools
from cedlm.server.tools import names as tool_names


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

    @field_validator("tools", mode="before")
    @classmethod
    def _tools(cls, v):
        if v is not None:
            check_tools(v, "tools")
        return v


class ChatTemplateFields(BaseModel):
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
            check_tools(v, "tools")
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
        raise ValueError(f"thinking: must be {{\"type\": \"enabled\"|\"disabled\"}} or a boolean, got {type_name(v)}")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v):
        for k in ("thinking", "enable_thinking", "drop_thinking"):
            if v and k in v and v[k] is not None and not isinstance(v[k], bool):
                raise ValueError(f"chat_template_kwargs.{k}: must be a boolean, got {type_name(v[k])}")
        known = {"thinking", "enable_thinking", "reasoning_effort", "drop_thinking"}
        for k in v or {}:
            if k not in known:
                raise ValueError(f"chat_template_kwargs.{k}: not supported (known: {', '.join(sorted(known))})")
        if v and v.get("reasoning_effort") is not None:
            v["reasoning_effort"] = effort_value(v["reasoning_effort"], "chat_template_kwargs.reasoning_effort",
                                                 allow_tiers=True)
        return v

    @field_validator("reasoning_effort")
    @classmethod
    def _effort(cls, v):
        return effort_value(v, "reasoning_effort", allow_tiers=True)

    @field_validator("cedlm_reasoning_effort")
    @classmethod
    def _cedlm_effort(cls, v):
        return effort_value(v, "cedlm_reasoning_effort", allow_tiers=False)

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


class ChatCompletionRequest(CommonRequest, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data):
        check_count(data, "messages")            # first: before anything walks the messages
        refuse(data, [k for k in REFUSED if k not in ("suffix",)])
        return data

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, v):
        return check_tool_choice(v)

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
