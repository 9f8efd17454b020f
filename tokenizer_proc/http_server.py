"""HTTP routes of the native API: POST /generate (JSON, or SSE when "stream": true),
GET /health, GET /get_server_info."""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from tokenizer_proc.manager import QueueFullError, RequestError, TokenizerManager
from tokenizer_proc.openai_api import OpenAIServing, build_router


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


async def _json_object(request: Request) -> dict | JSONResponse:
    """The body as a JSON object, or the 400 response to send instead."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return _error(400, f"malformed JSON body: {e}")
    if not isinstance(body, dict):
        return _error(400, "the body must be a JSON object")
    return body


def build_app(manager: TokenizerManager, server_info: dict[str, Any], model_name: str,
              api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="loom")
    app.include_router(build_router(OpenAIServing(manager, model_name, manager.context_len)))

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if api_key and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return JSONResponse({"error": {"message": "missing or wrong API key (Authorization: Bearer ...)",
                                               "type": "authentication_error", "code": 401}}, status_code=401)
        return await call_next(request)

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

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await _json_object(request)
        if isinstance(body, JSONResponse):
            return body
        rid, abort_all = body.get("rid"), bool(body.get("abort_all"))
        if not (isinstance(rid, str) and rid) and not abort_all:
            return _error(400, "give 'rid' (a request id) or 'abort_all': true")
        await manager.abort("" if abort_all else rid)
        return {"aborted": "all" if abort_all else rid}

    @app.post("/flush_cache")
    async def flush_cache():
        refused = await manager.flush_cache()
        return _error(400, f"the prefix cache was not flushed: {refused}") if refused else {"flushed": True}

    @app.get("/get_server_info")
    async def get_server_info():
        return {**server_info, "stats": await manager.get_stats()}

    @app.post("/generate")
    async def generate(request: Request):
        body = await _json_object(request)
        if isinstance(body, JSONResponse):
            return body
        text, input_ids = body.get("text"), body.get("input_ids")
        batch = isinstance(text, list) or (isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list))
        prompts = [(t, None) for t in text] if isinstance(text, list) else (
            [(None, i) for i in input_ids] if batch else [(text, input_ids)])
        stream = bool(body.get("stream"))
        if batch and stream:
            return _error(400, "stream is supported for a single prompt")
        sampling = body.get("sampling_params")
        rid = body.get("rid")

        def request(t, i, r) -> dict:
            return dict(text=t, input_ids=i, sampling=sampling, rid=r, priority=body.get("priority") or 0,
                        routing_key=body.get("routing_key"), routed_dp_rank=body.get("routed_dp_rank"))

        try:
            manager.ensure_capacity(len(prompts))
        except QueueFullError as e:
            return _error(503, str(e))
        if stream:
            gen = manager.generate(**request(*prompts[0], rid), stream=True)
            try:
                first = await anext(gen)
            except RequestError as e:
                return _error(400, str(e))
            except QueueFullError as e:
                return _error(503, str(e))

            incremental = bool(body.get("incremental"))
            sent = {"text": 0, "ids": 0}

            def event(out: dict) -> str:
                if incremental:  # only what is new since the previous event
                    text, ids = out["text"], out["output_ids"]
                    out = {**out, "text": text[sent["text"]:], "output_ids": ids[sent["ids"]:]}
                    sent.update(text=len(text), ids=len(ids))
                return f"data: {json.dumps(out)}\n\n"

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
        except QueueFullError as e:
            return _error(503, str(e))
        return outs if batch else outs[0]

    return app
