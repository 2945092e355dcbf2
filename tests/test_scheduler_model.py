"""The scheduler on a real (tiny) model: every policy, loop, tree core and page size gives
exactly transformers' greedy tokens, under a KV pool small enough to force eviction, chunking
and retraction."""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.model_checks import check_scheduler_tokens, run_scheduler

POLICIES = ["fcfs", "lpm", "dfs-weight", "lof", "random", "hrrn", "shortest-prefill-first"]
NUM_REQS = 32


def make_workload(vocab: int, seed: int = 0):
    """Half short-prompt/long-output requests (they retract), half sharing system prompts."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, vocab) for _ in range(64)] for _ in range(2)]
    reqs = []
    for i in range(NUM_REQS):
        if i % 2:
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 20))]
            n = rng.randrange(36, 56)
        else:
            prompt = systems[i % 4 // 2] + [
                rng.randrange(3, vocab) for _ in range(rng.randrange(4, 40))
            ]
            n = rng.randrange(2, 8)
        reqs.append((f"req{i}", prompt, n))
    return reqs


def hf_reference(model_dir, reqs) -> dict[str, list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = {}
    with torch.inference_mode():
        for rid, prompt, n in reqs:  # greedy, exactly n tokens (no EOS stop)
            res = model(torch.tensor([prompt]), use_cache=True)
            past, tokens = res.past_key_values, [int(res.logits[0, -1].argmax())]
            while len(tokens) < n:
                res = model(torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
                past = res.past_key_values
                tokens.append(int(res.logits[0, -1].argmax()))
            out[rid] = tokens
    return out


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from transformers import AutoConfig

    model_dir = tiny_model_dir("llama")
    reqs = make_workload(AutoConfig.from_pretrained(model_dir).vocab_size)
    return model_dir, reqs, hf_reference(model_dir, reqs)


def run_engine(
    core, model_dir, reqs, *, page_size, policy, overlap, total_tokens=320, conserv=0.1, mixed=False
):
    # eager admission (a low conservativeness): forces retraction
    got, sched = run_scheduler(
        core, model_dir, reqs, page_size=page_size, policy=policy, overlap=overlap,
        total_tokens=total_tokens, max_running_requests=24, chunked_prefill_size=32,
        enable_mixed_chunk=mixed, schedule_conservativeness=conserv,
    )  # fmt: skip
    assert sched.core.name == core.name
    return got, sched


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_tokens_match_transformers(core, reference, policy, overlap, page_size):
    model_dir, reqs, expected = reference
    got, sched = run_engine(
        core, model_dir, reqs, page_size=page_size, policy=policy, overlap=overlap
    )
    check_scheduler_tokens(got, sched, reqs, expected, evict=True, retract=True)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_mirrored_request_table_path(core, reference, overlap):
    """On CUDA the scheduler writes a host mirror of the request table and ships the rows of
    each batch with it; force that path on CPU so it is tested without a GPU."""
    import numpy as np

    from sglite.mem_cache.cache_manager import CacheManager

    real_init = CacheManager.__init__

    def mirrored_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.table = np.zeros_like(self.table)  # a separate host table, as on CUDA
        self.mirrored = True

    model_dir, reqs, expected = reference
    mp = pytest.MonkeyPatch()
    mp.setattr(CacheManager, "__init__", mirrored_init)
    try:
        got, sched = run_engine(core, model_dir, reqs, page_size=16, policy="lpm", overlap=overlap)
    finally:
        mp.undo()
    assert sched.cache.mirrored
    for rid, _, _ in reqs:
        assert got[rid] == expected[rid], f"{rid} differs from transformers"


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_mixed_batches_match_transformers(core, reference, policy, overlap, page_size):
    """Decode rows riding in prefill chunks (the CPU default) change no token."""
    model_dir, reqs, expected = reference
    got, sched = run_engine(
        core, model_dir, reqs, page_size=page_size, policy=policy, overlap=overlap, mixed=True
    )
    for rid, _, _ in reqs:
        assert got[rid] == expected[rid], f"{rid} differs from transformers"
    assert sched.counters["num_chunks"] > 0, "the workload must chunk"
