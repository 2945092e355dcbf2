"""Process lifecycle of the server (with the model-free fake scheduler): clean shutdown on
SIGTERM / Ctrl-C, a dying child takes the server down, start-up failures exit non-zero with
the reason, and nothing is left behind (processes, IPC files)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from fixtures.serving import (
    build_tiny_tokenizer,
    child_env,
    descendants,
    free_port,
    start_server,
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def _gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _ipc_dirs(tmp) -> list:
    return [p for p in tmp.iterdir() if p.name.startswith("sglite-")]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_shuts_down_cleanly(tok_dir, tmp_path, sig):
    srv = start_server(
        ["--model-path", str(tok_dir)], tmp_path / "log", fake=True, tmpdir=tmp_path, timeout=120
    )
    children = descendants(srv.proc.pid)
    assert len(children) >= 2 and _ipc_dirs(tmp_path)
    assert srv.stop(sig) == 0, srv.log()
    assert _gone(children), f"orphans left: {children}"
    assert _ipc_dirs(tmp_path) == []
    assert "Traceback" not in srv.log()


def test_dead_child_takes_the_server_down(tok_dir, tmp_path):
    srv = start_server(
        ["--model-path", str(tok_dir)], tmp_path / "log", fake=True, tmpdir=tmp_path, timeout=120
    )
    children = descendants(srv.proc.pid)
    try:
        r = httpx.post(srv.url + "/generate", json={"text": "__crash__"}, timeout=30)
        assert r.status_code == 503 and "scheduler process died" in r.text
    except httpx.HTTPError:
        pass  # the server may already be closing the connection
    assert srv.proc.wait(30) == 1
    assert "the scheduler process died (exit code 3)" in srv.log()
    assert _gone(children)
    assert _ipc_dirs(tmp_path) == []


def test_killed_server_leaves_no_orphans(tok_dir, tmp_path):
    srv = start_server(
        ["--model-path", str(tok_dir)], tmp_path / "log", fake=True, tmpdir=tmp_path, timeout=120
    )
    children = descendants(srv.proc.pid)
    srv.stop(signal.SIGKILL)
    assert _gone(children, timeout=15), "children outlived a SIGKILLed parent"
    assert _ipc_dirs(tmp_path) == []


def test_failed_start_prints_the_error_and_exits_nonzero(tmp_path):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "sglite.launch_server",
        "--model-path",
        str(tmp_path / "no-such-model"),
        "--port",
        str(port),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(tmp_path), timeout=120)
    assert proc.returncode != 0
    assert "failed to start" in proc.stderr or "exited with code" in proc.stderr, proc.stderr
    assert "no-such-model" in proc.stderr
    assert _ipc_dirs(tmp_path) == []


def test_port_in_use_fails_fast(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "sglite.launch_server",
            "--model-path",
            "x",
            "--port",
            str(port),
        ]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=child_env(tmp_path), timeout=60
        )
    assert proc.returncode != 0 and f"{port}" in proc.stderr and "--port" in proc.stderr


def test_help_lists_sglang_flags():
    out = subprocess.run(
        [sys.executable, "-m", "sglite.launch_server", "--help"],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=60,
    ).stdout
    for flag in (
        "--model-path",
        "--watchdog-timeout",
        "--tokenizer-path",
        "--host",
        "--port",
        "--dtype",
        "--context-length",
        "--page-size",
        "--max-total-tokens",
        "--mem-fraction-static",
        "--max-running-requests",
        "--max-prefill-tokens",
        "--chunked-prefill-size",
        "--schedule-policy",
        "--radix-eviction-policy",
        "--disable-radix-cache",
        "--disable-overlap-schedule",
        "--enable-mixed-chunk",
        "--attention-backend",
        "--tp-size",
        "--nnodes",
        "--node-rank",
        "--dist-init-addr",
        "--dist-timeout",
        "--log-level",
        "--served-model-name",
    ):
        assert flag in out, flag
    out2 = subprocess.run(
        [sys.executable, "-m", "sglite", "serve", "--help"],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=60,
    ).stdout
    assert "--model-path" in out2
