"""What the request types (server/protocol) cannot say, written into `/openapi.json` so that a
request valid under the published schema is one the server accepts (tests/test_schemathesis.py):
the bounds of the loaded model (the types' `x-bound` marks: protocol/checks.py), the subset of each
free-form value (messages, tools, structured output) whose every value is accepted, and each
operation's rules between fields (`RULES` of its protocol module; a breach: a 400, `RUNTIME_CODES`)."""
from __future__ import annotations

from dataclasses import dataclass

from cedlm.server.protocol import chat, completions, tokenize

RUNTIME_CODES = ("invalid_combination", "context_length_exceeded", "request_too_large", "constraint_conflict")
RULES = {"/v1/completions": completions.RULES, "/v1/chat/completions": chat.RULES, "/tokenize": tokenize.RULES}
_FREE = {"type": "null", "default": None, "description": "free-form: see the operation's description"}
_TEXT = {"type": "string", "minLength": 1, "maxLength": 4096, "pattern": r"^[^\x00]*$"}
PUBLISHED = {"tools": _FREE, "structured_outputs": _FREE, "guided_json": _FREE, "guided_regex": _FREE,
             "guided_grammar": _FREE, "guided_choice": {"anyOf": [
                 {"type": "array", "minItems": 1, "maxItems": 64, "items": _TEXT}, {"type": "null"}]},
             "response_format": {"anyOf": [{"type": "object", "required": ["type"], "properties": {
                 "type": {"enum": ["text", "json_object"]}}, "additionalProperties": False}, {"type": "null"}]}}
MESSAGE = {"type": "object", "required": ["role", "content"], "additionalProperties": False, "properties": {
    "role": {"enum": ["system", "user", "assistant", "developer"]}, "content": _TEXT}}     # a text message
TOKENIZE = [{"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}},
            {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"},
             "add_generation_prompt": {"const": True}, "add_special_tokens": {"enum": [False, None]}}}]


@dataclass(frozen=True)
class RuntimeBounds:
    vocab_size: int
    max_model_len: int
    max_samples: int

    def write(self, node) -> None:
        """Replace each `x-bound` mark in `node` with its bound (token_key: the ids of fewer digits)."""
        if isinstance(node, dict) and "x-bound" in node:
            d = len(str(self.vocab_size - 1))
            key = r"^[0-9]$" if d <= 1 else rf"^(0|[1-9][0-9]{{0,{d - 2}}})$"
            node.update({"token": {"maximum": self.vocab_size - 1}, "context": {"maximum": self.max_model_len - 1},
                         "samples": {"maximum": self.max_samples}, "token_key": {"pattern": key}}[node.pop("x-bound")])
        for v in node.values() if isinstance(node, dict) else node if isinstance(node, list) else ():
            self.write(v)


def refine(schema: dict, b: RuntimeBounds) -> None:
    """Patch `schema` (FastAPI's OpenAPI dict) in place."""
    b.write(schema)
    comps = schema.get("components", {}).get("schemas", {})
    for name in ("ChatCompletionRequest", "CompletionRequest", "TokenizeRequest"):
        p = comps.get(name, {}).get("properties", {})
        p.update({k: v for k, v in PUBLISHED.items() if k in p})
    comps.get("TokenizeRequest", {})["oneOf"] = TOKENIZE
    comps["ChatMessage"] = MESSAGE
    for path, rules in RULES.items():
        if (op := schema.get("paths", {}).get(path, {}).get("post")) is not None:
            op["description"] = (op.get("description") or "").rstrip() + "\n\nRules between fields (a 400 with code " \
                "`invalid_combination` unless noted):\n" + "".join(f"\n- {r}" for r in rules) + "\n\nThe schema " \
                "publishes a subset of the free-form values (structured output, tools, content parts, tool calls)."
