"""vLLM's ``/tokenize`` and ``/detokenize``: requests and responses."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, StrictBool, model_validator

from cedlm.server.protocol.chat import ChatTemplateFields
from cedlm.server.protocol.checks import Combination, TokenId, check_body, check_count
from cedlm.server.protocol.params import refuse

RULES = ["exactly one of `prompt` / `messages`; with `messages`, `add_generation_prompt` true",
         "the tokens within the context (`context_length_exceeded`, known after tokenizing)"]


class TokenizeRequest(ChatTemplateFields):
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
        check_count(data, "messages")
        check_body(data)
        refuse(data, ["continue_final_message", "chat_template", "documents"])
        return data

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise Combination("prompt: give exactly one of 'prompt' (a text) or 'messages'")
        if self.messages is not None and not self.messages:
            raise Combination("messages: must not be empty")
        if self.messages is not None and not self.add_generation_prompt:
            raise Combination("add_generation_prompt: false is not supported (the V4.1 encoding always ends "
                             "with the assistant prefix)")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[TokenId]

    @model_validator(mode="before")
    @classmethod
    def _body(cls, data):
        check_body(data)
        return data


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


TokenizeRequest.model_rebuild()
