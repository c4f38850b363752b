"""The request parameters the server knows: limits, effort tiers, the table of honoured
parameters (``HONOURED``, the table of docs/serving.md) and of refused ones (``REFUSED``: OpenAI / vLLM
parameters cedlm does not implement, a 400 unless set to their neutral value)."""
from __future__ import annotations

from typing import Any

MAX_STOP = 16                 # stop strings per request
MAX_STOP_CHARS = 256          # characters per stop string
MAX_STOP_TOKEN_IDS = 256      # stop token ids per request
MAX_CACHE_SALT_CHARS = 256

MAX_DEPTH = 100              # nesting of arrays / objects in a request body
MAX_MESSAGES = 4096          # chat messages (or Responses input items) in one request

# Reasoning-effort tiers -> V4.1 integer effort; None = no thinking (chat mode). The names are
# DeepSeek's API tiers, mapped as its API maps them (minimal -> low, medium / xhigh -> high,
# ultra -> max), onto the official V4.1 levels low=50, high=75, max=100
# (cedlm.text.chat.EFFORT_LEVELS; vLLM's V4.1 encoder takes low / high / xhigh / max or 1..100).
EFFORT_TIERS: dict[str, int | None] = {
    "none": None, "minimal": 50, "low": 50, "medium": 75, "high": 75, "xhigh": 75, "max": 100, "ultra": 100,
}
DEFAULT_THINKING_EFFORT = 75   # thinking requested without an effort (cedlm.text.chat.DEFAULT_EFFORT)

MAX_TEMPERATURE = 1e4          # = cedlm.engine.sampling_params.TEMPERATURE_MAX (above it, float32 overflows)
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
# Every request parameter the server declares, and what it does (the parameter table of docs/serving.md).
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
    "include_stop_str_in_output": "vLLM", "stream": "SSE",
    "skip_special_tokens": "vLLM; default true: special tokens (EOS, turn markers) left out of the text",
    "stream_options": "include_usage; continuous_usage_stats (vLLM: usage on every chunk)",
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


def refuse(data: Any, names) -> None:
    if not isinstance(data, dict):
        return
    for k in names:
        if k in data:
            neutral, why = REFUSED[k]
            if not neutral(data[k]):
                raise ValueError(f"{k}: {why}")
