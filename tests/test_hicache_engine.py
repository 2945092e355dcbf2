"""HiCache on the tiny llama: multi-turn conversations whose working set is ~3.5x the device
KV pool give exactly the greedy tokens of a device-only server while KV is loaded back from
the host (every write policy, both tree cores); evicted-to-host KV comes back bit-identical;
the file tier survives a restart (a second Engine on the same directory gets storage hits and
the same tokens; damaged pages are recomputed and removed); a host pool larger than the free
RAM is refused at start-up."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import sglite
from sglite.config import ServerArgs
from sglite.messages import GenerateReq
from sglite.sampling_params import SamplingParams
from sglite.scheduler.process import scheduler_for_runner
from sglite.scheduler.req import Req

POOL_TOKENS = 448
CONVS, ROUNDS, TURN, ANSWER = 8, 5, 32, 8  # final conversation 200 tokens, 8 of them: 1600


def build(
    core_name, model_dir, page_size=1, total_tokens=POOL_TOKENS, overlap=False, device="cpu",
    **hicache,
):  # fmt: skip
    from sglite.model_executor.model_runner import ModelRunner

    runner = ModelRunner(
        model_dir,
        device=device,
        page_size=page_size,
        max_total_tokens=total_tokens,
        max_running_requests=8,
        tree_core=core_name,
    )
    args = ServerArgs(
        page_size=page_size,
        max_total_tokens=total_tokens,
        chunked_prefill_size=64,
        disable_overlap_schedule=not overlap,
        debug_invariants=True,
        tree_core=core_name,
        **hicache,
    )
    outputs: list = []
    sched = scheduler_for_runner(args, runner, outputs.append)
    sched.stop_checker.eos_token_ids = set()  # exact-length answers
    return sched, outputs


def run_rounds(sched, outputs, vocab: int = 384, seed: int = 0) -> dict[str, list[int]]:
    """CONVS conversations x ROUNDS rounds: each round appends a user turn and the answer."""
    rng = random.Random(seed)
    histories: list[list[int]] = [[] for _ in range(CONVS)]
    got: dict[str, list[int]] = {}
    for r in range(ROUNDS):
        for c in range(CONVS):
            histories[c] += [rng.randrange(3, vocab) for _ in range(TURN)]
            params = SamplingParams(max_new_tokens=ANSWER, temperature=0)
            sched.add_request(GenerateReq(f"c{c}r{r}", list(histories[c]), params))
        outputs.clear()
        sched.run_until_idle()
        sched.cache.check_idle()
        for msg in outputs:
            for rid, ids in zip(msg.rids, msg.output_ids):
                got.setdefault(rid, []).extend(ids)
        for c in range(CONVS):
            histories[c] += got[f"c{c}r{r}"]
    return got


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def device_only(llama_dir):
    sched, outputs = build("python", llama_dir)
    got = run_rounds(sched, outputs)
    assert sched.cache.num_evicted_tokens > 0, "the workload must overflow the device pool"
    return got, sched.stats()


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_same_greedy_tokens_with_host_tier(core, llama_dir, device_only, policy):
    expected, base = device_only
    sched, outputs = build(
        core.name, llama_dir, enable_hierarchical_cache=True, hicache_write_policy=policy
    )
    got = run_rounds(sched, outputs)
    assert got == expected
    stats = sched.stats()
    assert stats["num_load_back_tokens"] > 0
    assert 0 < stats["host_hit_tokens"] <= stats["num_load_back_tokens"]
    assert stats["hicache_bytes_to_device"] > 0 and stats["hicache_bytes_to_host"] > 0
    assert stats["hicache_host_total_tokens"] == 2 * POOL_TOKENS
    # the host tier serves prompt tokens the device-only server had to recompute
    assert stats["num_cached_tokens_total"] > base["num_cached_tokens_total"]
    assert stats["cache_hit_rate"] > base["cache_hit_rate"]


def test_overlap_loop_write_back_same_tokens(llama_dir, device_only):
    sched, outputs = build(
        "python", llama_dir, overlap=True, enable_hierarchical_cache=True,
        hicache_write_policy="write_back",
    )  # fmt: skip
    assert run_rounds(sched, outputs) == device_only[0]
    assert sched.stats()["num_load_back_tokens"] > 0


def test_paged_host_tier_same_tokens(llama_dir):
    base, base_out = build("python", llama_dir, page_size=16)
    expected = run_rounds(base, base_out)
    sched, outputs = build("python", llama_dir, page_size=16, enable_hierarchical_cache=True)
    assert run_rounds(sched, outputs) == expected
    assert sched.stats()["num_load_back_tokens"] > 0


def test_evicted_to_host_and_loaded_back_bytes_identical(core, llama_dir):
    sched, _ = build(core.name, llama_dir, enable_hierarchical_cache=True)
    cache, pool = sched.cache, sched.cache.kv_pool
    prompt = list(range(10, 90))
    sched.add_request(GenerateReq("a", prompt, SamplingParams(max_new_tokens=4, temperature=0)))
    sched.run_until_idle()
    key = np.asarray(prompt, dtype=np.int64)
    slots, _ = cache.tree.match_prefix(key)
    assert len(slots) == len(prompt)
    idx = torch.as_tensor(np.asarray(slots, dtype=np.int64))
    k_before = [b[idx].clone() for b in pool.k_buffer]
    v_before = [b[idx].clone() for b in pool.v_buffer]

    cache.evict_for(cache.allocator.capacity())  # everything leaves the device
    assert cache.tree.evictable_size() == 0
    for b in pool.k_buffer + pool.v_buffer:
        b[1:] = float("nan")  # the device copy is gone
    dev_slots, _, host_slots, _ = cache.tree.match_prefix_host(key)
    assert len(dev_slots) == 0 and len(host_slots) == len(prompt)

    req = Req("b", prompt + [1], SamplingParams(max_new_tokens=1))
    cache.match(req)
    assert req.match_len == 0 and req.host_hit_len == len(prompt)
    cache.lock(req.match_node)
    cache.load_back(req)
    assert req.match_len == len(prompt) and req.host_hit_len == 0
    tree_slots, node = cache.tree.match_prefix(key)  # what later requests will read
    assert node == req.match_node
    assert np.array_equal(np.asarray(tree_slots), np.asarray(req.match_slots))
    idx = torch.as_tensor(np.asarray(tree_slots, dtype=np.int64))
    for layer in range(pool.num_layers):
        assert torch.equal(pool.k_buffer[layer][idx], k_before[layer])
        assert torch.equal(pool.v_buffer[layer][idx], v_before[layer])
    cache.unlock(req.match_node)
    cache.check_idle()


def test_host_pool_larger_than_ram_refused(llama_dir):
    with pytest.raises(ValueError, match="MemAvailable"):
        build("python", llama_dir, enable_hierarchical_cache=True, hicache_size=1e6)


def test_file_tier_survives_restart(core, llama_dir, tmp_path):
    prompt = [random.Random(1).randrange(3, 384) for _ in range(200)]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    kwargs = dict(
        model_path=str(llama_dir),
        max_total_tokens=POOL_TOKENS,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path),
        tree_core=core.name,
        log_level="warning",
    )
    with sglite.Engine(**kwargs) as first:
        a = first.generate(input_ids=prompt, sampling_params=params)
        assert a["meta_info"]["cached_tokens"] == 0
        first.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 1})  # idle after
    assert list(tmp_path.rglob("*.kv")), "the first server wrote no pages"
    with sglite.Engine(**kwargs) as second:  # empty device and host tiers: storage only
        b = second.generate(input_ids=prompt, sampling_params=params)
    assert b["output_ids"] == a["output_ids"]
    assert b["meta_info"]["cached_tokens"] >= 128
    pages = list(tmp_path.rglob("*.kv"))
    for page in pages:  # a crash mid-write, a bad disk: every page is damaged
        page.write_bytes(page.read_bytes()[:100])
    with sglite.Engine(**kwargs) as third:  # used to raise UnpicklingError on every restart
        c = third.generate(input_ids=prompt, sampling_params=params)
    assert c["output_ids"] == a["output_ids"]  # recomputed
    assert c["meta_info"]["cached_tokens"] == 0
    # the first damaged page of the chain was removed (and written again after the recompute)
    assert any(not p.exists() or p.stat().st_size != 100 for p in pages)


def _engine_conversations(model_dir, **kwargs) -> tuple[list[list[int]], int]:
    """4 conversations x 4 rounds, sent one request at a time through an Engine; returns the
    answers and the prompt tokens served from cache."""
    rng = random.Random(3)
    histories: list[list[int]] = [[] for _ in range(4)]
    answers, cached = [], 0
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with sglite.Engine(
        model_path=str(model_dir), max_total_tokens=256, log_level="warning", **kwargs
    ) as engine:
        for _ in range(4):
            for history in histories:
                history += [rng.randrange(3, 384) for _ in range(32)]
                out = engine.generate(input_ids=list(history), sampling_params=params)
                answers.append(out["output_ids"])
                cached += out["meta_info"]["cached_tokens"]
                history += out["output_ids"]
    return answers, cached


def test_tp2_ranks_keep_their_host_tiers_in_step(llama_dir):
    """Under --tp-size 2 each rank has its own host tier (its shard of the KV); both ranks
    load back the same chains in the same ticks, so the answers equal tp 1 device-only's."""
    expected, device_cached = _engine_conversations(llama_dir)
    got, cached = _engine_conversations(
        llama_dir, tp_size=2, enable_hierarchical_cache=True, hicache_ratio=4.0
    )
    assert got == expected
    assert cached > device_cached  # host hits the device-only run recomputed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_host_tier_on_cuda_same_tokens(llama_dir, overlap):
    """Pinned host buffers and side-stream copies: the answers of a device-only run."""
    base, base_out = build("python", llama_dir, page_size=16, device="cuda", overlap=overlap)
    expected = run_rounds(base, base_out)
    sched, outputs = build(
        "python", llama_dir, page_size=16, device="cuda", overlap=overlap,
        enable_hierarchical_cache=True, hicache_write_policy="write_back",
    )  # fmt: skip
    assert run_rounds(sched, outputs) == expected
    assert sched.stats()["num_load_back_tokens"] > 0
    assert sched.cache.tier.host_pool.k_buffer[0].is_pinned()
