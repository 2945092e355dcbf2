"""DeepSeek (latent attention, MLAKVPool) under the real scheduler, HiCache and tensor parallelism.

The tiny DeepSeek-V3 of tests/test_model_mla.py (yarn rope, q_lora_rank) and the V2-Lite one:
- the scheduler (both loops, both tree cores, page sizes 1 and 16) over a pool that barely
  fits the workload of tests/test_scheduler_model.py (chunked prefill, radix hits, eviction,
  retraction) gives exactly transformers' greedy tokens;
- HiCache: conversations whose working set overflows the device pool give the device-only
  run's tokens while latent rows are backed up and loaded back from the host tier (every
  write policy, both tree cores); a file tier written by one scheduler serves a second one;
- `--tp-size 2`: each rank holds half the heads and the whole (replicated) latent pool, and
  its logits equal the tp-1 runner's, its tokens transformers'.
"""

from __future__ import annotations

import pytest
import torch

import test_hicache_engine as hicache
import test_scheduler_model as sched_model
from fixtures.tp_worker import run_tp_ranks, run_workload

MODELS = {
    "v3": ("deepseek_v3", dict(seed=3)),
    "v2_lite": ("deepseek_v2", dict(seed=2, config={"q_lora_rank": None})),
}


@pytest.fixture(scope="module")
def v3_dir(tiny_model_dir):
    return tiny_model_dir(MODELS["v3"][0], **MODELS["v3"][1])


@pytest.fixture(scope="module")
def reference(v3_dir):
    from transformers import AutoConfig

    reqs = sched_model.make_workload(AutoConfig.from_pretrained(v3_dir).vocab_size, seed=1)
    return reqs, sched_model.hf_reference(v3_dir, reqs)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_scheduler_greedy_tokens_match_transformers(core, v3_dir, reference, overlap, page_size):
    reqs, expected = reference
    got, sched = sched_model.run_engine(
        core, v3_dir, reqs, page_size=page_size, policy="lpm", overlap=overlap
    )
    assert sched.cache.kv_pool.values_in_keys  # the latent pool
    for rid, _, _ in reqs:
        assert got[rid] == expected[rid], f"{rid} differs from transformers"
    c = sched.counters
    assert c["num_chunks"] > 0, "the workload must chunk"
    assert sched.cache.num_evicted_tokens > 0, "the workload must evict"
    assert c["num_retracted_reqs"] > 0, "the workload must retract"
    assert c["num_cached_tokens_total"] > 0, "shared prefixes must hit the cache"


@pytest.fixture(scope="module")
def device_only(v3_dir):
    sched, outputs = hicache.build("python", v3_dir)
    got = hicache.run_rounds(sched, outputs)
    assert sched.cache.num_evicted_tokens > 0, "the workload must overflow the device pool"
    return got, sched.stats()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_host_tier_same_tokens_as_device_only(core, v3_dir, device_only, policy):
    expected, base = device_only
    sched, outputs = hicache.build(
        core.name, v3_dir, enable_hierarchical_cache=True, hicache_write_policy=policy
    )
    host = sched.cache.tier.host_pool
    assert [b.shape[1:] for b in host.buffers] == [(1, 40)] * 3  # latent rows on the host too
    assert hicache.run_rounds(sched, outputs) == expected
    stats = sched.stats()
    assert stats["num_load_back_tokens"] > 0
    assert stats["num_cached_tokens_total"] > base["num_cached_tokens_total"]
    assert stats["hicache_bytes_to_device"] == stats["num_load_back_tokens"] * 3 * 40 * 4


def test_paged_host_tier_same_tokens(v3_dir):
    base, base_out = hicache.build("python", v3_dir, page_size=16)
    expected = hicache.run_rounds(base, base_out)
    sched, outputs = hicache.build("python", v3_dir, page_size=16, enable_hierarchical_cache=True)
    assert hicache.run_rounds(sched, outputs) == expected
    assert sched.stats()["num_load_back_tokens"] > 0


def test_file_tier_serves_a_second_scheduler(v3_dir, tmp_path):
    from sglite.messages import GenerateReq
    from sglite.sampling_params import SamplingParams

    prompt = [(7 * i) % 380 + 3 for i in range(200)]
    kwargs = dict(
        enable_hierarchical_cache=True, hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path),
    )  # fmt: skip
    answers = []
    for attempt in range(2):
        sched, outputs = hicache.build("python", v3_dir, **kwargs)
        params = SamplingParams(max_new_tokens=6, temperature=0)
        sched.add_request(GenerateReq(f"r{attempt}", list(prompt), params))
        sched.run_until_idle()
        sched.cache.tier.storage.flush()
        answers.append([t for m in outputs for ids in m.output_ids for t in ids])
        stats = sched.stats()
        sched.cache.tier.storage.close()
    assert list(tmp_path.rglob("*.kv")), "the first scheduler wrote no pages"
    assert answers[0] == answers[1]
    assert stats["storage_hit_tokens"] >= 128  # the second one read them back


# ---------------------------------------------------------------- tensor parallelism


def test_tp2_equals_tp1_and_transformers(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from fixtures.model_driver import hf_greedy
    from fixtures.tp_worker import DECODE_STEPS, PROMPTS
    from sglite.model_executor.model_runner import ModelRunner

    paths = {name: tiny_model_dir(arch, **opts) for name, (arch, opts) in MODELS.items()}
    failures = run_tp_ranks(2, list(paths.items()), tmp_path, timeout_s=240)
    assert not failures, "\n".join(failures)
    for name, path in paths.items():
        ranks = [torch.load(tmp_path / f"{name}.rank{r}.pt") for r in range(2)]
        ref = run_workload(
            ModelRunner(path, device="cpu", max_total_tokens=256, max_running_requests=4)
        )
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for i, prompt in enumerate(PROMPTS):
            tokens, _ = hf_greedy(hf, list(prompt), DECODE_STEPS + 1)
            assert [step[i] for step in ref["tokens"]] == tokens
        for rank in ranks:
            assert rank["heads"] == 2 and rank["kv_pool_heads"] == 1  # the latent: replicated
            assert rank["tokens"] == ref["tokens"]
            assert rank["sampled"] == ranks[0]["sampled"]
            for got, want in zip(rank["logits"], ref["logits"]):
                torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
