"""`--dp-size 2`: two scheduler replicas behind one server.

With the model-free fake scheduler: round_robin spreads requests, aborts (by prefix, all)
and /flush_cache reach every replica, /get_server_info lists each replica and their sum,
/metrics gauges sum over replicas, a dying replica takes the server down with a message
naming it, and a replica that fails to start fails the start-up. With the tiny model:
greedy answers equal transformers' on both replicas, and cache_aware routing sends prompts
sharing a long prefix to one replica (seen in its stats: requests and cached tokens).
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from fixtures.serving import build_tiny_tokenizer, start_server

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def fake_dp(tok_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    srv = start_server(
        ["--model-path", str(tok_dir), "--dp-size", "2", "--enable-metrics"],
        log,
        fake=True,
        timeout=120,
    )
    yield srv
    assert srv.stop() == 0, srv.log()


def info(srv) -> dict:
    r = httpx.get(srv.url + "/get_server_info", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def generate(srv, text: str, **sp) -> dict:
    r = httpx.post(srv.url + "/generate", json={"text": text, "sampling_params": sp}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(predicate, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def per_replica(srv, key: str) -> list:
    return [s[key] for s in info(srv)["internal_states"]]


def test_round_robin_spreads_and_info_has_each_replica_and_the_sum(fake_dp):
    before = per_replica(fake_dp, "num_finished_reqs")
    for i in range(4):
        out = generate(fake_dp, f"Hello world {i}", max_new_tokens=3)
        assert out["meta_info"]["completion_tokens"] == 3
    srv_info = info(fake_dp)
    replicas = srv_info["internal_states"]
    assert [s["dp_rank"] for s in replicas] == [0, 1]
    assert [s["num_finished_reqs"] - b for s, b in zip(replicas, before)] == [2, 2]
    assert srv_info["dp_size"] == 2 and srv_info["load_balance_method"] == "round_robin"
    for key in ("num_finished_reqs", "num_prompt_tokens_total", "num_routed_reqs"):
        assert srv_info[key] == sum(s[key] for s in replicas), key
    assert srv_info["max_total_num_tokens"] > 0 and "dp_rank" not in srv_info


def _held(srv, rids: list[str], pool) -> list:
    """Send "__hold__" requests (each waits on its replica until aborted); returns futures
    once every one is queued. Round robin puts consecutive ones on different replicas."""
    futures = []
    for rid in rids:
        body = {"rid": rid, "text": "__hold__", "sampling_params": {"max_new_tokens": 4}}
        futures.append(pool.submit(httpx.post, srv.url + "/generate", json=body, timeout=60))
        wait_for(lambda n=len(futures): info(srv)["num_waiting_reqs"] == n, "queued")
    assert per_replica(srv, "num_waiting_reqs") == [1] * len(rids)
    return futures


@pytest.mark.parametrize("abort_all", [False, True], ids=["prefix", "all"])
def test_abort_and_flush_reach_every_replica(fake_dp, abort_all):
    flushes = per_replica(fake_dp, "num_flushes")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = _held(fake_dp, ["grp_a", "grp_b"], pool)
        # one replica is busy: the flush is refused, and says which replica refused
        r = httpx.post(fake_dp.url + "/flush_cache", timeout=30)
        assert r.status_code == 400 and "2 of 2 replicas did not flush" in r.text
        body = {"abort_all": True} if abort_all else {"rid": "grp"}
        assert httpx.post(fake_dp.url + "/abort_request", json=body, timeout=30).status_code == 200
        for f in futures:
            reason = f.result().json()["meta_info"]["finish_reason"]
            assert reason["type"] == "abort"
    wait_for(lambda: per_replica(fake_dp, "num_waiting_reqs") == [0, 0], "aborted")
    r = httpx.post(fake_dp.url + "/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
    assert [n - b for n, b in zip(per_replica(fake_dp, "num_flushes"), flushes)] == [1, 1]


def test_metrics_gauges_sum_over_replicas(fake_dp):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = _held(fake_dp, ["m_a", "m_b"], pool)
        text = httpx.get(fake_dp.url + "/metrics", timeout=30).text
        httpx.post(fake_dp.url + "/abort_request", json={"rid": "m_"}, timeout=30)
        for f in futures:
            f.result()
    assert 'sglang:num_queue_reqs{model_name="' in text
    line = next(x for x in text.splitlines() if x.startswith("sglang:num_queue_reqs{"))
    assert float(line.rsplit(" ", 1)[1]) == 2.0


def test_a_dying_replica_takes_the_server_down_naming_it(tok_dir, tmp_path):
    srv = start_server(
        ["--model-path", str(tok_dir), "--dp-size", "2"], tmp_path / "log", fake=True, timeout=120
    )
    try:
        generate(srv, "Hello", max_new_tokens=2)  # replica 0; the next one goes to replica 1
        try:
            httpx.post(srv.url + "/generate", json={"text": "__crash__"}, timeout=30)
        except httpx.HTTPError:
            pass  # the server may already be closing the connection
        assert srv.proc.wait(30) == 1
    finally:
        srv.stop()
    assert "the scheduler process of data-parallel replica 1 died (exit code 3)" in srv.log()


def test_a_replica_that_fails_to_start_fails_the_start_up(tok_dir, tmp_path):
    with pytest.raises(RuntimeError) as e:
        start_server(
            ["--model-path", str(tok_dir), "--dp-size", "2"],
            tmp_path / "log",
            fake=True,
            timeout=120,
            env={"SGLITE_FAKE_FAIL_DP_RANK": "1"},
        )
    log = str(e.value)
    assert "server exited with 1" in log
    assert "the scheduler process of data-parallel replica 1 failed to start" in log
    assert "fake: replica 1 fails" in log


# ---------------------------------------------------------------------- tiny model
def _hf_greedy(model_dir, ids: list[int], steps: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    from fixtures.model_driver import hf_greedy

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf_greedy(model, ids, steps)[0]


def test_server_dp2_round_robin_matches_transformers(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama")
    srv = start_server(
        ["--model-path", str(model_dir), "--dp-size", "2", "--max-total-tokens", "4096"],
        tmp_path / "log",
        fake=False,
        timeout=300,
    )
    try:
        prompts = [[11, 22, 33, 44, 55, 66], [101, 102, 103, 104, 105]]
        outs = []
        for ids in prompts:  # round robin: replica 0, then replica 1
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, **GREEDY}}
            r = httpx.post(srv.url + "/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text
            outs.append(r.json()["output_ids"])
        assert outs == [_hf_greedy(model_dir, ids, 6) for ids in prompts]
        srv_info = info(srv)
        replicas = srv_info["internal_states"]
        assert [s["num_finished_reqs"] for s in replicas] == [1, 1]
        assert [s["kv_total_tokens"] for s in replicas] == [4096, 4096]
        assert srv_info["kv_total_tokens"] == 8192 and srv_info["num_finished_reqs"] == 2
        assert httpx.post(srv.url + "/flush_cache", timeout=30).status_code == 200
    finally:
        assert srv.stop() == 0, srv.log()


def test_engine_dp2_cache_aware_keeps_a_prefix_on_one_replica(tiny_model_dir):
    """Two groups of prompts, each sharing a 99-token prefix, arrive a0 a1 b0 b1 a2 b2 a3
    b3: cache_aware puts each group on its own replica, so each replica computes its
    group's prefix once (round robin would put a0, b0, a2, b2 on replica 0)."""
    import random

    import sglite

    model_dir = tiny_model_dir("llama")
    rng = random.Random(0)
    prefix = {g: [rng.randrange(10, 380) for _ in range(96)] + [1, 2, 3] for g in "ab"}
    order = ["a0", "a1", "b0", "b1", "a2", "b2", "a3", "b3"]
    greedy = {"max_new_tokens": 4, **GREEDY}
    with sglite.Engine(
        model_path=str(model_dir),
        dp_size=2,
        load_balance_method="cache_aware",
        max_total_tokens=4096,
        log_level="warning",
    ) as engine:
        outs = {
            name: engine.generate(
                input_ids=prefix[name[0]] + [200 + int(name[1])], sampling_params=greedy
            )
            for name in order
        }
        replicas = engine._call(engine.tm.get_replica_stats())
    assert [s["num_finished_reqs"] for s in replicas] == [4, 4]
    # each replica: the 3 later prompts of its group hit the 99-token prefix
    assert all(s["num_cached_tokens_total"] >= 3 * 99 for s in replicas), replicas
    assert [outs[n]["meta_info"]["cached_tokens"] for n in order[:3]] == [0, 99, 0]
    for name in ("a0", "b0"):  # one answer from each replica
        ids = prefix[name[0]] + [200]
        assert outs[name]["output_ids"] == _hf_greedy(model_dir, ids, 4)
