"""The admission wall: how long a short request waits behind long ones that fill the KV budget.

    python benches/admission_wall.py --url http://127.0.0.1:30000 [--long 12] [--long-tokens 8000]
        [--settle 30] [--cap 180] [--out admission_wall.json]

Against a running server (start it with --prefill-lookahead-requests 0 for SGLang's rule, or
the default for sglite's): sends --long requests of --long-tokens new tokens with ignore_eos
(each reserves its whole clipped 4,096-token estimate, so the budget fills while most of the
pool is free), waits --settle seconds for them to be admitted, then sends one 8-token greedy
request and measures its latency (capped at --cap seconds), and the server's running/waiting
counts and KV usage while it waited. Then aborts everything. Prints one summary line and
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.error
import urllib.request


def post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        data = resp.read()
    return json.loads(data) if data else {}


def server_state(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/get_server_info", timeout=30) as resp:
        info = json.loads(resp.read())
    keys = ("num_running_reqs", "num_waiting_reqs", "kv_usage", "num_bypassing_reqs")
    return {k: info.get(k) for k in keys} | {"lookahead": info.get("prefill_lookahead_requests")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--long", type=int, default=12)
    ap.add_argument("--long-tokens", type=int, default=8000)
    ap.add_argument("--settle", type=float, default=30.0)
    ap.add_argument("--cap", type=float, default=180.0)
    ap.add_argument("--out", default="admission_wall.json")
    a = ap.parse_args()

    def long_request(i: int) -> None:
        params = {"max_new_tokens": a.long_tokens, "ignore_eos": True, "temperature": 0}
        body = {
            "text": f"Story {i}: once upon a time",
            "sampling_params": params,
            "rid": f"long-{i}",
        }
        try:
            post(f"{a.url}/generate", body, timeout=3600)
        except (urllib.error.URLError, OSError):
            pass  # aborted at the end

    threads = [threading.Thread(target=long_request, args=(i,), daemon=True) for i in range(a.long)]
    for t in threads:
        t.start()
    time.sleep(a.settle)
    before = server_state(a.url)
    small = {"text": "The capital of France is", "rid": "short",
             "sampling_params": {"max_new_tokens": 8, "temperature": 0}}  # fmt: skip
    start = time.monotonic()
    done: dict = {}

    def short_request() -> None:
        try:
            done["out"] = post(f"{a.url}/generate", small, timeout=a.cap + 60)
        except (urllib.error.URLError, OSError) as e:
            done["error"] = str(e)
        done["wait_s"] = time.monotonic() - start

    t = threading.Thread(target=short_request, daemon=True)
    t.start()
    t.join(a.cap)
    during = server_state(a.url)
    wait = done.get("wait_s")
    post(f"{a.url}/abort_request", {"abort_all": True}, timeout=30)
    t.join(30)
    for th in threads:
        th.join(30)
    result = {
        "lookahead": before["lookahead"],
        "short_wait_s": wait,  # None: still waiting after --cap seconds
        "capped": wait is None,
        "cap_s": a.cap,
        "before": before,
        "while_waiting": during,
        "short_output_tokens": len(done.get("out", {}).get("output_ids", []) or []),
    }
    with open(a.out, "w") as f:
        json.dump(result, f)
    shown = f"{wait:.1f} s" if wait is not None else f"> {a.cap:.0f} s (capped)"
    print(
        f"lookahead {before['lookahead']}: the 8-token request waited {shown} behind "
        f"{a.long} x {a.long_tokens}-token ignore_eos requests (running "
        f"{before['num_running_reqs']}, waiting {before['num_waiting_reqs']}, KV usage "
        f"{(before['kv_usage'] or 0) * 100:.1f}%)"
    )


if __name__ == "__main__":
    main()
