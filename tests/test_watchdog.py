"""The scheduler watchdog: the stall decision (fake clock), the thread that acts on it, the
default action (log, stacks, exit code), the Scheduler's phase reports, /health while a step
is stuck, the heartbeat crossing into a spawned scheduler, and a hung scheduler taking the
server down."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from fixtures.backends import load_backend
from fixtures.sched import Harness
from fixtures.serving import build_tiny_tokenizer, child_env, descendants, start_server
from sglite.cli import build_parser
from sglite.config import ServerArgs
from sglite.ipc import IpcNames
from sglite.launcher import ProcessGroup, death_reason
from sglite.messages import ReadyMsg
from sglite.scheduler.watchdog import (
    WATCHDOG_EXIT_CODE,
    Heartbeat,
    NullWatchdog,
    Watchdog,
    stall_threshold,
)
from sglite.scheduler.worker import NullWorker
from sglite.server.http_server import create_app
from sglite.server.tokenizer_manager import TokenizerManager


class FakeClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _never(activity: str, stalled_s: float) -> None:
    raise AssertionError(f"on_timeout called for {activity!r}")


# ---------------------------------------------------------------------- decision
def test_idle_is_never_stalled():
    clock = FakeClock()
    wd = Watchdog(10, clock=clock, on_timeout=_never)
    for now in (0.0, 10.0, 1e6):
        assert wd.check(now) is None and wd.stalled_for(now) == 0.0


def test_busy_stalls_after_the_timeout():
    clock = FakeClock(100.0)
    wd = Watchdog(10, clock=clock, on_timeout=_never)
    wd.busy("forward: decode 12 reqs")
    assert wd.stalled_for(105.0) == 5.0
    assert wd.check(109.9) is None
    assert wd.check(110.0) == ("forward: decode 12 reqs", 10.0)
    assert wd.check(250.0) == ("forward: decode 12 reqs", 150.0)


def test_a_new_phase_restarts_the_clock_and_idle_clears_it():
    clock = FakeClock(0.0)
    wd = Watchdog(10, clock=clock, on_timeout=_never)
    wd.busy("scheduling")
    clock.now = 8.0
    wd.busy("forward: prefill 3 reqs")  # progress: the scheduling pass ended in time
    assert wd.check(12.0) is None and wd.stalled_for(12.0) == 4.0
    assert wd.check(18.0) == ("forward: prefill 3 reqs", 10.0)
    wd.idle()
    assert wd.check(1000.0) is None and wd.stalled_for(1000.0) == 0.0
    clock.now = 1000.0
    wd.busy("processing results")
    assert wd.check(1009.0) is None and wd.check(1010.0) == ("processing results", 10.0)


def test_heartbeat_follows_busy_and_idle():
    clock, hb = FakeClock(0.0), Heartbeat()
    wd = Watchdog(10, clock=clock, heartbeat=hb, on_timeout=_never)
    assert hb.busy_for(50.0) == 0.0  # idle from the start
    wd.busy("scheduling")  # at t=0: 0 is a valid timestamp, not "idle"
    assert hb.busy_for(3.0) == 3.0
    clock.now = 5.0
    wd.busy("forward: decode 1 reqs")
    assert hb.busy_for(6.0) == 1.0
    wd.idle()
    assert hb.busy_for(1e6) == 0.0


def test_stall_threshold_is_the_health_check_timeout_at_most():
    assert stall_threshold(300) == 20.0
    assert stall_threshold(5) == 5
    assert stall_threshold(math.inf) == 20.0


def test_null_watchdog_accepts_the_calls():
    wd = NullWatchdog()
    wd.busy("scheduling")
    wd.idle()


# ---------------------------------------------------------------------- config
def test_watchdog_timeout_flag():
    assert ServerArgs().watchdog_timeout == 300
    args = ServerArgs.from_cli_args(build_parser().parse_args(["--watchdog-timeout", "1.5"]))
    assert args.watchdog_timeout == 1.5
    for bad in (0, -1, math.nan):
        with pytest.raises(ValueError, match="--watchdog-timeout: must be > 0"):
            ServerArgs(watchdog_timeout=bad)
    with pytest.raises(ValueError, match="> 0"):
        Watchdog(0)


def test_death_reason_names_the_watchdog():
    args = ServerArgs(watchdog_timeout=7)
    reason = death_reason("scheduler", WATCHDOG_EXIT_CODE, args)
    assert "watchdog" in reason and "--watchdog-timeout (7 s)" in reason
    assert death_reason("scheduler", 3, args) == "the scheduler process died (exit code 3)"
    assert "watchdog" not in death_reason("detokenizer", WATCHDOG_EXIT_CODE, args)


# ---------------------------------------------------------------------- thread
def test_thread_calls_on_timeout_with_the_activity():
    fired = threading.Event()
    calls: list[tuple[str, float]] = []

    def on_timeout(activity: str, stalled_s: float) -> None:
        calls.append((activity, stalled_s))
        fired.set()

    wd = Watchdog(0.2, on_timeout=on_timeout, poll_s=0.02).start()
    release = threading.Event()

    def step() -> None:  # a forward that never returns (until the test releases it)
        wd.busy("forward: decode 12 reqs")
        release.wait(120)
        wd.idle()

    stepper = threading.Thread(target=step, daemon=True)
    stepper.start()
    try:
        assert fired.wait(60), "the watchdog never fired"
    finally:
        release.set()
        stepper.join(60)
    wd.stop()  # the thread ended after firing once
    assert len(calls) == 1
    activity, stalled_s = calls[0]
    assert activity == "forward: decode 12 reqs" and stalled_s >= 0.2


def test_default_action_logs_dumps_stacks_and_exits_with_the_watchdog_code():
    script = (
        "import logging, time\n"
        "from sglite.scheduler.watchdog import Watchdog\n"
        "logging.basicConfig()\n"
        "wd = Watchdog(0.2).start()\n"
        "def stuck_forward():\n"
        "    wd.busy('forward: stuck on purpose')\n"
        "    time.sleep(120)\n"
        "stuck_forward()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=child_env(), timeout=120
    )
    assert proc.returncode == WATCHDOG_EXIT_CODE, proc.stderr
    assert "'forward: stuck on purpose'" in proc.stderr
    assert "--watchdog-timeout 0.2" in proc.stderr
    assert "most recent call first" in proc.stderr  # faulthandler's dump...
    assert "in stuck_forward" in proc.stderr  # ...shows where the main thread is stuck


# ---------------------------------------------------------------------- Scheduler
class RecordingWatchdog(NullWatchdog):
    def __init__(self) -> None:
        self.calls: list[str | None] = []  # activity, or None for idle()

    def busy(self, activity: str) -> None:
        self.calls.append(activity)

    def idle(self) -> None:
        self.calls.append(None)


LOOPS = pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])


@LOOPS
def test_scheduler_reports_each_phase_and_ends_idle(overlap):
    h = Harness(load_backend("python"), disable_overlap_schedule=not overlap)
    h.sched.watchdog = rec = RecordingWatchdog()
    h.add("a", [1, 2, 3, 4], max_new_tokens=3)
    h.add("b", [5, 6], max_new_tokens=2)
    h.run()
    calls = rec.calls
    assert calls[0] == "scheduling" and calls[-1] is None
    assert calls.count("scheduling") == calls.count(None)  # every step ends idle
    assert any(str(c).startswith("forward of extend batch of 2 requests, ") for c in calls)
    assert any(
        str(c).startswith("processing the result of extend batch of 2 requests, ") for c in calls
    )
    assert any(c is not None and c.startswith("forward of decode batch") for c in calls)


class BlockingWorker(NullWorker):
    """A forward that hangs until the test releases it."""

    def __init__(self) -> None:
        super().__init__(1000)
        self.unblock = threading.Event()

    def run(self, fi):
        self.unblock.wait(120)
        return super().run(fi)


@LOOPS
def test_a_hung_forward_fires_the_watchdog_with_its_activity(overlap):
    worker = BlockingWorker()
    h = Harness(load_backend("python"), worker=worker, disable_overlap_schedule=not overlap)
    fired = threading.Event()
    calls: list[str] = []

    def on_timeout(activity: str, stalled_s: float) -> None:
        calls.append(activity)
        fired.set()

    # 1 s: far above any real phase of this tiny workload, so only the hung forward fires it
    h.sched.watchdog = wd = Watchdog(1.0, on_timeout=on_timeout, poll_s=0.05).start()
    h.add("a", [1, 2, 3], max_new_tokens=2)
    runner = threading.Thread(target=h.run, daemon=True)
    runner.start()
    try:
        assert fired.wait(60), "the watchdog never fired"
    finally:
        worker.unblock.set()
        runner.join(60)
    wd.stop()
    assert len(calls) == 1 and calls[0].startswith("forward of extend batch of 1 requests, ")
    assert h.results()["a"]["finish"] is not None  # released, the request completed


# ---------------------------------------------------------------------- /health
def _health_client(heartbeat: Heartbeat, watchdog_timeout: float = 300) -> TestClient:
    args = ServerArgs(model_path="m", watchdog_timeout=watchdog_timeout)
    tm = TokenizerManager(
        args, {"context_length": 16, "vocab_size": 10}, None, None, heartbeat=heartbeat
    )
    return TestClient(create_app(tm))  # no lifespan: /health needs no sockets


def test_health_is_503_while_a_step_is_stuck():
    hb = Heartbeat()
    client = _health_client(hb)  # threshold: min(300, 20) = 20 s
    assert client.get("/health").status_code == 200  # idle
    hb.beat(time.monotonic() - 5)
    assert client.get("/health").status_code == 200  # busy, but not for long
    hb.beat(time.monotonic() - 100)
    r = client.get("/health")
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == 503 and err["type"] == "server_error"
    assert "no progress" in err["message"] and "20 s" in err["message"]
    hb.rest()
    assert client.get("/health").status_code == 200  # the step ended: healthy again


def test_health_threshold_follows_a_short_watchdog_timeout():
    hb = Heartbeat()
    client = _health_client(hb, watchdog_timeout=2)
    hb.beat(time.monotonic() - 5)
    assert client.get("/health").status_code == 503


def test_health_sees_the_watchdogs_heartbeat():
    hb = Heartbeat()
    client = _health_client(hb)
    wd = Watchdog(300, heartbeat=hb, clock=lambda: time.monotonic() - 60, on_timeout=_never)
    wd.busy("forward: decode 1 reqs")  # started "60 s ago"
    assert client.get("/health").status_code == 503
    wd.idle()
    assert client.get("/health").status_code == 200


# ---------------------------------------------------------------------- processes
def _beating_scheduler(server_args, ipc, ready_conn, heartbeat) -> None:
    heartbeat.beat(12.5)
    ready_conn.send(ReadyMsg("scheduler", True, info={}))
    time.sleep(600)  # stopped by ProcessGroup.shutdown


def _idle_child(server_args, ipc, ready_conn) -> None:
    ready_conn.send(ReadyMsg("detokenizer", True))
    time.sleep(600)


def test_process_group_shares_the_heartbeat_with_the_scheduler():
    ipc = IpcNames.allocate()
    group = ProcessGroup(
        ServerArgs(log_level="warning"),
        ipc,
        scheduler_entry=_beating_scheduler,
        detokenizer_entry=_idle_child,
    )
    try:
        group.start()
        assert group.heartbeat.busy_for(20.0) == 7.5  # written in the child, read here
    finally:
        group.shutdown()
        ipc.cleanup()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def test_hung_scheduler_takes_the_server_down_naming_the_watchdog(tok_dir, tmp_path):
    srv = start_server(
        ["--model-path", str(tok_dir), "--watchdog-timeout", "1"],
        tmp_path / "log",
        fake=True,
        tmpdir=tmp_path,
        timeout=120,
    )
    children = descendants(srv.proc.pid)
    try:
        r = httpx.post(srv.url + "/generate", json={"text": "__hang__"}, timeout=60)
        assert r.status_code == 503 and "watchdog" in r.text
    except httpx.HTTPError:
        pass  # the server may already be closing the connection
    assert srv.proc.wait(60) == 1
    log = srv.log()
    assert "the scheduler process was stopped by its watchdog" in log
    assert "--watchdog-timeout (1 s)" in log
    assert "'fake: hanging on purpose'" in log  # what it was doing...
    assert "most recent call first" in log  # ...and the stacks of its threads
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_alive(p) for p in children):
        time.sleep(0.1)
    assert not any(_alive(p) for p in children), "children outlived the server"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("sglite-")]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
