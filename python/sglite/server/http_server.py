"""The FastAPI app: native routes (/generate, health, cache, metrics, tokenize), the info
routes (server/info_api.py) and the OpenAI routes, behind CORS (any origin unless
--allowed-origins), --api-key and the RequestGuard (server/request_guard.py: Origin,
Content-Type, body size).

All errors leave as JSON `{"error": {"message", "type", "param", "code"}}`: bad input is a
400 naming the field (FastAPI's 422 included), an unknown route a 404, a missing API key a
401, a refused Origin a 403, a body that is not JSON 415, too large 413, an overloaded,
stuck or dying server a 503 (with Retry-After when the waiting queue is full). Messages are
cut to MAX_ERROR_CHARS: an error never echoes a huge input back.

The CPU work of a request (JSON parsing and validation, chat templating, tokenization,
grammar syntax checks) runs in the TokenizerManager's threads (`tm.offload`), never on the
event loop, so /health and small requests answer while a big one is being prepared; a
request is submitted to the scheduler once it is prepared.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from sglite.server import openai_api
from sglite.server.auth import ApiKeyMiddleware
from sglite.server.body import decode_body, validation_message
from sglite.server.connections import LogThrottle
from sglite.server.errors import RequestError
from sglite.server.info_api import add_info_routes
from sglite.server.inputs import Prompt
from sglite.server.metrics import CONTENT_TYPE
from sglite.server.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    error_body,
)
from sglite.server.request_guard import RequestGuard
from sglite.server.router_api import add_router_routes
from sglite.server.tokenize_api import add_tokenize_routes
from sglite.server.tokenizer_manager import TokenizerManager
from sglite.version import __version__

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 20.0
MAX_ERROR_CHARS = 600
M = TypeVar("M", bound=BaseModel)
_disconnects = LogThrottle()


def short(message: str) -> str:
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + " ..."


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def create_app(tm: TokenizerManager, given_args: Any = None) -> FastAPI:
    """The app; the TokenizerManager's sockets open and close with the app's lifespan.
    `given_args`: the ServerArgs as given, before the model was resolved to a local folder
    (what the info routes show; default: tm.server_args)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await tm.start()
        yield
        await tm.close()

    app = FastAPI(title="sglite", version=__version__, lifespan=lifespan)
    args = tm.server_args
    origins = getattr(args, "cors_origins", ["*"])
    app.add_middleware(  # innermost: after CORS and the API key
        RequestGuard,
        allowed_origins=origins,
        max_body_bytes=getattr(args, "max_request_bytes", None),
    )
    if getattr(args, "api_key", None):
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key)
    app.add_middleware(  # added last: outermost, so preflights and 401s carry CORS headers
        CORSMiddleware,
        allow_origins=origins,
        allow_credentials=origins != ["*"],
        allow_methods=["*"],
        allow_headers=["*"],
    )

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see the README for the API"
        elif exc.status_code == 405:
            message = f"{request.url.path} does not take {request.method}"
        return JSONResponse(
            error_body(short(message), exc.status_code),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{**e, "loc": tuple(e.get("loc") or ())[1:]} for e in exc.errors()]
        message, param = validation_message(errors)
        return JSONResponse(error_body(short(message), 400, param), status_code=400)

    @app.exception_handler(RequestError)
    async def _on_request_error(request: Request, exc: RequestError) -> JSONResponse:
        headers = {}
        retry_after = getattr(exc, "retry_after_s", None)
        if retry_after is not None:
            headers["Retry-After"] = str(retry_after)
        if exc.status_code == 413:  # the rest of the body is not read
            headers["Connection"] = "close"
        return JSONResponse(
            error_body(short(exc.message), exc.status_code, exc.param and short(exc.param)),
            status_code=exc.status_code,
            headers=headers,
        )

    async def parse_body(request: Request, model: type[M]) -> M:
        """The JSON body as `model` (parsed and checked off the loop: server/body.py)."""
        try:
            raw = await request.body()
        except ClientDisconnect:
            _disconnects.warning("body", "a client disconnected before its request body was in")
            raise RequestError("the client disconnected", 499) from None
        return await tm.offload(decode_body, raw, model, tm.inputs.limits)

    # ------------------------------------------------------------------ native
    @app.post("/generate")
    async def generate(request: Request) -> Any:
        req = await parse_body(request, GenerateRequest)
        prompts, is_batch = await tm.offload(
            tm.inputs.prepare_generate,
            req.text,
            req.input_ids,
            req.sampling_params,
            req.rid,
            req.logprob_fields(),
        )
        for p in prompts:
            p.priority = req.priority
        if req.stream:
            states = await tm.submit(prompts, stream=True)
            return StreamingResponse(
                _generate_events(states, is_batch), media_type="text/event-stream"
            )
        outputs = await tm.collect(prompts, request.is_disconnected)
        return JSONResponse(outputs if is_batch else outputs[0])  # json.dumps, no encoder pass

    async def _generate_events(states: list[Any], is_batch: bool) -> AsyncIterator[str]:
        async for i, out in tm.follow(states, stream=True):
            reason = out["meta_info"]["finish_reason"] or {}
            if reason.get("type") == "abort" and reason.get("status_code"):
                yield _sse(error_body(str(reason.get("message")), int(reason["status_code"])))
                continue
            if is_batch:
                out["index"] = i
            yield _sse(out)
        yield "data: [DONE]\n\n"

    @app.get("/health")
    async def health() -> Response:
        problem = tm.health_problem()
        if problem is not None:
            raise RequestError(problem, 503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        sp, _ = tm.inputs.sampling_params({"max_new_tokens": 1, "temperature": 0.0})
        prompt = Prompt(f"HEALTH_CHECK_{uuid.uuid4().hex}", [0], sp)
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S):
                outputs = await tm.collect([prompt])
        except TimeoutError:
            raise RequestError(
                f"the scheduler produced no output within {HEALTH_TIMEOUT_S:.0f} s", 503
            ) from None
        if outputs[0]["meta_info"]["finish_reason"]["type"] == "abort":
            raise RequestError("the health-check request was aborted", 503)
        return Response(status_code=200)

    @app.post("/flush_cache")  # it changes state: POST only
    async def flush_cache() -> Response:
        resp = await tm.flush_cache()
        if not resp.success:
            raise RequestError(
                resp.message
                or "the cache cannot be flushed while requests are running; retry when idle",
                400,
            )
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        req = await parse_body(request, AbortRequest)
        if not req.rid and not req.abort_all:
            raise RequestError("rid: give a request id (or abort_all=true)", param="rid")
        tm.abort(req.rid, req.abort_all)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        if not tm.metrics.enabled:
            raise RequestError("metrics are off; start the server with --enable-metrics", 404)
        try:
            await tm.get_stats()
        except RequestError:
            logger.warning("/metrics: no scheduler stats (the scheduler did not answer)")
        return Response(tm.metrics.render(), media_type=CONTENT_TYPE)

    add_tokenize_routes(app, tm, parse_body)
    add_router_routes(app, tm)

    add_info_routes(app, tm, given_args or tm.server_args)

    # ------------------------------------------------------------------ OpenAI
    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        req = await parse_body(request, CompletionRequest)
        prompts, lens = await tm.offload(openai_api.completion_prompts, tm, req)
        if req.stream:
            return await _openai_stream(prompts, lens, req, chat=False)
        out = await openai_api.completions(tm, req, request.is_disconnected, (prompts, lens))
        return JSONResponse(out)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        req = await parse_body(request, ChatCompletionRequest)
        prompts, lens = await tm.offload(openai_api.chat_prompts, tm, req)
        if req.stream:
            return await _openai_stream(prompts, lens, req, chat=True)
        return JSONResponse(
            await openai_api.chat(tm, req, request.is_disconnected, (prompts, lens))
        )

    async def _openai_stream(
        prompts: list[Prompt], lens: list[int], req: Any, *, chat: bool
    ) -> StreamingResponse:
        events = await openai_api.stream_openai(tm, prompts, lens, req, chat=chat)
        return StreamingResponse(events, media_type="text/event-stream")

    return app
