"""`/tokenize` and `/detokenize` (also under /v1), in SGLang's shapes.

POST /tokenize   {"prompt": str | [str], "add_special_tokens": true, "model": any}
              -> {"tokens": [int] | [[int]], "count": int | [int], "max_model_len": int}
POST /detokenize {"tokens": [int] | [[int]], "skip_special_tokens": true, "model": any}
              -> {"text": str | [str]}
Token ids are checked against the vocabulary (400 naming the bad one); prompts count against
--max-prompts-per-request and --max-prompt-chars. The work runs off the event loop.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from sglite.server.inputs import RequestError

ParseBody = Callable[[Request, type], Awaitable[Any]]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | list[str]
    add_special_tokens: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True


def add_tokenize_routes(app: FastAPI, tm: Any, parse_body: ParseBody) -> None:
    """Register the routes on `app`, answering with `tm`'s tokenizer."""

    def encode(req: TokenizeRequest) -> dict[str, Any]:
        single = isinstance(req.prompt, str)
        prompts = [req.prompt] if single else req.prompt
        tokens = []
        for i, p in enumerate(prompts):
            where = "prompt" if single else f"prompt[{i}]"
            tm.inputs.limits.check_chars(len(p), where)
            tokens.append(tm.inputs.encode(p, where, req.add_special_tokens))
        if single:
            return {
                "tokens": tokens[0],
                "count": len(tokens[0]),
                "max_model_len": tm.context_length,
            }
        return {
            "tokens": tokens,
            "count": [len(t) for t in tokens],
            "max_model_len": tm.context_length,
        }

    def decode(req: DetokenizeRequest) -> dict[str, Any]:
        is_batch = bool(req.tokens) and isinstance(req.tokens[0], list)
        lists: list[Any] = req.tokens if is_batch else [req.tokens]
        for i, ids in enumerate(lists):
            where = f"tokens[{i}]" if is_batch else "tokens"
            for j, t in enumerate(ids):
                if not 0 <= t < tm.vocab_size:
                    raise RequestError(
                        f"{where}[{j}] = {t} is not a token id in [0, {tm.vocab_size})",
                        param="tokens",
                    )
        texts = [
            tm.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens) for ids in lists
        ]
        return {"text": texts if is_batch else texts[0]}

    def answer(make: Callable[[Any], dict[str, Any]], req: Any) -> Response:
        """The JSON answer, serialized here (off the loop: a long token list is slow)."""
        body = json.dumps(make(req), ensure_ascii=False, separators=(",", ":")).encode()
        return Response(body, media_type="application/json")

    async def tokenize(request: Request) -> Response:
        return await tm.offload(answer, encode, await parse_body(request, TokenizeRequest))

    async def detokenize(request: Request) -> Response:
        return await tm.offload(answer, decode, await parse_body(request, DetokenizeRequest))

    for prefix in ("", "/v1"):
        app.add_api_route(prefix + "/tokenize", tokenize, methods=["POST"])
        app.add_api_route(prefix + "/detokenize", detokenize, methods=["POST"])
