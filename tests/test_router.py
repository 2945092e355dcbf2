"""sglite servers as workers of SGLang's router (`sglang-router`, a test dependency, run
through its own CLI, `python -m sglang_router.launch_router`), all on 127.0.0.1.

Two real servers on the tiny random llama sit behind a `cache_aware` router: the router
registers them (health, /server_info, /model_info), forwards /generate and the OpenAI
routes (greedy answers equal a worker's own), reads /get_load, fans out /flush_cache, and
keeps requests that share a long prefix on one worker (counted by each worker's
`sglang:num_requests_total`; the sticky worker's prefix cache hits). Requests are sent one
at a time, so the router never sees a load imbalance and routes by prefix only. Last, one
worker shuts down: the router marks it unhealthy (health checks every second, one failure
is enough) and answers its prefix's requests with the other.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from fixtures.serving import (
    CHAT_TEMPLATE,
    ServerProc,
    child_env,
    descendants,
    free_port,
    start_server,
)

pytest.importorskip("sglang_router", reason="sglang-router is a test dependency (.[test])")

READY_TIMEOUT_S = 60
MODEL = "m"
GREEDY = {"temperature": 0, "ignore_eos": True}
# Two long prompt prefixes with nothing in common: the router's prefix match of a follow-up
# request is far above its cache threshold (0.3 of the text).
PREFIX_A = "The lighthouse keeper wrote in his log every evening: " + " ".join(
    f"wave {i} rolled in from the north sea," for i in range(8)
)
PREFIX_B = "Quarterly report of the orchard cooperative, " + " ".join(
    f"row {i} of apple trees gave {i + 3} crates;" for i in range(8)
)
PREFIX_C = "Minutes of the chess club meeting held on Tuesday: " + " ".join(
    f"board {i} opened with the queen's pawn," for i in range(8)
)


def start_router(workers: list[ServerProc], log_path: Path) -> ServerProc:
    """The router (run like a server process) over `workers`, once it reports every one of them healthy."""
    port = free_port()
    metrics_port = free_port()
    while metrics_port == port:
        metrics_port = free_port()
    cmd = [
        sys.executable, "-m", "sglang_router.launch_router",
        "--worker-urls", *[w.url for w in workers],
        "--policy", "cache_aware",
        "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
        "--log-level", "info",
    ]  # fmt: skip
    log = open(log_path, "wb")  # noqa: SIM115 - owned by the child
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(), start_new_session=True
    )
    router = ServerProc(proc, port, log_path)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}:\n{router.log()}")
        try:
            r = httpx.get(router.url + "/readiness", timeout=1)
            if r.status_code == 200 and r.json().get("healthy_workers") == len(workers):
                return router
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    router.stop()
    raise RuntimeError(f"router did not see {len(workers)} healthy workers:\n{router.log()}")


def worker_states(router: ServerProc) -> dict[str, dict]:
    workers = httpx.get(router.url + "/workers", timeout=10).json()["workers"]
    return {w["url"]: w for w in workers}


def num_requests(worker: ServerProc) -> int:
    """Finished requests of a worker, from its Prometheus counter."""
    text = httpx.get(worker.url + "/metrics", timeout=10).text
    match = re.search(r"^sglang:num_requests_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return int(float(match.group(1))) if match else 0


def counts(workers: list[ServerProc]) -> list[int]:
    return [num_requests(w) for w in workers]


def generate(url: str, text: str, max_new_tokens: int = 2) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, **GREEDY}}
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def send_group(router: ServerProc, workers: list[ServerProc], prefix: str, n: int) -> list[int]:
    """Send n requests sharing `prefix` one at a time; how many each worker answered."""
    before = counts(workers)
    for i in range(n):
        generate(router.url, f"{prefix} Entry {i}:")
    return [b - a for a, b in zip(before, counts(workers))]


def stop_all(router: ServerProc, workers: list[ServerProc]) -> None:
    """Stop the router and the workers; each exits 0 and leaves no process behind."""
    pids = [router.proc.pid, *descendants(router.proc.pid)]
    for w in workers:
        pids += descendants(w.proc.pid)
    assert router.stop() == 0, router.log()
    for w in workers:
        assert w.stop() == 0, w.log()
    deadline = time.monotonic() + 15
    while alive := [p for p in pids if _is_running(p)]:
        assert time.monotonic() < deadline, f"processes left: {alive}"
        time.sleep(0.1)


def _is_running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


# ---------------------------------------------------------------------- real engine
@pytest.fixture(scope="module")
def tiny_workers(tiny_model_dir, tmp_path_factory):
    model = str(tiny_model_dir("llama"))
    logs = tmp_path_factory.mktemp("router_workers")
    args = [
        "--model-path", model, "--served-model-name", MODEL,
        "--max-total-tokens", "4096", "--chat-template", CHAT_TEMPLATE, "--enable-metrics",
    ]  # fmt: skip
    workers = [start_server(args, logs / f"worker{i}.log", fake=False) for i in range(2)]
    yield workers
    for w in workers:
        w.stop()


@pytest.fixture(scope="module")
def router(tiny_workers, tmp_path_factory):
    router = start_router(tiny_workers, tmp_path_factory.mktemp("router") / "router.log")
    yield router
    stop_all(router, tiny_workers)


def test_worker_answers_the_routes_the_router_calls(tiny_workers):
    url = tiny_workers[0].url
    for new, old in [("/server_info", "/get_server_info"), ("/model_info", "/get_model_info")]:
        a, b = httpx.get(url + new, timeout=10), httpx.get(url + old, timeout=10)
        assert a.status_code == b.status_code == 200
        assert a.json().keys() == b.json().keys()
    info = httpx.get(url + "/model_info", timeout=10).json()
    assert info["model_type"] == "llama" and info["architectures"] == ["LlamaForCausalLM"]
    assert info["is_generation"] is True
    load = httpx.get(url + "/get_load", timeout=10).json()
    assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]


def test_router_registers_the_workers(router, tiny_workers):
    states = worker_states(router)
    assert set(states) == {w.url for w in tiny_workers}
    for w in states.values():
        assert w["is_healthy"] and w["model_id"] == MODEL, w
        meta = w["metadata"]
        assert meta["served_model_name"] == MODEL and meta["model_type"] == "llama", meta
    loads = httpx.get(router.url + "/get_loads", timeout=10).json()["workers"]
    assert sorted(x["worker"] for x in loads) == sorted(states)
    assert all(x["load"] >= 0 for x in loads), loads  # -1 means /get_load failed


def test_generate_through_the_router_is_the_engine_answer(router, tiny_workers):
    prompt = "The river town woke slowly"
    routed = generate(router.url, prompt, max_new_tokens=8)
    direct = generate(tiny_workers[0].url, prompt, max_new_tokens=8)
    assert routed["output_ids"] == direct["output_ids"] and len(routed["output_ids"]) == 8
    assert routed["text"] == direct["text"]
    assert routed["meta_info"]["finish_reason"] == {"type": "length", "length": 8}

    body = {"text": prompt, "stream": True, "sampling_params": {"max_new_tokens": 8, **GREEDY}}
    with httpx.stream("POST", router.url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [x[len("data: ") :] for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    assert json.loads(lines[-2])["output_ids"] == direct["output_ids"]


def test_openai_routes_through_the_router(router):
    from openai import OpenAI

    client = OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=60)
    assert MODEL in [m.id for m in client.models.list().data]
    done = client.completions.create(
        model=MODEL, prompt="Fishermen pulled their boats", max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert done.usage.completion_tokens == 5 and done.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4,
        temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert chat.usage.completion_tokens == 4 and isinstance(chat.choices[0].message.content, str)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4,
        temperature=0, extra_body={"ignore_eos": True}, stream=True,
    )  # fmt: skip
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == chat.choices[0].message.content


def test_shared_prefix_sticks_to_one_worker(router, tiny_workers):
    cached_before = [_stat(w, "num_cached_tokens_total") for w in tiny_workers]
    n = 5
    for prefix in (PREFIX_A, PREFIX_B):
        per_worker = send_group(router, tiny_workers, prefix, n)
        assert sorted(per_worker) == [0, n], (prefix[:20], per_worker)
    # the sticky worker reused the prefix: each follow-up hit the engine's prefix cache
    cached = [_stat(w, "num_cached_tokens_total") - c for w, c in zip(tiny_workers, cached_before)]
    assert sum(cached) >= 2 * (n - 1) * 100, cached


def test_flush_cache_through_the_router(router, tiny_workers):
    r = httpx.post(router.url + "/flush_cache", timeout=30)
    assert r.status_code == 200 and r.json()["workers_flushed"] == len(tiny_workers), r.text


def _stat(worker: ServerProc, key: str) -> int:
    return int(httpx.get(worker.url + "/get_server_info", timeout=10).json()[key])


# ---------------------------------------------------------------------- a worker goes away
# Last in the module: it stops one of the module's workers.
def test_router_survives_a_worker_shutdown(router, tiny_workers):
    per_worker = send_group(router, tiny_workers, PREFIX_C, 3)
    assert sorted(per_worker) == [0, 3], per_worker
    dead, live = tiny_workers if per_worker[0] else tiny_workers[::-1]

    assert dead.stop() == 0, dead.log()
    deadline = time.monotonic() + READY_TIMEOUT_S
    while worker_states(router).get(dead.url, {}).get("is_healthy", False):
        assert time.monotonic() < deadline, router.log()
        time.sleep(0.2)

    before = num_requests(live)
    for i in range(3):  # the dead worker's prefix now goes to the live one
        generate(router.url, f"{PREFIX_C} Entry {i}:")
    generate(router.url, f"{PREFIX_A} Entry 0:")
    assert num_requests(live) - before == 4
    assert router.proc.poll() is None and worker_states(router)[live.url]["is_healthy"]
