"""Client connections: read timeouts, a connection cap, the open-file limit, and logs that
stay one line per kind of event however many events there are.

uvicorn's h11 protocol closes a keep-alive connection idle after a response
(--timeout-keep-alive) but never one that has not sent a complete request: an idle fresh
socket, a slowloris sender trickling header bytes or a partial body are held forever, and
at the open-file limit the server stops accepting (asyncio logs a traceback per retry).
`guarded_protocol` subclasses it with one deadline per phase of a request, armed when the
phase starts and never pushed back by the bytes that arrive:
- waiting for a request's headers (from connecting, or from the end of the previous
  response): --http-header-timeout, then the connection is closed;
- receiving its body: --http-body-timeout, then 408 and closed (the route sees a client
  that went away);
- while the route runs (generation may take minutes, streams longer) there is none.
A connection beyond --max-connections is answered 503 at once and closed, so the server
keeps file descriptors for its own sockets and files: its default stays below the open-file
limit, as reaching it is fatal (libzmq aborts when its sockets cannot get a descriptor). `raise_open_file_limit` lifts the
soft limit to the hard one at start-up (as SGLang does). `throttle_server_logs` makes
asyncio's and uvicorn's warnings (accept errors such as "Too many open files", failed
socket sends, invalid requests, even repeated tracebacks) one line per kind every 10 s,
with the count of those left out; OS errors lose their traceback.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from sglite.server.protocol import error_body

logger = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0
OPEN_FILES_TARGET = 65536  # the soft limit asked for at start-up (capped by the hard one)
MAX_DEFAULT_CONNECTIONS = 4096
THROTTLED_LOGGERS = ("asyncio", "uvicorn.error")


class LogThrottle:
    """At most one record per key every `interval_s`; the next one says how many were
    left out in between."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S):
        self.interval_s = interval_s
        self._last: dict[Any, float] = {}
        self._skipped: dict[Any, int] = {}

    def allow(self, key: Any) -> tuple[bool, int]:
        """(whether to log now, how many were skipped since the last one logged)."""
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._skipped[key] = self._skipped.get(key, 0) + 1
            return False, 0
        self._last[key] = now
        return True, self._skipped.pop(key, 0)

    def warning(self, key: Any, message: str) -> None:
        ok, skipped = self.allow(key)
        if ok:
            more = f" (and {skipped} more like it in between)" if skipped else ""
            logger.warning("%s%s", message, more)


class ThrottleFilter(logging.Filter):
    """A logging filter: the LogThrottle of one logger, keyed by a record's first line."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S):
        super().__init__()
        self.throttle = LogThrottle(interval_s)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        message = record.getMessage()
        ok, skipped = self.throttle.allow((record.name, message.split("\n", 1)[0][:120]))
        if not ok:
            return False
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, OSError):  # the environment, not a bug: no traceback
            message = f"{message.splitlines()[0]}: {exc}"
            record.exc_info, record.exc_text = None, None
        if skipped:
            message += f" (and {skipped} more like it in the last {self.throttle.interval_s:g} s)"
        record.msg, record.args = message, None
        return True


def throttle_server_logs() -> None:
    """Install a ThrottleFilter on asyncio's and uvicorn's loggers (once; call it after
    uvicorn configured its logging)."""
    for name in THROTTLED_LOGGERS:
        log = logging.getLogger(name)
        if not any(isinstance(f, ThrottleFilter) for f in log.filters):
            log.addFilter(ThrottleFilter())


def raise_open_file_limit(target: int = OPEN_FILES_TARGET) -> int:
    """Lift the soft open-file limit towards `target` (never above the hard limit); the
    soft limit in force afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, want, e)
    return soft


def open_descriptors() -> int:
    """File descriptors this process has open now (0 where /proc is missing)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def accept_backlog(open_files: int) -> int:
    """The listen backlog: also how many sockets asyncio accepts in one go, before the cap
    can close the extra ones, so a few bursts must fit in what the cap leaves free."""
    return max(16, min(2048, open_files // 16))


def default_max_connections(open_files: int, in_use: int = 0) -> int:
    """The --max-connections default: what the open-file limit leaves after the descriptors
    in use and a margin for accept bursts (the refused sockets of one burst are still
    closing while the next is accepted; libzmq aborts the process when it cannot get a
    descriptor, asyncio stops accepting for a second)."""
    margin = max(3 * accept_backlog(open_files) + 32, open_files // 8)
    return max(1, min(MAX_DEFAULT_CONNECTIONS, open_files - in_use - margin))


@dataclass
class ConnectionSettings:
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int | None  # None: default_max_connections at the first connection
    open_files: int

    @classmethod
    def from_args(cls, args: Any, open_files: int) -> ConnectionSettings:
        return cls(
            args.http_header_timeout, args.http_body_timeout, args.max_connections, open_files
        )

    @property
    def backlog(self) -> int:
        return accept_backlog(self.open_files)

    def cap(self) -> int:
        """The connection cap; the default is fixed when the first client connects, once the
        server's own sockets (ZMQ, opened at start-up) are all open."""
        if self.max_connections is None:
            self.max_connections = default_max_connections(self.open_files, open_descriptors())
            logger.info(
                "accepting up to %d connections (--max-connections; open-file limit %d)",
                self.max_connections, self.open_files,
            )  # fmt: skip
        return self.max_connections


def _raw_response(status: int, reason: str, message: str | None, extra: str = "") -> bytes:
    body = b""
    if message is not None:
        body = json.dumps(error_body(message, status), separators=(",", ":")).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n{extra}\r\n"
    )
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with per-phase deadlines and a connection cap (module doc)."""

    settings: ConnectionSettings  # set by guarded_protocol()
    throttle = LogThrottle()

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._phase: str | None = None
        self._deadline: Any = None

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        cap = self.settings.cap()
        if len(self.connections) > cap:
            self.throttle.warning(
                "cap", f"refused a connection: {cap} are open (--max-connections)"
            )
            message = f"the server has {cap} open connections (--max-connections); retry later"
            transport.write(
                _raw_response(503, "Service Unavailable", message, "retry-after: 1\r\n")
            )
            transport.close()
            return
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    # ------------------------------------------------------------------ deadlines
    def _current_phase(self) -> str | None:
        if self.transport is None or self.transport.is_closing():
            return None
        state = self.conn.their_state
        if state is h11.IDLE:
            return "headers"
        if state is h11.SEND_BODY:
            return "body"
        return None  # the request is in; the route runs (or the connection is closing)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _watch(self) -> None:
        phase = self._current_phase()
        if phase == self._phase:
            return
        self._disarm()
        self._phase = phase
        if phase is not None:
            timeout = (
                self.settings.header_timeout_s
                if phase == "headers"
                else self.settings.body_timeout_s
            )
            self._deadline = self.loop.call_later(timeout, self._expire, phase)

    def _expire(self, phase: str) -> None:
        self._deadline = None
        if self._current_phase() != phase:
            self._phase = None
            self._watch()
            return
        if phase == "headers":
            self.throttle.warning(
                "headers",
                "closed a connection that sent no complete request headers in "
                f"{self.settings.header_timeout_s:g} s (--http-header-timeout)",
            )
        else:
            self.throttle.warning(
                "body",
                "closed a connection that sent no complete request body in "
                f"{self.settings.body_timeout_s:g} s (--http-body-timeout)",
            )
            message = (
                f"the request body did not arrive within {self.settings.body_timeout_s:g} s "
                "(--http-body-timeout)"
            )
            if self.cycle is None or not self.cycle.response_started:
                self.transport.write(_raw_response(408, "Request Timeout", message))
        self.transport.close()


def guarded_protocol(settings: ConnectionSettings) -> type[GuardedH11Protocol]:
    """The protocol class to give uvicorn (`uvicorn.Config(http=...)`)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"settings": settings})
