"""KV-cache events through a real server on a tiny model: `--kv-events-config` publishes the
blocks of finished requests (their prompt pages at least), and /flush_cache clears them.

The subscriber follows the stream by replay, so it never depends on when its SUB socket
joined; a request's events are published at the end of the scheduler step that released it,
which may come a moment after the HTTP answer, hence a bounded wait for each expected state.
"""

from __future__ import annotations

import json
import tempfile
import time

import httpx

from fixtures.kv_subscriber import KvSubscriber, spec_hashes
from fixtures.serving import start_server

PAGE = 4
PROMPTS = [[5 + (7 * i) % 300 for i in range(n)] for n in (23, 30)]


def wait_for(sub: KvSubscriber, pred, timeout: float = 30.0) -> set[int]:
    deadline = time.monotonic() + timeout
    while True:
        sub.replay(max(sub.batches, default=-1) + 1)
        blocks = sub.blocks()
        if pred(blocks) or time.monotonic() > deadline:
            return blocks
        time.sleep(0.1)


def test_server_publishes_kv_events(tiny_model_dir, tmp_path_factory):
    d = tempfile.mkdtemp(prefix="kv")
    cfg = {"publisher": "zmq", "endpoint": f"ipc://{d}/pub", "replay_endpoint": f"ipc://{d}/rep"}
    log = tmp_path_factory.mktemp("log") / "server.log"
    srv = start_server(
        ["--model-path", str(tiny_model_dir("llama")), "--max-total-tokens", "2048",
         "--page-size", str(PAGE), "--kv-events-config", json.dumps(cfg)],
        log,
        fake=False,
        timeout=300,
    )  # fmt: skip
    sub = KvSubscriber(cfg["endpoint"], cfg["replay_endpoint"])
    try:
        seqs = []
        for prompt in PROMPTS:
            r = httpx.post(
                srv.url + "/generate",
                json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 6}},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            seqs.append(prompt + r.json()["output_ids"])
        least = {h for p in PROMPTS for h in spec_hashes(p, PAGE)}
        most = {h for s in seqs for h in spec_hashes(s, PAGE)}
        blocks = wait_for(sub, lambda b: least <= b)
        assert least <= blocks <= most, srv.log()

        assert httpx.post(srv.url + "/flush_cache", timeout=30).status_code == 200
        assert wait_for(sub, lambda b: not b) == set()
    finally:
        sub.close()
        assert srv.stop() == 0, srv.log()
