"""What a refused request gets back: `ApiError`, and OpenAI's error body for it.

Every refusal names the field it is about (`param`), so a client can tell what to change; the body
is OpenAI's `{"error": {"message", "type", "param", "code"}}` (docs/server.md, "Errors").
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import Response
from pydantic import ValidationError

from ..inputs.model_inputs import MediaError
from .media.policy import PartError


class ApiError(Exception):
    """A request the server refuses; becomes an OpenAI-style error body."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, kind: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {429: "rate_limit_error", 404: "not_found_error"}.get(status, "invalid_request_error")
        if status >= 500:
            self.kind = "server_error"


def json_response(body: Any, status: int = 200) -> Response:
    """`body` as JSON; ASCII only, as error messages may quote client strings holding lone surrogates."""
    return Response(json.dumps(body, ensure_ascii=True), status_code=status, media_type="application/json")


def error_body(err: ApiError) -> dict:
    return {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}}


def error_response(err: ApiError) -> Response:
    return json_response(error_body(err), err.status)


def excerpt(value: Any, limit: int = 60) -> str:
    """`value`'s repr, cut to `limit` characters: how a message quotes what a client sent."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validation_error(e: ValidationError) -> ApiError:
    """pydantic's first complaint about a request body as a 400 naming the field."""
    err = e.errors(include_url=False)[0]
    param = _loc(err["loc"])
    if err["type"] == "extra_forbidden":
        return ApiError(400, f"unknown field '{param}'", param, "unknown_parameter")
    if err["type"] == "missing":
        return ApiError(400, f"missing required field '{param}'", param, "missing_required_parameter")
    return ApiError(400, f"{param}: {err['msg']} (got {excerpt(err.get('input'))})", param, "invalid_value")


def media_error(e: MediaError) -> ApiError:
    """A media problem as a 400 naming the content part it came from (or the messages, when the
    processor cannot tell which)."""
    param = e.param if isinstance(e, PartError) else "messages"
    message = str(e) if isinstance(e, PartError) else f"messages: {e}"
    return ApiError(400, message, param, "invalid_media")
