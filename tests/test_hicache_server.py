"""HiCache through the real server on the tiny llama: the flags (SGLang's alias included)
start it, the log says so with the sizes, a prompt evicted from the small device pool comes
back from the host (same greedy answer), /get_server_info splits hit tokens by tier and
/metrics has SGLang's HiCache names."""

from __future__ import annotations

import random
import re

import httpx
import pytest

from fixtures.serving import start_server


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from sglite.core import radix_tree

    if not hasattr(radix_tree.RadixTree, "match_prefix_host"):
        pytest.skip("the python tree core has no host tier yet")
    log = tmp_path_factory.mktemp("log") / "server.log"
    files = tmp_path_factory.mktemp("kv-files")
    srv = start_server(
        [
            "--model-path", str(tiny_model_dir("llama")), "--max-total-tokens", "256",
            "--enable-hicache", "--hicache-ratio", "4", "--hicache-storage-backend", "file",
            "--hicache-storage-dir", str(files), "--enable-metrics", "--debug-invariants",
        ],
        log,
        fake=False,
        timeout=300,
    )  # fmt: skip
    yield srv
    srv.stop()


def test_evicted_prompt_comes_back_from_the_host(server):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 384) for _ in range(150)] for _ in range(3)]
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=120) as c:

        def generate(ids):
            r = c.post("/generate", json={"input_ids": ids, "sampling_params": params})
            assert r.status_code == 200, r.text
            return r.json()

        first = [generate(p) for p in prompts]  # each evicts the one before from the device
        again = generate(prompts[0])
        assert again["output_ids"] == first[0]["output_ids"]
        assert again["meta_info"]["cached_tokens"] >= 128
        info = c.get("/get_server_info").json()
        metrics = c.get("/metrics").text
    assert info["enable_hierarchical_cache"] is True
    assert info["host_hit_tokens"] >= 128 and info["num_load_back_tokens"] >= 128
    assert info["num_evicted_tokens"] > 0 and info["hicache_bytes_to_device"] > 0
    assert (
        info["device_hit_tokens"] + info["host_hit_tokens"] + info["storage_hit_tokens"]
        == (info["num_cached_tokens_total"])
    )
    assert info["hicache_host_total_tokens"] == 1024
    for name in ("hicache_host_used_tokens", "hicache_host_total_tokens"):
        assert re.search(rf"^sglang:{name}\{{.*\}} [0-9.e+]+$", metrics, re.M), name
    for name in ("evicted_tokens_total", "load_back_tokens_total"):
        value = re.search(rf"^sglang:{name}\{{.*\}} ([0-9.e+]+)$", metrics, re.M)
        assert value and float(value.group(1)) > 0, name
    assert re.search(r"HiCache on: host pool 1024 tokens \(.* GiB\)", server.log())
