"""The data-parallel dispatcher without a model: load-balancing policies, routing and
in-flight counts, and the merge of the replicas' stats and flush replies."""

from __future__ import annotations

import pytest
import zmq

from sglite.messages import AbortReq, FlushCacheResp, GenerateReq, GetStatsReq, StatsResp
from sglite.sampling_params import SamplingParams
from sglite.server.dp_dispatcher import Dispatcher, merge_flush, merge_stats
from sglite.server.load_balance import (
    IMBALANCE_LIMIT,
    PREFIX_BLOCK_LEN,
    CacheAware,
    PrefixIndex,
    RoundRobin,
    ShortestQueue,
    create_load_balancer,
    prefix_block_hashes,
)

SYSTEM = list(range(1000, 1000 + 4 * PREFIX_BLOCK_LEN))  # a 64-token shared prefix


def test_round_robin_cycles():
    rr = RoundRobin(3)
    assert [rr.choose([1], [0, 0, 0]) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_shortest_queue_picks_least_loaded_lowest_index_on_ties():
    sq = ShortestQueue(3)
    assert sq.choose([1], [2, 1, 1]) == 1
    assert sq.choose([1], [0, 0, 0]) == 0
    assert sq.choose([1], [5, 4, 3]) == 2


def test_block_hashes_are_chained_and_skip_the_partial_block():
    a = prefix_block_hashes(SYSTEM + [1, 2, 3])
    b = prefix_block_hashes(SYSTEM + [9] * PREFIX_BLOCK_LEN)
    assert len(a) == 4 and len(b) == 5 and a == b[:4]
    # the same block after a different prefix hashes differently
    c = prefix_block_hashes([7] * PREFIX_BLOCK_LEN + SYSTEM[:PREFIX_BLOCK_LEN])
    assert prefix_block_hashes(SYSTEM[:PREFIX_BLOCK_LEN])[0] != c[1]
    assert prefix_block_hashes(list(range(PREFIX_BLOCK_LEN - 1))) == []


def test_prefix_index_matches_leading_blocks_and_forgets_lru():
    index = PrefixIndex(capacity=4)
    h = prefix_block_hashes(SYSTEM)
    index.insert(h[:3])
    assert index.match_len(h) == 3
    assert index.match_len(prefix_block_hashes([4] + SYSTEM)) == 0  # shifted: no match
    other = prefix_block_hashes([5] * 2 * PREFIX_BLOCK_LEN)
    index.insert(other)  # 5 blocks > capacity 4: the least recently used one goes
    assert len(index) == 4 and index.match_len(h) == 0


def test_cache_aware_sends_a_shared_prefix_to_one_replica():
    ca = CacheAware(2, kv_capacity=1 << 14)
    loads = [0, 0]
    first = ca.choose(SYSTEM + [1, 2], loads)
    loads[first] += 1
    # a different prompt goes to the less loaded replica
    other = ca.choose([3] * 40, loads)
    assert other != first
    loads[other] += 1
    for i in range(6):  # later prompts sharing the system prompt follow the first
        idx = ca.choose(SYSTEM + [i] * 20, loads)
        assert idx == first
        loads[idx] += 1


def test_cache_aware_gives_up_affinity_when_the_replica_is_overloaded():
    ca = CacheAware(2)
    assert ca.choose(SYSTEM, [0, 0]) == 0
    assert ca.choose(SYSTEM, [IMBALANCE_LIMIT, 0]) == 0
    assert ca.choose(SYSTEM, [IMBALANCE_LIMIT + 1, 0]) == 1
    # now both replicas have seen it: the less loaded one wins
    assert ca.choose(SYSTEM, [3, 2]) == 1


def test_cache_aware_spreads_distinct_prefixes_when_idle():
    ca = CacheAware(2)
    a, b = SYSTEM, [7] * len(SYSTEM)
    order = [a, b, a + [1], b + [1], a + [2], b + [2]]
    assert [ca.choose(p, [0, 0]) for p in order] == [0, 1, 0, 1, 0, 1]


def test_cache_aware_short_prompts_go_to_the_least_loaded():
    ca = CacheAware(3)
    assert ca.choose([1, 2, 3], [2, 0, 1]) == 1


def test_unknown_method_is_named():
    with pytest.raises(ValueError, match="--load-balance-method.*'nope'"):
        create_load_balancer("nope", 2)


def _req(rid: str, ids: list[int]) -> GenerateReq:
    return GenerateReq(rid, ids, SamplingParams())


def test_dispatcher_routes_generate_once_and_broadcasts_the_rest(tmp_path):
    ctx = zmq.Context()
    addrs = [f"ipc://{tmp_path}/s{i}" for i in range(2)]
    d = Dispatcher(addrs, ShortestQueue(2))
    d.bind(ctx)
    try:
        assert d.targets(_req("a", [1])) == [0]
        assert d.targets(_req("a", [1])) == [0]  # a retried send keeps its replica
        assert d.targets(_req("b", [1])) == [1]
        assert d.loads == [1, 1]
        assert d.targets(AbortReq("a", exact=True)) == [0, 1]
        assert d.targets(GetStatsReq()) == [0, 1]
        d.done("a")
        d.done("a")  # idempotent
        assert d.loads == [0, 1]
        assert d.targets(_req("c", [1])) == [0]
        stats = d.replica_stats([StatsResp({"x": 1}, dp_rank=1), StatsResp({"x": 2})])
        assert [(s["dp_rank"], s["x"], s["num_routed_reqs"]) for s in stats] == [
            (0, 2, 2),
            (1, 1, 1),
        ]
        assert stats[0]["num_inflight_reqs"] == 1
    finally:
        d.close()
        ctx.term()


def test_merge_stats_sums_counts_and_recomputes_ratios():
    a = {
        "num_running_reqs": 2,
        "num_prompt_tokens_total": 100,
        "num_cached_tokens_total": 80,
        "cache_hit_rate": 0.8,
        "kv_used_tokens": 10,
        "kv_total_tokens": 100,
        "kv_usage": 0.1,
        "uptime_s": 5.0,
        "tree_core": {"backend": "python"},
        "dp_rank": 0,
    }
    b = {**a, "num_running_reqs": 1, "num_cached_tokens_total": 0, "cache_hit_rate": 0.0}
    b.update(kv_used_tokens=50, kv_usage=0.5, uptime_s=7.0, dp_rank=1)
    m = merge_stats([a, b])
    assert m["num_running_reqs"] == 3 and m["num_prompt_tokens_total"] == 200
    assert m["cache_hit_rate"] == pytest.approx(0.4)
    assert m["kv_usage"] == pytest.approx(0.3) and m["kv_total_tokens"] == 200
    assert m["uptime_s"] == 7.0 and m["tree_core"] == {"backend": "python"}
    assert "dp_rank" not in m
    assert merge_stats([a]) == a


def test_merge_flush_names_the_replicas_that_refused():
    assert merge_flush([FlushCacheResp(True), FlushCacheResp(True, dp_rank=1)]).success
    resp = merge_flush([FlushCacheResp(True), FlushCacheResp(False, "busy", dp_rank=1)])
    assert not resp.success and "replica 1: busy" in resp.message
    assert merge_flush([FlushCacheResp(False, "busy")]).message == "busy"


def test_replica_processes_are_named_in_death_messages():
    from sglite.config import ServerArgs
    from sglite.dp_replicas import replica_name, replica_rank
    from sglite.launcher import death_reason
    from sglite.scheduler.watchdog import WATCHDOG_EXIT_CODE

    args = ServerArgs(dp_size=2)
    assert [replica_name(r, 2) for r in range(2)] == ["scheduler_dp0", "scheduler_dp1"]
    assert replica_name(0, 1) == "scheduler" and replica_rank("detokenizer") is None
    assert death_reason("scheduler_dp1", 3, args) == (
        "the scheduler process of data-parallel replica 1 died (exit code 3)"
    )
    assert death_reason("scheduler_dp0", WATCHDOG_EXIT_CODE, args).startswith(
        "the scheduler process of data-parallel replica 0 was stopped by its watchdog"
    )
    assert death_reason("scheduler", 3, args) == "the scheduler process died (exit code 3)"
    assert death_reason("detokenizer", 1, args) == "the detokenizer process died (exit code 1)"
