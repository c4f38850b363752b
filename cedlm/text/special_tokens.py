"""The special-token table: every control token string cedlm's tokenizers and chat encoder use.

One place: the tokenizer registers `SPECIAL_TOKENS` (in this order, so their ids are stable in
the shipped vocabularies) and the chat encoder builds prompts from the same constants.
"""
from __future__ import annotations

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM = "<｜System｜>"
THINK_START = "<think>"
THINK_END = "</think>"
LATEST_REMINDER = "<｜latest_reminder｜>"
IMAGE_TOKEN = "<｜deepseek_image｜>"
DSPARK_NOISE = "<｜dspark_noise｜>"
# Task tokens of the V4.1 chat encoding (search/browse tasks), by task name.
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}
# Tool-call markup of the chat encoding; an added token in the official vocabulary.
DSML = "｜DSML｜"

SPECIAL_TOKENS: list[str] = [BOS, EOS, PAD, USER, ASSISTANT, SYSTEM, THINK_START, THINK_END,
                             LATEST_REMINDER, *TASK_TOKENS.values(), IMAGE_TOKEN, DSPARK_NOISE]
KEEP_ON_SKIP = {THINK_START, THINK_END}          # not skipped by decode(skip_special=True)
