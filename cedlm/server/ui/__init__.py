"""The browser chat page: `index.html` (one static file: HTML, CSS and JS, no build step, nothing
fetched from elsewhere), served at GET / by `cedlm serve`. It streams /v1/chat/completions with
the reasoning shown apart, and has max_tokens, temperature, reasoning-effort, image and API-key
inputs. The page itself needs no API key (it is the same for everyone); its requests send the one
typed into it."""
from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

__all__ = ["page", "ui_router"]

ui_router = APIRouter()


def page() -> str:
    """The page's HTML (shipped as package data: cedlm/server/ui/index.html)."""
    return files(__name__).joinpath("index.html").read_text(encoding="utf-8")


@ui_router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def index():
    return HTMLResponse(page(), headers={"cache-control": "no-cache"})
