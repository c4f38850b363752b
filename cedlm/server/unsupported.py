"""Clear answers for the OpenAI routes cedlm does not serve, and the routes that say what it is.

Clients probe more of the OpenAI API than cedlm implements (the openai SDK, LangChain, litellm and
node reach `/v1/embeddings`; `/v1/responses/{id}` for stored responses, which cedlm does not keep). Instead of a bare `404 Not Found`, each
such route answers `404` in the OpenAI error shape (type `not_found_error`, code
`unsupported_endpoint`) with a message saying what it is, that cedlm does not serve it, and what it
serves (`SERVED`): a 404, as OpenAI answers a route it does not have, so clients that probe a route
(and retry or fall back on 404) treat it as absent, never as a server fault (a 5xx). Any other
unknown path is a 404 saying what cedlm serves (`not_found_message`, used by errors.py's 404
handler).

`GET /version` answers `{"version": ...}` (vLLM's shape), as `cedlm --version` prints it.
These routes are left out of the OpenAPI schema except /version.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel

from cedlm import __version__
from cedlm.server.errors import APIError

__all__ = ["SERVED", "UNSUPPORTED", "not_found_message", "unsupported_router", "version_router"]

SERVED = ("POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, GET /v1/models, POST /tokenize, "
          "POST /detokenize, GET /health, GET /metrics, GET /version, and the chat page at GET /")

_GENERATIVE = "cedlm serves one generative language model"
# path (a prefix when it ends with "/") -> what it is and why cedlm does not serve it
UNSUPPORTED: dict[str, str] = {
    "/v1/embeddings": f"embeddings: {_GENERATIVE}, not an embedding model, so it has no embedding output",
    "/v1/responses/": "responses are not stored, so they cannot be retrieved, cancelled or deleted "
                      "(POST /v1/responses answers them whole or streamed)",
    "/v1/moderations": f"moderations: {_GENERATIVE}, not a moderation classifier",
    "/v1/audio/": f"audio: {_GENERATIVE} with text (and image) input only",
    "/v1/images/": f"image generation: {_GENERATIVE}; images are accepted as input on /v1/chat/completions",
    "/v1/files": "files: cedlm keeps no files",
    "/v1/files/": "files: cedlm keeps no files",
    "/v1/batches": "the Batch API is not implemented; send the requests concurrently instead",
    "/v1/batches/": "the Batch API is not implemented; send the requests concurrently instead",
    "/v1/fine_tuning/": "fine-tuning over HTTP is not offered (see `cedlm train`)",
    "/v1/assistants": "the Assistants API is not implemented",
    "/v1/assistants/": "the Assistants API is not implemented",
    "/v1/threads": "the Assistants API (threads) is not implemented",
    "/v1/threads/": "the Assistants API (threads) is not implemented",
    "/v1/vector_stores": "vector stores are not implemented",
    "/v1/vector_stores/": "vector stores are not implemented",
    "/v1/realtime": "the Realtime API is not implemented",
    "/v1/rerank": f"reranking: {_GENERATIVE}, not a reranker",
    "/v1/score": f"scoring pairs: {_GENERATIVE}, not a cross-encoder (prompt log-probabilities: "
                 f"/v1/completions with echo and logprobs)",
    "/v1/chat/completions/": "stored chat completions are not kept",
}


def unsupported_message(method: str, path: str) -> str | None:
    """The 404 message of an unsupported route, or None when `path` is not one."""
    why = UNSUPPORTED.get(path)
    if why is None:
        why = next((w for p, w in UNSUPPORTED.items() if p.endswith("/") and path.startswith(p)), None)
    if why is None:
        return None
    return f"{method} {path} is not served by cedlm: {why}. cedlm serves {SERVED}."


def not_found_message(method: str, path: str) -> str:
    """The 404 message of an unknown path."""
    return f"{method} {path}: not found. cedlm serves {SERVED}."


unsupported_router = APIRouter()
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


async def unsupported(request: Request):
    """404 naming what the route is and what cedlm serves instead."""
    raise APIError(404, unsupported_message(request.method, request.url.path) or "not served by cedlm",
                   type="not_found_error", code="unsupported_endpoint")


for _path in UNSUPPORTED:                      # a prefix ("/v1/audio/") covers everything under it
    unsupported_router.add_api_route(_path + "{rest:path}" if _path.endswith("/") else _path, unsupported,
                                     methods=_METHODS, include_in_schema=False)


class Version(BaseModel):
    version: str


version_router = APIRouter()


@version_router.get("/version", response_model=Version)
async def version():
    """The cedlm package version (as `cedlm --version` prints it)."""
    return Version(version=__version__)
