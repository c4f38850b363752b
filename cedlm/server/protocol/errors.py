"""The OpenAI error shape: ``{"error": {"message", "type", "param", "code"}}``."""
from __future__ import annotations

from pydantic import BaseModel


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
