"""Reading HTTP request bodies safely, for every route: a size limit (413), JSON that must be
an object, and text that must be valid Unicode (JSON escapes can smuggle in lone surrogates,
which no tokenizer or encoder accepts); each refusal is a 4xx JSON error naming what is wrong."""

from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: str | None = None, kind: str | None = None) -> JSONResponse:
    kind = kind or {401: "authentication_error", 404: "not_found_error", 413: "request_too_large",
                    503: "server_overloaded"}.get(status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


class BodyLimit:
    """ASGI middleware: a body over `limit` bytes is refused with 413, by its Content-Length
    before any of it is read, or as it streams in (chunked bodies)."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = error_response(413, f"the request body is larger than {self.limit} bytes (--max-request-bytes)")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await too_large(scope, receive, send)
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # (the app's HTTPException handler answers it)
                    raise HTTPException(413, f"the request body is larger than {self.limit} bytes "
                                             "(--max-request-bytes)")
            return message

        await self.app(scope, counting_receive, send)


async def read_json_object(request: Request) -> dict:
    """The body as a JSON object; BodyError (400) when it is not one or holds invalid text."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BodyError(400, f"malformed JSON body: {e}") from None
    except RecursionError:
        raise BodyError(400, "malformed JSON body: nested too deeply") from None
    if not isinstance(body, dict):
        raise BodyError(400, "the body must be a JSON object")
    bad = invalid_text_path(body)
    if bad is not None:
        raise BodyError(400, f"'{bad}' is not valid Unicode text (a lone surrogate)", bad)
    return body


def invalid_text_path(value: Any, path: str = "") -> str | None:
    """The path (e.g. `messages[0].content`) of the first string, key or value, that cannot be
    encoded as UTF-8; None when there is none."""
    stack = [(value, path)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                here = f"{path}.{key}" if path else str(key)
                try:
                    key.encode()
                except UnicodeEncodeError:
                    return path or "body"
                stack.append((item, here))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))
    return None
