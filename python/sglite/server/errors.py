"""The errors the server answers with: `RequestError` carries the HTTP status (400 for bad
input) and a message that names the field; `QueueFullError` adds a Retry-After."""

from __future__ import annotations

RETRY_AFTER_S = 1  # what a client refused by --max-queued-requests is told to wait


class RequestError(ValueError):
    """A request the server refuses; `status_code` is the HTTP status to answer with."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param


class QueueFullError(RequestError):
    """The waiting queue is at --max-queued-requests: HTTP 503 with a Retry-After header."""

    retry_after_s = RETRY_AFTER_S
