"""HTTP routes of the native API: POST /generate (JSON, or SSE when "stream": true),
GET /health, GET /get_server_info, and the app around every route: API key, body size limit,
errors as JSON."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from tokenizer_proc.api_schema import ABORT, GENERATE, request_body
from tokenizer_proc.manager import RequestError, TokenizerManager, UnavailableError
from tokenizer_proc.openai_api import OpenAIServing, build_router, sse_data
from tokenizer_proc.request_body import BodyError, BodyLimit, error_response, read_json_object

MAX_BATCH = 4096  # prompts in one /generate request (and choices in one OpenAI request)


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return error_response(status, message, param)


async def _json_object(request: Request) -> dict | JSONResponse:
    """The body as a JSON object, or the 4xx response to send instead."""
    try:
        return await read_json_object(request)
    except BodyError as e:
        return _error(e.status, e.message, e.param)


def _key_matches(given: str, api_key: str) -> bool:
    """Constant time: both sides are hashed first, so neither the key's length nor how much of it
    matches shows in the time taken."""
    digest = lambda s: hashlib.sha256(s.encode("utf-8", "surrogateescape")).digest()  # noqa: E731
    return hmac.compare_digest(digest(given), digest(f"Bearer {api_key}"))


class ApiKeyGuard:
    """ASGI middleware: every route but /health needs `Authorization: Bearer <key>` (a plain
    ASGI class: it passes the request through untouched, streams and body errors included)."""

    def __init__(self, app, api_key: str):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if not _key_matches(given, self.api_key):
                response = _error(401, "missing or wrong API key (Authorization: Bearer ...)")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def _prompts(body: dict) -> tuple[list[tuple[str | None, list | None]], bool]:
    """(text, input_ids) per prompt of a /generate body, and whether it is a batch."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list):
        if not all(isinstance(t, str) for t in text):
            raise RequestError("text must be a string or a list of strings")
        return [(t, None) for t in text], True
    if isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list):
        if not all(isinstance(i, list) for i in input_ids):
            raise RequestError("input_ids must be a list of token ids or a list of such lists")
        return [(None, i) for i in input_ids], True
    return [(text, input_ids)], False


def _logprob_fields(body: dict) -> tuple[Any, int]:
    """The sampling parameters with SGLang's return_logprob / top_logprobs_num / logprob_start_len
    folded in, and where the prompt's logprobs start (-1: none)."""
    sampling = body.get("sampling_params")
    fields = {name: body.get(name) for name in ("return_logprob", "top_logprobs_num", "logprob_start_len")}
    for name, kind in (("return_logprob", bool), ("top_logprobs_num", int), ("logprob_start_len", int)):
        if fields[name] is not None and (type(fields[name]) is not kind):
            raise RequestError(f"{name} must be {'a boolean' if kind is bool else 'an integer'}")
    if not fields["return_logprob"]:
        return sampling, -1
    if sampling is not None and not isinstance(sampling, dict):
        return sampling, -1  # (refused as it is by the sampling checks)
    top = fields["top_logprobs_num"] or 0
    start = -1 if fields["logprob_start_len"] is None else fields["logprob_start_len"]
    sampling = {**(sampling or {}), "logprobs": True, "top_logprobs": top}
    if start >= 0:
        sampling["prompt_logprobs"] = top
    return sampling, start


def _from_logprob_start(out: dict, start: int) -> dict:
    """SGLang's input logprobs begin at logprob_start_len."""
    meta = out["meta_info"]
    if start > 0 and "input_token_logprobs" in meta:
        meta["input_token_logprobs"] = meta["input_token_logprobs"][start:]
        meta["input_top_logprobs"] = meta["input_top_logprobs"][start:]
    return out


def build_app(manager: TokenizerManager, server_info: dict[str, Any], model_name: str,
              api_key: str | None = None, max_request_bytes: int = 32 * 1024 * 1024,
              tool_call_parser: str = "auto", reasoning_parser: str | None = None,
              sampling_defaults: dict | None = None) -> FastAPI:
    app = FastAPI(title="loom")
    app.include_router(build_router(OpenAIServing(manager, model_name, manager.context_len, tool_call_parser,
                                                  reasoning_parser, sampling_defaults)))

    if api_key:
        app.add_middleware(ApiKeyGuard, api_key=api_key)
    app.add_middleware(BodyLimit, limit=max_request_bytes)  # (outermost: nothing larger is read at all)

    @app.exception_handler(HTTPException)
    async def http_error(_request, e: HTTPException):  # unknown route, wrong method: JSON like every error
        return _error(e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, e: RequestValidationError):
        return _error(400, f"invalid request: {e.errors()[:3]}")

    @app.get("/health")
    async def health():
        if manager.dead:
            return _error(503, manager.dead)
        return {"status": "ok"}

    @app.get("/health_generate")
    async def health_generate():
        """Runs one real token through every process."""
        try:
            out = await asyncio.wait_for(manager.generate_final(
                input_ids=[0], sampling={"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}), 60)
        except Exception as e:
            return _error(503, f"generation failed: {e}")
        if out["meta_info"]["completion_tokens"] != 1:
            return _error(503, f"generation ended without a token: {out['meta_info']['finish_reason']}")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(manager.metrics.render(await manager.get_stats()), media_type=CONTENT_TYPE_LATEST)

    @app.post("/abort_request", openapi_extra=request_body(ABORT))
    async def abort_request(request: Request):
        body = await _json_object(request)
        if isinstance(body, JSONResponse):
            return body
        rid, abort_all = body.get("rid"), body.get("abort_all") is True
        if not (isinstance(rid, str) and rid) and not abort_all:
            return _error(400, "give 'rid' (a request id) or 'abort_all': true", "rid")
        await manager.abort("" if abort_all else rid)
        return {"aborted": "all" if abort_all else rid}

    @app.post("/flush_cache")
    async def flush_cache():
        refused = await manager.flush_cache()
        return _error(400, f"the prefix cache was not flushed: {refused}") if refused else {"flushed": True}

    @app.get("/get_server_info")
    async def get_server_info():
        return {**server_info, "stats": await manager.get_stats()}

    @app.post("/generate", openapi_extra=request_body(GENERATE))
    async def generate(request: Request):
        body = await _json_object(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            prompts, batch = _prompts(body)
        except RequestError as e:
            return _error(400, str(e))
        if len(prompts) > MAX_BATCH:
            return _error(400, f"at most {MAX_BATCH} prompts in one request, got {len(prompts)}", "text")
        stream = bool(body.get("stream"))
        if batch and stream:
            return _error(400, "stream is supported for a single prompt", "stream")
        try:
            sampling, logprob_start = _logprob_fields(body)
        except RequestError as e:
            return _error(400, str(e), str(e).split(" ", 1)[0])
        rid = body.get("rid")
        if batch and isinstance(rid, list) and len(rid) != len(prompts):
            return _error(400, f"rid: {len(rid)} ids for {len(prompts)} prompts", "rid")
        if isinstance(rid, list) and not batch:
            return _error(400, "rid: a list of ids needs a list of prompts", "rid")

        def request(t, i, r) -> dict:
            return dict(text=t, input_ids=i, sampling=sampling, rid=r, priority=body.get("priority") or 0,
                        routing_key=body.get("routing_key"), routed_dp_rank=body.get("routed_dp_rank"))

        try:
            manager.ensure_capacity(len(prompts))
        except UnavailableError as e:
            return _error(503, str(e))
        if stream:
            gen = manager.generate(**request(*prompts[0], rid), stream=True)
            try:
                first = await anext(gen)
            except RequestError as e:
                return _error(400, str(e))
            except UnavailableError as e:
                return _error(503, str(e))

            incremental = bool(body.get("incremental"))
            sent = {"text": 0, "ids": 0}

            def event(out: dict) -> bytes:
                out = _from_logprob_start(out, logprob_start)
                if incremental:  # only what is new since the previous event
                    text, ids = out["text"], out["output_ids"]
                    out = {**out, "text": text[sent["text"]:], "output_ids": ids[sent["ids"]:]}
                    sent.update(text=len(text), ids=len(ids))
                return sse_data(out)

            async def sse():
                try:
                    yield event(first)
                    async for out in gen:
                        yield event(out)
                    yield "data: [DONE]\n\n"
                finally:
                    await gen.aclose()  # a disconnect lands here and aborts the request

            return StreamingResponse(sse(), media_type="text/event-stream")
        try:
            rids = [(rid[k] if isinstance(rid, list) else rid) if rid else None for k in range(len(prompts))]
            outs = await asyncio.gather(*(manager.generate_final(**request(t, i, r))
                                          for (t, i), r in zip(prompts, rids)))
        except RequestError as e:
            return _error(400, str(e))
        except UnavailableError as e:
            return _error(503, str(e))
        outs = [_from_logprob_start(out, logprob_start) for out in outs]
        return outs if batch else outs[0]

    return app
