"""Text completion requests (``/v1/completions``): prompts as text or token ids, scoring."""
from __future__ import annotations

from typing import Annotated

from pydantic import Field, StrictBool, model_validator

from cedlm.server.protocol.common import COMMON_RULES, CommonRequest
from cedlm.server.protocol.checks import Combination, TokenId, bound
from cedlm.server.protocol.params import (
    CHAT_ONLY_REFUSED, COMPLETIONS_ONLY_REFUSED, MAX_CHOICES, MAX_PROMPTS, MAX_TOP_LOGPROBS, REFUSED, refuse,
)

RULES = COMMON_RULES + ["`max_tokens` 0 only with `echo` or `prompt_logprobs`, and then `min_tokens` 0",
                        "`best_of` > `n` not with `echo`", "an empty text prompt needs `add_special_tokens`"]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
# a text, token ids, or a list of either
PromptType = (str | TokenIds | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
              | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)])


class CompletionRequest(CommonRequest):
    prompt: PromptType
    max_tokens: Annotated[int, Field(ge=0, json_schema_extra=bound("context"))] | None = None   # 0: scoring
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: StrictBool = False
    add_special_tokens: StrictBool = True
    return_tokens_as_token_ids: StrictBool = False

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data):
        refuse(data, [k for k in REFUSED if k not in CHAT_ONLY_REFUSED + COMPLETIONS_ONLY_REFUSED] + ["suffix"])
        return data

    @model_validator(mode="after")
    def _zero(self):
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise Combination("max_tokens: 0 is allowed only to score the prompt (with echo=true or prompt_logprobs)")
        if self.max_tokens == 0 and self.min_tokens:
            raise Combination("min_tokens: must be 0 when max_tokens is 0")
        n = len(self.prompts()) * max(self.n, self.best_of or 1)
        if n > MAX_CHOICES:
            raise Combination(f"n: {len(self.prompts())} prompts x {max(self.n, self.best_of or 1)} samples is "
                             f"{n} sequences; at most {MAX_CHOICES} per request")
        if self.echo and self.best_of is not None and self.best_of > self.n:
            raise Combination("best_of: cannot be combined with echo when best_of > n")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per choice group (a text or a token-id list)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)


CompletionRequest.model_rebuild()
