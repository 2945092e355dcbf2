"""RequestGuard: what an HTTP request must pass before any route sees it (an ASGI middleware,
inside CORS and --api-key): an allowed Origin, a JSON Content-Type, a bounded body.

The cross-site rules (a page in a browser must not act on the server behind its user's back):
- A request whose `Origin` header is not in --allowed-origins gets 403, whatever its method;
  CORS alone only stops the page from *reading* the answer, not the effect. Requests without
  an Origin (curl, SDKs, servers) are not affected. With the default `*` every origin is
  allowed, as in SGLang: a page may call the API, but only with requests a browser sends
  after a CORS preflight (the next rule), never with a plain form post or `no-cors` fetch.
- A POST with a body, or from a browser (it has an Origin), must be `application/json`
  (415 otherwise): a cross-site page can send form or text/plain bodies without a preflight,
  never JSON. Body-less POSTs from non-browser clients (`curl -X POST .../flush_cache`, the
  router's fan-out) need no Content-Type.
- A body over --max-request-bytes gets 413: at once when its Content-Length says so, else as
  soon as the bytes received pass the limit (BodyTooLarge, raised to the route). A refused
  request's connection is closed (its unread body would follow).
Routes that change state are POST-only (http_server.py).
"""

from __future__ import annotations

import json
from typing import Any

from sglite.server.errors import RequestError
from sglite.server.protocol import error_body

JSON_MEDIA_TYPE = b"application/json"
BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


class BodyTooLarge(RequestError):
    def __init__(self, limit: int):
        super().__init__(
            f"the request body is larger than {limit} bytes (--max-request-bytes)", 413
        )


def _headers(scope: dict[str, Any]) -> dict[bytes, bytes]:
    wanted = (b"origin", b"content-type", b"content-length", b"transfer-encoding")
    out: dict[bytes, bytes] = {}
    for name, value in scope.get("headers") or []:
        name = name.lower()
        if name in wanted and name not in out:
            out[name] = value
    return out


def media_type(content_type: bytes | None) -> bytes:
    return (content_type or b"").split(b";", 1)[0].strip().lower()


class RequestGuard:
    def __init__(self, app: Any, *, allowed_origins: list[str], max_body_bytes: int | None):
        self.app = app
        self.any_origin = "*" in allowed_origins
        self.origins = {o.rstrip("/").lower().encode() for o in allowed_origins}
        self.max_body_bytes = max_body_bytes

    def refusal(self, method: str, headers: dict[bytes, bytes]) -> tuple[int, str] | None:
        """(status, message) when the request is refused before it runs, else None."""
        origin = headers.get(b"origin")
        if origin is not None and not self.any_origin:
            if origin.rstrip(b"/").lower() not in self.origins:
                shown = origin.decode("latin-1")[:100]
                return 403, f"origin {shown!r} is not allowed (--allowed-origins)"
        if method in BODY_METHODS:
            length = headers.get(b"content-length", b"").strip()
            has_body = (length not in (b"", b"0")) or b"transfer-encoding" in headers
            kind = media_type(headers.get(b"content-type"))
            if (has_body or origin is not None) and kind != JSON_MEDIA_TYPE:
                shown = kind.decode("latin-1")[:80] or "none"
                return 415, (
                    f"Content-Type must be application/json (got {shown}); send JSON with "
                    "the header `Content-Type: application/json`"
                )
            limit = self.max_body_bytes
            if limit is not None and length.isdigit() and int(length) > limit:
                return 413, BodyTooLarge(limit).message
        return None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = self.refusal(scope["method"], _headers(scope))
        if refused is not None:
            await send_error(send, *refused)
            return
        limit = self.max_body_bytes
        if limit is None or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        received = 0

        async def bounded_receive() -> Any:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, bounded_receive, send)


async def send_error(send: Any, status: int, message: str) -> None:
    """An error answer in the API's JSON shape; the connection closes after it."""
    body = json.dumps(error_body(message, status), separators=(",", ":")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
