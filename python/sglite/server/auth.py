"""`--api-key`: every HTTP route except the probes asks for `Authorization: Bearer KEY`.

An ASGI middleware, so it also guards streaming responses and routes that do not exist
(a client without the key learns nothing about the server). `/health` and `/metrics` stay
open for load balancers and Prometheus, as in SGLang. The key is compared in constant time
(digests of equal length, `hmac.compare_digest`). A refusal is HTTP 401 with the OpenAI
error body and `WWW-Authenticate: Bearer`. CORS preflight requests never reach it: the CORS
middleware, outside it, answers them (browsers send no credentials there).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from sglite.server.protocol import error_body

OPEN_PATHS = frozenset({"/health", "/metrics"})


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header, if there is one."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


class ApiKeyMiddleware:
    def __init__(self, app: Any, api_key: str, open_paths: frozenset[str] = OPEN_PATHS):
        self.app = app
        self._key_digest = _digest(api_key.encode())
        self.open_paths = open_paths

    def allows(self, headers: list[tuple[bytes, bytes]]) -> bool:
        token = bearer_token(headers)
        return token is not None and hmac.compare_digest(_digest(token), self._key_digest)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (
            scope["type"] != "http"
            or scope["path"] in self.open_paths
            or self.allows(scope.get("headers") or [])
        ):
            await self.app(scope, receive, send)
            return
        has_header = any(n.lower() == b"authorization" for n, _ in scope.get("headers") or [])
        message = (
            "invalid API key in the Authorization header"
            if has_header
            else "this server requires an API key: send `Authorization: Bearer <key>`"
        )
        body = json.dumps(error_body(message, 401), separators=(",", ":")).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
