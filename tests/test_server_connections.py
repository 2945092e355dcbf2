"""Connections are bounded (issue 23, item 3), on a real server with the fake scheduler:
an idle socket, a slowloris sender and a partial body are closed after their timeouts; a
connection over --max-connections is answered 503 at once; at the open-file limit the log
stays a few lines (no traceback per failed accept) and /health answers again once the flood
stops. Waits are bounded (a timeout 5-10x the server's), never measured."""

from __future__ import annotations

import logging
import resource
import socket
import time

import httpx
import pytest

from fixtures.serving import build_tiny_tokenizer, start_server
from sglite.server.connections import LogThrottle, ThrottleFilter, default_max_connections

TIMEOUT_S = 1.0
MAX_CONNECTIONS = 4
WAIT_S = 15.0  # bounded waits for what the server does after TIMEOUT_S


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def server(tok_dir, tmp_path_factory):
    args = ["--model-path", str(tok_dir), "--http-header-timeout", str(TIMEOUT_S)]
    args += ["--http-body-timeout", str(TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS)]
    srv = start_server(args, tmp_path_factory.mktemp("log") / "server.log", fake=True)
    yield srv
    srv.stop()


def _connect(server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)
    s.settimeout(WAIT_S)
    return s


def _read_until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (bounded by WAIT_S)."""
    out = b""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk
    raise AssertionError(f"the server kept the connection open for {WAIT_S} s: {out[:200]!r}")


def _health(server) -> int:
    return httpx.get(server.url + "/health", timeout=WAIT_S).status_code


def test_an_idle_connection_is_closed(server):
    with _connect(server) as s:
        assert _read_until_closed(s) == b""
    assert _health(server) == 200


def test_a_slowloris_sender_is_closed(server):
    """Header bytes keep coming, one line every 0.2 s: the deadline is not pushed back."""
    with _connect(server) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        s.settimeout(0.2)
        closed = False
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and not closed:
            try:
                s.sendall(b"X-Slow: 1\r\n")
                closed = s.recv(1) == b""
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
        assert closed, "the slow sender was never cut off"
    assert _health(server) == 200


def test_a_partial_body_gets_408_and_is_closed(server):
    with _connect(server) as s:
        s.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n" + b'{"text": '
        )
        reply = _read_until_closed(s)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"--http-body-timeout" in reply
    assert _health(server) == 200


def test_connections_over_the_cap_get_503(server):
    held = []
    try:
        for _ in range(MAX_CONNECTIONS):  # each one answered once, then idle (keep-alive)
            s = _connect(server)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
            held.append(s)
        with _connect(server) as extra:
            reply = _read_until_closed(extra)
        assert reply.startswith(b"HTTP/1.1 503") and b"--max-connections" in reply
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + WAIT_S
    while True:  # the server notices the closed sockets
        try:
            if _health(server) == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert "--max-connections" in server.log()


def _some_got_503(sockets: list[socket.socket]) -> bool:
    """Whether any of `sockets` was answered 503 (polled without blocking, up to WAIT_S)."""
    for s in sockets:
        s.setblocking(False)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for s in sockets:
            try:
                if s.recv(64).startswith(b"HTTP/1.1 503"):
                    return True
            except (BlockingIOError, ConnectionResetError):
                pass
        time.sleep(0.1)
    return False


def _low_open_file_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))


OPEN_FILES = 256


def test_a_flood_at_the_open_file_limit_is_refused_not_fatal(tok_dir, tmp_path):
    """The default cap stays below the open-file limit: a flood of sockets is answered 503
    beyond it (one log line per 10 s, no traceback), and /health answers once it stops."""
    args = ["--model-path", str(tok_dir)]
    srv = start_server(args, tmp_path / "server.log", fake=True, preexec_fn=_low_open_file_limit)
    sockets = []
    try:
        for _ in range(2 * OPEN_FILES):
            sockets.append(socket.create_connection(("127.0.0.1", srv.port), timeout=5))
        assert _some_got_503(sockets), "no connection was refused over the cap"
        for s in sockets:
            s.close()
        sockets = []
        deadline = time.monotonic() + 30
        while True:
            try:
                if _health(srv) == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, srv.log()[-2000:]
            time.sleep(0.2)
        assert srv.proc.poll() is None
        log = srv.log()
    finally:
        for s in sockets:
            s.close()
        srv.stop()
    warnings = [line for line in log.splitlines() if "sglite.server.connections" in line]
    assert any("refused a connection" in line for line in warnings)
    assert len(warnings) <= 8, log[-3000:]  # one line per kind every 10 s
    assert "Traceback" not in log and "Too many open files" not in log


def test_default_cap_leaves_descriptors_for_the_server():
    assert default_max_connections(256, in_use=30) == 256 - 30 - (3 * 16 + 32)
    assert default_max_connections(1024, in_use=60) == 1024 - 60 - (3 * 64 + 32)
    assert default_max_connections(1 << 16, in_use=60) == 4096
    assert default_max_connections(100, in_use=60) == 1


def test_throttle_filter_makes_a_flood_one_line(caplog):
    log = logging.getLogger("test.throttle")
    log.addFilter(ThrottleFilter(interval_s=60))
    try:
        with caplog.at_level(logging.WARNING, logger="test.throttle"):
            for i in range(100):
                try:
                    raise OSError(24, "Too many open files")
                except OSError:
                    log.exception("socket.accept() out of system resource\nsocket: fd %d", i)
    finally:
        log.filters.clear()
    assert len(caplog.records) == 1
    assert caplog.records[0].exc_info is None  # an OS error: no traceback
    assert "Too many open files" in caplog.records[0].getMessage()
    throttle = LogThrottle(interval_s=0)
    assert throttle.allow("k") == (True, 0) and throttle.allow("k") == (True, 0)
