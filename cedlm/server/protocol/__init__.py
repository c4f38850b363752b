"""Pydantic models of the OpenAI request / response shapes the server supports.

A validation error becomes a 400 in the OpenAI error shape (``{"error": {"message", "type",
"param", "code"}}``) naming the field.

Every parameter is either honoured or refused, never silently dropped. ``HONOURED`` (``params``) lists
each request parameter the server declares and what it does (the table of docs/serving.md); parameters
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
shapes, and the body may nest at most ``MAX_DEPTH`` levels (measured on the raw bytes before it is
parsed, and in the JSON texts of string fields: ``json_depth``). Bounded: at most ``MAX_MESSAGES``
messages (or Responses input items), ``MAX_STOP`` stop strings of at most ``MAX_STOP_CHARS``
characters each, ``MAX_STOP_TOKEN_IDS`` stop token ids, ``MAX_CACHE_SALT_CHARS`` characters of cache
salt, ``MAX_N`` choices (``n`` / ``best_of``), ``MAX_PROMPTS`` prompts per completions request,
``MAX_LOGIT_BIAS`` logit_bias entries (each bias compared with [-100, 100] before any conversion).

The package, one concept a module: ``params`` (limits, effort tiers, the honoured / refused
parameter tables), ``checks`` (the typed request values, whose constraints also make
`/openapi.json`, and the checks of free-form ones), ``json_depth`` (the nesting depth of
JSON text, before parsing), ``common`` (the fields both generation endpoints share), ``chat``,
``completions``, ``tokenize`` (requests of each endpoint), ``responses`` (response shapes), ``errors``
(the OpenAI error shape); ``responses_api`` (the Responses API request and its translation to a
chat request; imported from its module). Every public name is re-exported here: import from
``cedlm.server.protocol``.
"""
from __future__ import annotations

from cedlm.server.protocol.chat import ChatCompletionRequest, ChatMessage, ChatTemplateFields
from cedlm.server.protocol.common import CommonRequest, StreamOptions
from cedlm.server.protocol.completions import CompletionRequest, PromptType
from cedlm.server.protocol.errors import ErrorInfo, ErrorResponse
from cedlm.server.protocol.params import (
    CHAT_ONLY_REFUSED, COMPLETIONS_ONLY_REFUSED, DEFAULT_THINKING_EFFORT, EFFORT_TIERS, GUIDED, HONOURED,
    MAX_CACHE_SALT_CHARS, MAX_CHOICES, MAX_DEPTH, MAX_LOGIT_BIAS, MAX_MESSAGES, MAX_N, MAX_PROMPTS, MAX_STOP,
    MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS, REFUSED,
)
from cedlm.server.protocol.responses import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse, ChoiceLogprobs,
    CompletionChoice, CompletionLogprobs, CompletionResponse, CompletionTokensDetails, DeltaMessage, Health,
    ModelCard, ModelList, PromptLogprob, PromptTokensDetails, TokenLogprob, TopLogprob, Usage,
)
from cedlm.server.protocol.tokenize import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse

__all__ = [
    "AssistantMessage", "CHAT_ONLY_REFUSED", "COMPLETIONS_ONLY_REFUSED", "ChatChoice", "ChatChunkChoice",
    "ChatCompletionChunk", "ChatCompletionRequest", "ChatCompletionResponse", "ChatMessage", "ChatTemplateFields",
    "ChoiceLogprobs", "CommonRequest", "CompletionChoice", "CompletionLogprobs", "CompletionRequest",
    "CompletionResponse", "CompletionTokensDetails", "DEFAULT_THINKING_EFFORT", "DeltaMessage",
    "DetokenizeRequest", "DetokenizeResponse", "EFFORT_TIERS", "ErrorInfo", "ErrorResponse", "GUIDED", "HONOURED",
    "Health", "MAX_CACHE_SALT_CHARS", "MAX_CHOICES", "MAX_DEPTH", "MAX_LOGIT_BIAS", "MAX_MESSAGES", "MAX_N",
    "MAX_PROMPTS", "MAX_STOP", "MAX_STOP_CHARS", "MAX_STOP_TOKEN_IDS", "MAX_TOP_LOGPROBS", "ModelCard", "ModelList",
    "PromptLogprob", "PromptTokensDetails", "PromptType", "REFUSED", "StreamOptions", "TokenLogprob",
    "TokenizeRequest", "TokenizeResponse", "TopLogprob", "Usage",
]
