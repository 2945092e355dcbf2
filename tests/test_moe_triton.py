"""The Triton fused-MoE kernels against the CPU grouped expert compute (fused_cpu).

On CPU the kernels run through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET
before any kernel module is imported), at small shapes with small tiles so that several
row and column tiles and a ragged K are crossed: 8 experts, hidden 32, intermediate 48,
1..17 tokens, an expert with no tokens, every token on one expert, top-1, biases, every
activation, an expert-parallel shard. Without a GPU the compiled kernels are still built
for sm_90 by Triton's own ptxas (tests/fixtures/moe_aot.py). The `gpu` cases run them at a
realistic shape (64 experts, top-8, hidden 2048, bf16), through `FusedExperts.forward`'s
CUDA branch, with no host sync and under CUDA-graph capture.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("sglite_kernels") is None:  # source checkout, not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from sglite.distributed import TPGroup  # noqa: E402
from sglite.layers.activation import ACTIVATIONS  # noqa: E402
from sglite.layers.moe.experts import CLAMPED_SWIGLU, ExpertsSpec, FusedExperts  # noqa: E402
from sglite.layers.moe.fused_cpu import naive_forward  # noqa: E402
from sglite.layers.moe.fused_triton import KERNEL_ACT, triton_forward  # noqa: E402
from sglite_kernels import interpreted  # noqa: E402
from sglite_kernels.fused_moe import fused_moe  # noqa: E402
from sglite_kernels.moe_align import max_blocks, moe_align  # noqa: E402

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
SMALL_TILES = (16, 16, 16)  # H=32, I=48: two K steps, three column tiles of I
TOL = {torch.float32: 3e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@pytest.fixture(autouse=True)
def _cpu_cases_need_the_interpreter(request):
    if request.node.get_closest_marker("gpu") is None and not interpreted():
        pytest.skip("CPU fused-MoE cases need Triton's interpreter, off under SGL_TEST_GPU=1")


class _FakeGroup(TPGroup):
    """A TP group of `size` ranks seen from `rank` (only the shard arithmetic uses it)."""

    def __init__(self, size: int, rank: int) -> None:
        self.size, self.rank = size, rank


def _experts(
    num_experts=8,
    hidden=32,
    inter=48,
    *,
    act="silu",
    bias=False,
    dtype=torch.float32,
    device="cpu",
    group=None,
    ep_size=1,
    seed=0,
) -> FusedExperts:
    spec = ExpertsSpec(num_experts, inter, act=act, bias=bias)
    kw = {} if group is None else dict(tp_group=group, ep_size=ep_size)
    experts = FusedExperts(spec, hidden, dtype=dtype, **kw)  # built on CPU: the grouped path
    gen = torch.Generator().manual_seed(seed)
    for p in (experts.w13_weight, experts.w2_weight, experts.w13_bias, experts.w2_bias):
        if p is not None:
            fan_in = p.shape[-1] if p.dim() == 3 else 1
            p.data.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)
    return experts.to(device)


def _route(num_tokens, num_experts=8, top_k=2, *, skip=(), device="cpu", seed=1):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    scores[:, list(skip)] = -1.0
    weights, ids = torch.softmax(scores, -1).topk(top_k, dim=-1)
    return ids.to(device), (weights / weights.sum(-1, keepdim=True)).to(device)


def _x(num_tokens, hidden=32, dtype=torch.float32, device="cpu", seed=2):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, hidden, generator=gen).to(dtype=dtype, device=device)


def _check(experts, x, ids, weights, tiles=SMALL_TILES):
    ref = experts(x, ids, weights)  # CPU: fused_cpu's grouped forward
    got = fused_moe(
        x,
        ids,
        weights,
        experts.w13_weight,
        experts.w2_weight,
        b13=experts.w13_bias,
        b2=experts.w2_bias if experts.shard.adds_down_bias else None,
        expert_start=experts.shard.expert_start,
        act=KERNEL_ACT[experts.spec.act],
        tiles=tiles,
    )
    assert got.dtype == x.dtype and got.shape == x.shape
    tol = TOL[x.dtype]
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    return got


# ---------------------------------------------------------------- align


@pytest.mark.parametrize("num_tokens,top_k,block_m", [(1, 2, 16), (17, 2, 16), (9, 3, 4)])
def test_align_tiles_hold_each_local_pair_once(num_tokens, top_k, block_m):
    ids, _ = _route(num_tokens, top_k=top_k, skip=(3,))
    start, num_local = 2, 5  # experts 2..6 are local, 0, 1 and 7 belong to other ranks
    align = moe_align(ids, start, num_local, block_m)
    n = ids.numel()
    assert align.num_blocks == max_blocks(n, num_local, block_m)
    tiles = align.sorted_ids.view(align.num_blocks, block_m)
    seen = []
    for tile, e in zip(tiles.tolist(), align.block_expert.tolist()):
        pairs = [p for p in tile if p < n]
        if e < 0:
            assert not pairs  # surplus tiles are all padding
            continue
        assert pairs, "a tile given to an expert holds at least one pair"
        assert all(ids.view(-1)[p] == start + e for p in pairs)
        assert pairs == sorted(pairs)
        seen += pairs
    flat = ids.view(-1)
    local = [p for p in range(n) if start <= flat[p] < start + num_local]
    assert sorted(seen) == local  # each local pair once, other ranks' pairs never
    assert 3 - start not in align.block_expert.tolist()  # expert 3 has no tokens: no tile


# ---------------------------------------------------------------- against fused_cpu


@pytest.mark.parametrize("num_tokens", [1, 2, 5, 17])
def test_matches_grouped_cpu_path(num_tokens):
    experts = _experts()
    ids, weights = _route(num_tokens)
    got = _check(experts, _x(num_tokens), ids, weights)
    ref = naive_forward(_x(num_tokens), ids, weights, experts.w13_weight, experts.w2_weight)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_expert_without_tokens_and_default_tiles():
    experts = _experts()
    ids, weights = _route(13, skip=(0, 4))
    _check(experts, _x(13), ids, weights)
    _check(experts, _x(13), ids, weights, tiles=None)  # the launcher's own tiles


def test_all_tokens_on_one_expert_top1():
    experts = _experts()
    ids = torch.full((17, 1), 5, dtype=torch.int64)  # 17 rows: two tiles of one expert
    _check(experts, _x(17), ids, torch.rand(17, 1))


@pytest.mark.parametrize("top_k", [1, 3])
def test_top_k(top_k):
    experts = _experts()
    ids, weights = _route(6, top_k=top_k, seed=top_k)
    _check(experts, _x(6), ids, weights.to(torch.float32), tiles=(16, 32, 16))


def test_int32_ids_and_strided_x():
    experts = _experts()
    ids, weights = _route(7)
    wide = _x(7, hidden=64)
    _check(experts, wide[:, 16:48], ids.to(torch.int32), weights)  # row stride 64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes(dtype):
    experts = _experts(dtype=dtype)
    ids, weights = _route(9)
    _check(experts, _x(9, dtype=dtype), ids, weights)


# one transformers name per kernel activation (silu is every other case's)
ONE_NAME_EACH = ["gelu", "gelu_pytorch_tanh", "relu", "quick_gelu", "relu2", CLAMPED_SWIGLU]


@pytest.mark.parametrize("act", ONE_NAME_EACH)
def test_activations_and_biases(act):
    experts = _experts(act=act, bias=True, seed=ONE_NAME_EACH.index(act))
    ids, weights = _route(5)
    x = _x(5) * 3  # reach the clamp of clamped_swiglu (limit 7) and the negative sides
    _check(experts, x, ids, weights)


def test_every_activation_has_a_kernel_form():
    assert set(ACTIVATIONS) | {CLAMPED_SWIGLU} == set(KERNEL_ACT)
    assert {KERNEL_ACT[name] for name in ONE_NAME_EACH + ["silu"]} == set(KERNEL_ACT.values())


@pytest.mark.parametrize("rank", [2, 3])
def test_expert_parallel_shard(rank):
    # tp 4, ep 2: ranks 2 and 3 hold experts 4..7, half of the intermediate dim each; only
    # rank 2 adds the down bias
    experts = _experts(bias=True, group=_FakeGroup(4, rank), ep_size=2)
    assert experts.shard.expert_start == 4 and experts.shard.inter_size == 24
    ids, weights = _route(11)
    _check(experts, _x(11), ids, weights)
    triton = triton_forward(experts, _x(11), ids, weights)  # the dispatch's own wrapper
    torch.testing.assert_close(triton, experts(_x(11), ids, weights), atol=1e-5, rtol=1e-5)


def test_no_local_pairs_and_no_tokens():
    experts = _experts(group=_FakeGroup(2, 1), ep_size=2)  # experts 4..7
    ids = torch.randint(0, 4, (5, 2))
    assert torch.equal(triton_forward(experts, _x(5), ids, torch.rand(5, 2)), torch.zeros(5, 32))
    empty = torch.zeros(0, 2, dtype=torch.int64)
    assert triton_forward(experts, _x(0), empty, torch.zeros(0, 2)).shape == (0, 32)


def test_refuses_broken_contracts():
    experts = _experts()
    w13, w2 = experts.w13_weight, experts.w2_weight
    ids, weights = _route(3)
    with pytest.raises(ValueError, match="w13 must be"):
        fused_moe(_x(3, hidden=16), ids, weights, w13, w2)
    with pytest.raises(ValueError, match="w2 must be"):
        fused_moe(_x(3), ids, weights, w13, w2[:, :, :40])
    with pytest.raises(ValueError, match="topk_weights"):
        fused_moe(_x(3), ids, weights[:, :1], w13, w2)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(_x(3), ids.float(), weights, w13, w2)
    with pytest.raises(ValueError, match="dtypes must match"):
        fused_moe(_x(3, dtype=torch.bfloat16), ids, weights, w13, w2)
    with pytest.raises(ValueError, match="act="):
        fused_moe(_x(3), ids, weights, w13, w2, act="tanh")


def test_kernels_compile_for_hopper_and_pipeline():
    """The compiled (not interpreted) kernels: built for sm_90 by Triton's own ptxas, at the
    launcher's tiles, with software-pipelined loads and shared memory within an H100/H200's
    227 KiB per block. Needs no GPU."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(str(root / d) for d in ("tests", "kernels", "python"))
    script = root / "tests" / "fixtures" / "moe_aot.py"
    run = subprocess.run(
        [sys.executable, str(script), "90"], env=env, capture_output=True, text=True, timeout=300
    )
    if run.returncode and "ptxas" in run.stderr and "not found" in run.stderr.lower():
        pytest.skip("Triton's ptxas is not installed")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if "smem" in line]
    assert len(lines) == 15, run.stdout
    assert all(line.endswith(", pipelined") for line in lines), run.stdout
    smem = [int(m) for m in re.findall(r": (\d+) B smem", run.stdout)]
    assert len(smem) == 15 and max(smem) <= 227 * 1024


# ---------------------------------------------------------------- CUDA

REAL = dict(num_experts=64, hidden=2048, inter=768)  # Qwen3-30B-A3B's expert width, top-8


def _real_case(num_tokens, dtype=torch.bfloat16, seed=0):
    experts = _experts(**REAL, dtype=dtype, device="cuda", seed=seed)
    ids, weights = _route(num_tokens, 64, 8, device="cuda", seed=seed + 1)
    x = _x(num_tokens, 2048, dtype, "cuda", seed + 2)
    # reference: the grouped path over fp32 copies of the same weights, on the GPU
    w13, w2 = experts.w13_weight.float(), experts.w2_weight.float()
    ref = naive_forward(x.float(), ids, weights, w13, w2)
    return experts, x, ids, weights, ref


@gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 600])
def test_gpu_forward_matches_reference(num_tokens):
    experts, x, ids, weights, ref = _real_case(num_tokens)
    got = experts(x, ids, weights)  # FusedExperts.forward's CUDA branch
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_other_dtypes(dtype):
    experts, x, ids, weights, ref = _real_case(33, dtype=dtype, seed=3)
    tol = 1e-4 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(experts(x, ids, weights).float(), ref, atol=tol, rtol=tol)


@gpu
@needs_cuda
def test_gpu_biases_clamped_swiglu_and_shard():
    experts = _experts(
        32, 512, 256, act=CLAMPED_SWIGLU, bias=True, device="cuda", group=_FakeGroup(2, 1)
    )
    ids, weights = _route(40, 32, 4, device="cuda")
    x = _x(40, 512, device="cuda") * 3
    ref = experts.cpu()(x.cpu(), ids.cpu(), weights.cpu())
    got = experts.cuda()(x, ids, weights)
    torch.testing.assert_close(got.cpu(), ref, atol=1e-4, rtol=1e-4)


@gpu
@needs_cuda
def test_gpu_no_host_sync_and_graph_capture():
    experts, x, ids, weights, _ = _real_case(16)
    experts(x, ids, weights)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        experts(x, ids, weights)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    static_ids, static_w = ids.clone(), weights.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts(x, static_ids, static_w)
    new_ids, new_w = _route(16, 64, 8, device="cuda", seed=7)
    static_ids.copy_(new_ids)
    static_w.copy_(new_w)
    graph.replay()
    torch.testing.assert_close(out, experts(x, new_ids, new_w), atol=0, rtol=0)
