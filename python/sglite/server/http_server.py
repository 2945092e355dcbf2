"""The FastAPI app: native routes (/generate, health, info, cache, metrics, tokenize) and
OpenAI routes, behind CORS (any origin unless --allowed-origins) and --api-key.

All errors leave as JSON `{"error": {"message", "type", "param", "code"}}`: bad input is a
400 naming the field (FastAPI's 422 included), an unknown route a 404, a missing API key a
401, an overloaded, stuck or dying server a 503 (with Retry-After when the waiting queue is
full). POST bodies are parsed as JSON whatever their Content-Type (curl -d sends form
encoding). /get_server_info has SGLang's flat shape: the server args, the model facts and
the scheduler's stats at the top level (summed over --dp-size replicas), and each replica's
own stats in `internal_states` (one entry per replica, with its `dp_rank` when there are
several). Both info routes also answer under SGLang's newer names (/server_info,
/model_info), which SGLang's router asks first.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from sglite.server import openai_api
from sglite.server.auth import ApiKeyMiddleware
from sglite.server.dp_dispatcher import merge_stats
from sglite.server.inputs import Prompt, RequestError
from sglite.server.metrics import CONTENT_TYPE
from sglite.server.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    error_body,
)
from sglite.server.router_api import add_router_routes
from sglite.server.tokenize_api import add_tokenize_routes
from sglite.server.tokenizer_manager import TokenizerManager
from sglite.version import __version__

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 20.0
M = TypeVar("M", bound=BaseModel)
_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _field_path(loc: tuple[Any, ...]) -> str:
    parts = [
        str(x) if not isinstance(x, int) else f"[{x}]"
        for x in loc
        if not (isinstance(x, str) and (x in _UNION_TAGS or "[" in x or "-" in x))
    ]
    return ".".join(parts).replace(".[", "[")


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Pydantic's validation errors as one sentence naming the (first) bad field."""
    if not errors:
        return "invalid request body", None
    first = errors[0]
    path = _field_path(tuple(first.get("loc") or ()))
    if not path:
        return f"the request body must be a JSON object ({first.get('msg')})", None
    return f"{path}: {first.get('msg')}", path.split(".")[0].split("[")[0]


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body as `model` (whatever the Content-Type); 400 naming the field if not."""
    raw = await request.body()
    if not raw.strip():
        raise RequestError("the request body is empty; send a JSON object")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"malformed JSON in the request body: {e}") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        message, param = validation_message(e.errors())
        raise RequestError(message, param=param) from None


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def create_app(tm: TokenizerManager) -> FastAPI:
    """The app; the TokenizerManager's sockets open and close with the app's lifespan."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await tm.start()
        yield
        await tm.close()

    app = FastAPI(title="sglite", version=__version__, lifespan=lifespan)
    args = tm.server_args
    if getattr(args, "api_key", None):
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key)
    origins = getattr(args, "cors_origins", ["*"])
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
            error_body(message, exc.status_code), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{**e, "loc": tuple(e.get("loc") or ())[1:]} for e in exc.errors()]
        message, param = validation_message(errors)
        return JSONResponse(error_body(message, 400, param), status_code=400)

    @app.exception_handler(RequestError)
    async def _on_request_error(request: Request, exc: RequestError) -> JSONResponse:
        retry_after = getattr(exc, "retry_after_s", None)
        return JSONResponse(
            error_body(exc.message, exc.status_code, exc.param),
            status_code=exc.status_code,
            headers={"Retry-After": str(retry_after)} if retry_after is not None else None,
        )

    # ------------------------------------------------------------------ native
    @app.post("/generate")
    async def generate(request: Request) -> Any:
        req = await parse_body(request, GenerateRequest)
        prompts, is_batch = tm.inputs.prepare_generate(
            req.text, req.input_ids, req.sampling_params, req.rid, req.logprob_fields()
        )
        if req.stream:
            states = await tm.submit(prompts, stream=True)
            return StreamingResponse(
                _generate_events(states, is_batch), media_type="text/event-stream"
            )
        outputs = await tm.collect(prompts, request.is_disconnected)
        return outputs if is_batch else outputs[0]

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

    @app.get("/model_info")  # SGLang's newer name; the router asks it first
    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        info = tm.model_info
        return {
            "model_path": tm.server_args.model_path,
            "tokenizer_path": info.get("tokenizer_path"),
            "served_model_name": tm.served_model_name,
            "is_generation": True,
            "context_length": tm.context_length,
            "vocab_size": tm.vocab_size,
            "max_total_tokens": info.get("max_total_tokens"),
            "model_type": info.get("model_type"),
            "architectures": info.get("architectures"),
        }

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        replicas = await tm.get_replica_stats()
        stats = merge_stats(replicas)
        info = tm.model_info
        return {
            **tm.server_args.to_dict(),
            **info,
            "max_total_num_tokens": info.get("max_total_tokens"),  # SGLang's name
            "served_model_name": tm.served_model_name,
            **stats,
            "tree_core": stats.get("tree_core") or info.get("tree_core"),
            "internal_states": replicas,
            "version": __version__,
        }

    @app.api_route("/flush_cache", methods=["GET", "POST"])
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

    # ------------------------------------------------------------------ OpenAI
    def model_card() -> dict[str, Any]:
        return {
            "id": tm.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglite",
            "root": tm.server_args.model_path,
            "max_model_len": tm.context_length,
        }

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> dict[str, Any]:
        if model != tm.served_model_name:
            raise RequestError(
                f"model {model!r} not found; this server serves {tm.served_model_name!r}",
                404,
                param="model",
            )
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        req = await parse_body(request, CompletionRequest)
        if req.stream:
            prompts, lens = openai_api.completion_prompts(tm, req)
            return await _openai_stream(prompts, lens, req, chat=False)
        return await openai_api.completions(tm, req, request.is_disconnected)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        req = await parse_body(request, ChatCompletionRequest)
        if req.stream:
            prompts, lens = openai_api.chat_prompts(tm, req)
            return await _openai_stream(prompts, lens, req, chat=True)
        return await openai_api.chat(tm, req, request.is_disconnected)

    async def _openai_stream(
        prompts: list[Prompt], lens: list[int], req: Any, *, chat: bool
    ) -> StreamingResponse:
        events = await openai_api.stream_openai(tm, prompts, lens, req, chat=chat)
        return StreamingResponse(events, media_type="text/event-stream")

    return app
