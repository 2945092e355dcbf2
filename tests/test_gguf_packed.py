"""GGUF models served packed (--quantization gguf: the file's blocks by mmap, native kernels)
against the same file dequantized at load (--quantization none), per block type and
architecture, on tiny random checkpoints written as GGUF (fixtures.gguf_writer; the k-quants
by sglite's k-quant writer, on rows of 256):

- `--quant-kernel exact` (float32 activations): greedy tokens equal and logits within 1e-4
  of the largest logit, through llama's un-permuted Q/K rows, Phi-3's fused tensors, tied and
  untied packed LM heads, Gemma's scaled packed embedding, biases, a Q4_K_M-like type mix;
- `--quant-kernel auto` (int8 activations, llama.cpp's rounding): logits within
  AUTO_TOL of the largest logit (the error of rounding activations to int8 per 32
  values, on top of the weights' own error shared by both sides);
- the packed weights are views of the mapped file; norms stay float;
- tensor parallelism (2 gloo ranks) gives the tp-1 packed model's logits, and a shard that
  would split a block is refused naming why; --quantization gguf on a non-GGUF folder too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fixtures.gguf_models import build_hf_model
from fixtures.gguf_writer import write_gguf
from fixtures.model_driver import Driver
from sglite.layers import quant_kernels

pytestmark = pytest.mark.skipif(
    quant_kernels.unavailable_reason() is not None, reason="native quant kernels missing"
)

K_DIMS = dict(hidden_size=256, intermediate_size=512, head_dim=64)
# the type mix of llama.cpp's Q4_K_M, on a tiny model: Q6_K for v, down and the LM head
Q4_K_M = {
    "output.weight": "Q6_K",
    **{f"blk.{i}.attn_v.weight": "Q6_K" for i in range(3)},
    **{f"blk.{i}.ffn_down.weight": "Q6_K" for i in (0, 2)},
}
# (variant, 2-D type, k-quant dims?, per-tensor types)
CASES = [
    ("llama", "Q8_0", False, None),
    ("llama_bias_tied", "Q4_0", False, None),
    ("qwen2", "Q4_1", False, None),
    ("gemma3", "Q5_0", False, None),
    ("phi3", "Q5_1", False, None),
    ("starcoder2", "Q8_0", False, None),
    ("mistral", "F16", False, None),
    ("llama", "Q4_K", True, Q4_K_M),
    ("qwen3", "Q5_K", True, None),
]
IDS = [f"{v}-{q}{'-mix' if t else ''}" for v, q, _, t in CASES]
# int8 activations vs float32, relative to the largest logit, teacher-forced (measured: 0.016
# to 0.027 for the 32-weight types, 0.029 Q5_K, 0.056 the Q4_K/Q6_K mix; random tiny models
# amplify it: the demo model's is in test_gguf_packed_demo)
AUTO_TOL = 0.08
STEPS = 6


@pytest.fixture(scope="module")
def gguf_case(tmp_path_factory):
    made = {}

    def make(variant, qtype, kdims, types):
        key = (variant, qtype, kdims, repr(types))
        if key not in made:
            root = tmp_path_factory.mktemp(variant)
            hf = build_hf_model(variant, root / "hf", **(K_DIMS if kdims else {}))
            made[key] = write_gguf(hf, root / f"{qtype}.gguf", qtype=qtype, types=types)
        return made[key]

    return make


def runner(path, **kwargs):
    from sglite.model_executor.model_runner import ModelRunner

    kwargs = {"max_total_tokens": 1024, "max_running_requests": 4, **kwargs}
    return ModelRunner(str(path), device="cpu", **kwargs)


def greedy(run, prompts, forced=None):
    """(tokens per prompt, logits [B, STEPS, V]) of a batched greedy run; with `forced`
    (tokens per prompt), those tokens are fed back instead (teacher forcing)."""
    driver = Driver(run)
    seqs = [driver.new_seq() for _ in prompts]
    logits = [driver.extend(seqs, prompts)]
    outs = [[t] for t in logits[0].argmax(-1).tolist()]
    for step in range(STEPS - 1):
        feed = [o[-1] for o in outs] if forced is None else [f[step] for f in forced]
        logits.append(driver.decode(seqs, feed))
        for o, t in zip(outs, logits[-1].argmax(-1).tolist()):
            o.append(t)
    for s in seqs:
        driver.release(s)
    return outs, torch.stack(logits, dim=1)


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(3, vocab, n).tolist() for n in (5, 11, 23)]


@pytest.mark.parametrize(("variant", "qtype", "kdims", "types"), CASES, ids=IDS)
def test_packed_model_equals_the_dequantized_one(gguf_case, variant, qtype, kdims, types):
    path = gguf_case(variant, qtype, kdims, types)
    ref_run = runner(path, quantization="none")
    ps = prompts(ref_run.model_config.vocab_size)
    want, want_logits = greedy(ref_run, ps)
    del ref_run
    exact = runner(path, quant_kernel="exact")  # packed: the default for a .gguf on CPU
    kinds = {type(m).__name__ for m in exact.model.modules()}
    assert {"QuantQKVParallelLinear", "QuantRowParallelLinear", "QuantParallelLMHead"} <= kinds
    assert "QuantVocabParallelEmbedding" in kinds and "ParallelLMHead" not in kinds
    got, got_logits = greedy(exact, ps)
    scale = want_logits.abs().max().item()
    assert got == want
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4 * scale, rtol=0)
    del exact
    default = runner(path)  # int16 activations: the same greedy tokens, logits within ~1e-4
    got, got_logits = greedy(default, ps)
    assert got == want
    torch.testing.assert_close(got_logits, want_logits, atol=1e-3 * scale, rtol=0)
    del default
    fast = runner(path, quant_kernel="auto")
    _, fast_logits = greedy(fast, ps, forced=want)
    err = (fast_logits - want_logits).abs().max().item()
    if qtype == "F16":  # no block type: dense rows, float everywhere
        assert err <= 1e-4 * scale
    else:
        assert err <= AUTO_TOL * scale, (err, scale)


def _mapped_from(path) -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of `path`."""
    spans = []
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith(str(path)):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            spans.append((start, end))
    return spans


def test_packed_layers_hold_one_copy_of_the_files_bytes(gguf_case):
    """With the file's kernels (exact) the packed weights are views of the mapped file (no
    copy), except llama's Q and K, whose rows are un-permuted into a copy. With the default
    (panel) kernels each weight is repacked once, into memory of its own (the file's pages
    are given back: tests/test_quant_linear.py). Norms are float parameters either way."""
    path = gguf_case("qwen2", "Q4_1", False, None)
    model = runner(path, quant_kernel="exact").model
    spans = _mapped_from(path.resolve())
    assert spans

    def in_file(t: torch.Tensor) -> bool:
        return any(a <= t.data_ptr() < b for a, b in spans)

    layer = model.model.layers[0]
    for packed in (layer.self_attn.qkv_proj.packed, layer.mlp.down_proj.packed):
        assert packed.segments and all(seg.qtype == "Q4_1" for _, seg in packed.segments)
        assert all(in_file(seg.data) for _, seg in packed.segments)
    assert in_file(model.model.embed_tokens.table.data)
    names = {n for n, _ in model.named_parameters()}
    assert "model.norm.weight" in names and not any(n.endswith("proj.weight") for n in names)
    del model

    from sglite.layers.quant_linear import PanelRows

    run = runner(path)  # the default kernel: panels
    model = run.model
    spans = _mapped_from(path.resolve())
    packed = [m.packed for m in model.modules() if hasattr(m, "packed") and m.packed.is_complete]
    layers = [p for p in packed if p is not model.model.embed_tokens.packed]
    assert layers and all(p._panels is not None for p in layers)
    segments = [seg for p in layers for _, seg in p.segments]
    assert all(isinstance(seg, PanelRows) and not in_file(seg.data) for seg in segments)
    assert in_file(model.model.embed_tokens.table.data)  # lookups read the file's rows

    llama_path = gguf_case("llama", "Q8_0", False, None)
    llama = runner(llama_path, quant_kernel="exact").model
    spans = _mapped_from(llama_path.resolve())
    q, k, v = (seg for _, seg in llama.model.layers[0].self_attn.qkv_proj.packed.segments)
    assert not in_file(q.data) and not in_file(k.data) and in_file(v.data)  # q, k: copies


def test_a_moe_gguf_is_dequantized_at_load_and_refused_packed(gguf_case):
    """Mixture-of-experts layers have no packed form: by default the file is dequantized at
    load (the same logits as --quantization none); asked for packed, it is refused by name."""
    path = gguf_case("qwen2_moe", "Q8_0", False, None)
    auto, none = runner(path), runner(path, quantization="none")
    assert not any(hasattr(m, "packed") for m in auto.model.modules())
    ids = prompts(auto.model_config.vocab_size)
    torch.testing.assert_close(greedy(auto, ids)[1], greedy(none, ids)[1], atol=0, rtol=0)
    with pytest.raises(ValueError, match="Qwen2MoeForCausalLM: its mixture-of-experts layers"):
        runner(path, quantization="gguf")


def test_quantization_gguf_needs_a_gguf(tiny_model_dir):
    with pytest.raises(ValueError, match="--quantization gguf needs a .gguf"):
        runner(tiny_model_dir("llama"), quantization="gguf")


def test_packed_tp2_matches_tp1_and_refuses_partial_blocks(gguf_case, tmp_path):
    """Two gloo ranks: a llama Q4_0 (Q/K rows un-permuted, then sharded; biases; a tied
    packed LM head over vocabulary shards) gives the tp-1 packed logits and tokens; a Q4_K
    model whose o_proj shard would split a 256-weight block is refused naming why."""
    from fixtures.tp_worker import DECODE_STEPS, run_tp_ranks, run_workload
    from sglite.models.gguf import convert_gguf_to_hf

    folders = {
        name: convert_gguf_to_hf(gguf_case(*case), cache_root=tmp_path / "cache")
        for name, case in {
            "llama": ("llama_bias_tied", "Q4_0", False, None),
            "k_quant": ("llama", "Q4_K", True, Q4_K_M),  # last: its refusal ends the ranks
        }.items()
    }
    exact = {"quant_kernel": "exact"}  # int8 rounding may flip on the all-reduce's order
    jobs = [(name, folder, exact) for name, folder in folders.items()]
    failures = run_tp_ranks(2, jobs, tmp_path, timeout_s=240)
    assert len(failures) == 2 and all(
        "row-parallel layers need in_features / tp_size to be a multiple of 256" in f
        for f in failures
    ), failures
    for name in ("llama",):
        ref = run_workload(runner(folders[name], max_total_tokens=256, **exact))
        for rank in range(2):
            got = torch.load(tmp_path / f"{name}.rank{rank}.pt")
            assert got["tokens"] == ref["tokens"], (name, rank)
            assert len(got["logits"]) == DECODE_STEPS + 1
            for a, b in zip(got["logits"], ref["logits"]):
                torch.testing.assert_close(a, b, atol=1e-4 * b.abs().max().item(), rtol=0)
