"""Tensor parallelism on CPU (gloo, spawned ranks): sharded models match tp_size 1 and HF.

One spawn of two ranks runs every tp-2 model: Llama, Qwen2, Qwen3 (4 heads over 2 KV heads),
a Llama with a single KV head (replicated on both ranks), a Llama with biases on o_proj
and down_proj (added once, after the all-reduce), one with an odd vocabulary (387: the last
vocabulary shard is padded, the gathered logits trimmed), and the families with sharded
parts of their own (TP2_MODELS says which). Three ranks run a Llama with 9 heads over 3 KV
heads; four ranks the 4-head Llama, whose 2 KV heads are each replicated on two ranks
(ranks 2 and 3 must load the second one), and OLMo 2 and StableLM, whose q/k norms cover
the replicated heads; three ranks the demo model SmolLM2-135M (9 heads over 3 KV heads;
skipped when its package is not installed). Each rank's logits of an extend and the decode
steps after it must equal the tp-1 runner's (fp32, 1e-4), the greedy tokens transformers',
and every rank must return rank 0's sampled tokens.
"""

from __future__ import annotations

import time

import pytest
import torch

from fixtures.model_driver import hf_greedy
from fixtures.tp_worker import DECODE_STEPS, PROMPTS, free_port, run_tp_ranks, run_workload
from sglite.distributed import NULL_TP_GROUP, check_tp_size, init_tp_group, valid_tp_sizes

ATOL = 1e-4
SMOLLM2_ATOL = 3e-4  # 30 real layers, logits ~10: 4.5e-5 seen; fp32 sums in another order
TP2_MODELS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "llama_kv1": ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "llama_bias": ("llama", {"bias": True}),  # row-parallel biases: added once, after
    "llama_odd_vocab": ("llama", {"vocab_size": 387}),  # the last vocab shard is padded
    # families with their own sharded parts (tests/fixtures/tiny_families.py)
    "phi3": ("phi3", {}),  # fused qkv_proj and gate_up_proj, split then sharded
    "gpt_neox": ("gpt_neox", {}),  # per-head fused QKV, plain MLP, two parallel branches
    "olmo2": ("olmo2", {}),  # q/k norm over the whole projection: one all-reduce
    "cohere": ("cohere", {}),  # a q/k norm weight per head, interleaved rope
    "stablelm": ("stablelm", {}),  # per-head q/k norm rows loaded one head at a time
    "phi": ("phi", {}),  # the LM head's bias, sharded with its rows
    "gemma": ("gemma", {}),
    "gemma2": ("gemma2", {}),  # soft-capped heads, sandwich norms, windows of 8
    "gemma3": ("gemma3", {}),  # (1 + w) q/k norms, two rotary tables
    "glm4": ("glm4", {}),
}
NINE_HEADS = dict(
    num_attention_heads=9,
    num_key_value_heads=3,
    hidden_size=72,
    head_dim=8,
    intermediate_size=192,
    vocab_size=385,  # 3 shards of 129, the last padded by 2
    tie_word_embeddings=True,
)
TP3_MODELS = {"llama_9h": ("llama", NINE_HEADS)}
# 2 KV heads on 4 ranks: each replicated twice, with the q/k norms that cover them
TP4_MODELS = {"llama": ("llama", {}), "olmo2": ("olmo2", {}), "stablelm": ("stablelm", {})}


def _ranks_results(tmp_path_factory, tp_size: int, paths: dict) -> dict:
    out = tmp_path_factory.mktemp(f"tp{tp_size}")
    failures = run_tp_ranks(tp_size, list(paths.items()), out, timeout_s=240)
    assert not failures, "\n".join(failures)
    return {
        name: [torch.load(out / f"{name}.rank{r}.pt") for r in range(tp_size)] for name in paths
    }


def _tiny_paths(tiny_model_dir, models: dict) -> dict:
    return {name: tiny_model_dir(arch, **opts) for name, (arch, opts) in models.items()}


def _check_against_tp1(name: str, path, ranks: list[dict], atol: float = ATOL) -> None:
    from transformers import AutoModelForCausalLM

    from sglite.model_executor.model_runner import ModelRunner

    ref = run_workload(
        ModelRunner(path, device="cpu", max_total_tokens=256, max_running_requests=4)
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tp_size, cfg = len(ranks), hf.config
    for rank, got in enumerate(ranks):
        assert got["heads"] == cfg.num_attention_heads // tp_size
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        assert got["kv_pool_heads"] == max(1, kv_heads // tp_size)
        assert len(got["logits"]) == DECODE_STEPS + 1
        for step, (a, b) in enumerate(zip(got["logits"], ref["logits"])):
            assert a.shape == b.shape == (len(PROMPTS), hf.config.vocab_size)
            err = (a - b).abs().max().item()
            assert err <= atol, f"{name} rank {rank} step {step}: logits differ by {err}"
        assert got["sampled"] == ranks[0]["sampled"], f"{name}: rank {rank} sampled differently"
    for i, prompt in enumerate(PROMPTS):
        expected, _ = hf_greedy(hf, list(prompt), DECODE_STEPS + 1)
        assert [t[i] for t in ranks[0]["tokens"]] == expected, f"{name} prompt {i}"
        assert [t[i] for t in ref["tokens"]] == expected


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory, tiny_model_dir):
    return _ranks_results(tmp_path_factory, 2, _tiny_paths(tiny_model_dir, TP2_MODELS))


@pytest.mark.parametrize("name", sorted(TP2_MODELS))
def test_tp2_matches_tp1_and_transformers(name, tp2_results, tiny_model_dir):
    arch, opts = TP2_MODELS[name]
    _check_against_tp1(name, tiny_model_dir(arch, **opts), tp2_results[name])


def test_tp3_with_three_kv_heads_matches_tp1(tmp_path_factory, tiny_model_dir):
    paths = _tiny_paths(tiny_model_dir, TP3_MODELS)
    results = _ranks_results(tmp_path_factory, 3, paths)
    _check_against_tp1("llama_9h", paths["llama_9h"], results["llama_9h"])


def test_tp4_replicates_two_kv_heads_and_matches_tp1(tmp_path_factory, tiny_model_dir):
    paths = _tiny_paths(tiny_model_dir, TP4_MODELS)
    results = _ranks_results(tmp_path_factory, 4, paths)
    for name, path in paths.items():
        _check_against_tp1(name, path, results[name])


def test_smollm2_tp3_matches_tp1_and_transformers(tmp_path_factory, smollm2_dir):
    """The demo model: 9 heads over 3 KV heads, 30 layers, tied embeddings, real weights."""
    results = _ranks_results(tmp_path_factory, 3, {"smollm2": smollm2_dir})
    _check_against_tp1("smollm2", smollm2_dir, results["smollm2"], atol=SMOLLM2_ATOL)


def test_valid_tp_sizes():
    assert valid_tp_sizes(9, 3, 1536) == [1, 3]  # SmolLM2-135M
    assert valid_tp_sizes(4, 1, 128) == [1, 2, 4]  # one KV head: replicated
    assert valid_tp_sizes(32, 8, 14336) == [1, 2, 4, 8, 16, 32]  # Llama 3 8B


def test_bad_tp_size_is_refused_with_the_sizes_that_work(tiny_model_dir):
    from sglite.model_executor.model_runner import ModelRunner

    with pytest.raises(
        ValueError,
        match=r"--tp-size 2: the model has 9 attention heads; "
        r"tp sizes that work: 1, 3$",
    ):
        ModelRunner(tiny_model_dir("llama", **NINE_HEADS), device="cpu", tp_size=2, tp_rank=0)
    with pytest.raises(ValueError, match=r"--tp-size 4: the model has 6 KV heads .*: 1, 2, 3, 6"):
        check_tp_size(4, 12, 6, 1200)
    with pytest.raises(ValueError, match=r"MLP width 100 .*: 1, 2, 4$"):
        check_tp_size(8, 8, 8, 100)


def test_tp1_has_no_process_group():
    assert init_tp_group(1, 0, None, torch.device("cpu")) is NULL_TP_GROUP
    x = torch.ones(3)
    assert NULL_TP_GROUP.all_reduce(x) is x and NULL_TP_GROUP.all_gather(x) is x


def test_tp_needs_an_init_address():
    with pytest.raises(ValueError, match="needs dist_init_addr"):
        init_tp_group(2, 0, None, torch.device("cpu"))
    with pytest.raises(ValueError, match="host:port"):
        init_tp_group(2, 0, "localhost", torch.device("cpu"))


def test_rendezvous_gives_up_after_its_timeout_naming_the_missing_ranks():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"TP rank\(s\) 1, 2 of 3 did not join .* within 1.5 s"):
        init_tp_group(3, 0, f"127.0.0.1:{free_port()}", torch.device("cpu"), timeout_s=1.5)
    with pytest.raises(RuntimeError, match="TP rank 1/2: could not reach TP rank 0 at .* 1.5 s"):
        init_tp_group(2, 1, f"127.0.0.1:{free_port()}", torch.device("cpu"), timeout_s=1.5)
    assert time.monotonic() - start < 30


def test_bench_one_batch_reports_the_collective_share(tiny_model_dir):
    from sglite.bench_one_batch import main

    argv = ["--model-path", str(tiny_model_dir("llama")), "--device", "cpu", "--tp-size", "2"]
    r = main([*argv, "--batch-size", "2", "--input-len", "8", "--output-len", "4"])
    layers = 2
    # per step: 2 all-reduces per layer, the embedding's, the logits' gather, the broadcast
    assert r["collective_calls"] == 4 * (2 * layers + 3)
    assert 0 < r["collective_share"] < 1
