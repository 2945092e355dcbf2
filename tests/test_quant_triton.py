"""The Triton FP8 and AWQ/GPTQ int4 GEMMs (sglite_kernels.quant_gemm) against the torch
references of quant_ref, and the references' packing against the checkpoint formats.

On CPU the kernels run through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET)
at small shapes with 16/32-wide tiles, so that several M, N and K tiles, ragged edges, split
K and each scale kind are crossed: odd M, group sizes 32/64/128/-1 and 8 (narrower than a
tile), GPTQ act-order g_idx, symmetric GPTQ, biases, fp32 / bf16 / fp16. Tolerances:
fp32 1e-4 relative to the output's scale (fp32 accumulation in another order); half dtypes
2e-2 (the output rounded to bf16/fp16, and per-element-scaled weights rounded to x's dtype).
The `gpu` cases run the compiled kernels at 4096x4096, M 1/16/256, bf16, and under
CUDA-graph capture.
"""

from __future__ import annotations

import functools
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
from sglite_kernels import interpreted  # noqa: E402
from sglite_kernels.quant_gemm import (  # noqa: E402
    Tiles,
    fp8_dequantize,
    fp8_linear,
    fp8_quantize_rows,
    gptq_g_idx_is_trivial,
    int4_dequantize,
    int4_linear,
    tile_table,
)
from sglite_kernels.quant_ref import AWQ_ORDER, int4_pack  # noqa: E402

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA or interpreted(), reason="needs CUDA, compiled")
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
SPLIT_TILES = Tiles(16, 16, 16, split_k=3)


@pytest.fixture(autouse=True)
def _cpu_cases_need_the_interpreter(request):
    if request.node.get_closest_marker("gpu") is None and not interpreted():
        pytest.skip("CPU quant GEMM cases need Triton's interpreter, off under SGL_TEST_GPU=1")


def _close(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert y.dtype == dtype and y.shape == ref.shape
    scale = ref.abs().max().item() + 1e-6
    err = (y.float() - ref).abs().max().item()
    assert err <= TOL[dtype] * scale, f"max |err| {err:.3e} vs output scale {scale:.3e}"


def _int4_case(k, n, group_size, layout, *, zeros=True, act_order=False, seed=0, device="cpu"):
    """Random int4 values, zeros and fp16 scales packed as the layout stores them."""
    gen = torch.Generator().manual_seed(seed)
    groups = 1 if group_size == -1 else k // group_size
    q = torch.randint(0, 16, (k, n), generator=gen)
    # GPTQ v1 stores zero - 1, so a zero of 0 does not round-trip (it reads as 16)
    z = torch.randint(1 if layout == "gptq" else 0, 16, (groups, n), generator=gen)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.005).half()
    g_idx = None
    if act_order:
        g_idx = (torch.arange(k) // group_size)[torch.randperm(k, generator=gen)].to(torch.int32)
    qweight, qzeros = int4_pack(q, z if zeros else None, layout)
    g = (
        g_idx.long()
        if g_idx is not None
        else torch.arange(k) // (k if group_size == -1 else group_size)
    )
    w = scales.float()[g] * (q - (z[g] if zeros else 8)).float()
    move = {"qweight": qweight, "scales": scales, "qzeros": qzeros, "g_idx": g_idx}
    return {name: t.to(device) if t is not None else None for name, t in move.items()}, w.to(device)


def _x(m, k, dtype, seed=1, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)


def _bits(word: torch.Tensor) -> int:
    return word.item() & 0xFFFFFFFF


def test_awq_and_gptq_packing_bits():
    """The nibble of each column / row, checked on the raw int32 bits (AutoAWQ packs column
    8j + ORDER[i] into nibble i; GPTQ packs rows low nibble first, qzeros as zero - 1)."""
    q = torch.arange(1, 9).repeat(8, 1)  # [8, 8]: column c holds c + 1
    qweight, qzeros = int4_pack(q, q[:1], "awq")
    want = sum((AWQ_ORDER[i] + 1) << (4 * i) for i in range(8))
    assert qweight.dtype == torch.int32 and qweight.shape == (8, 1)
    assert _bits(qweight[0, 0]) == want and _bits(qzeros[0, 0]) == want
    qweight, qzeros = int4_pack(q.T.contiguous(), q[:1], "gptq")  # row r holds r + 1
    assert qweight.shape == (1, 8)
    assert _bits(qweight[0, 0]) == sum((i + 1) << (4 * i) for i in range(8))
    assert _bits(qzeros[0, 0]) == sum(i << (4 * i) for i in range(8))  # zero - 1


def test_reference_dequantize_matches_the_formula():
    for layout in ("awq", "gptq"):
        tensors, w = _int4_case(64, 48, 16, layout)
        assert torch.equal(int4_dequantize(group_size=16, layout=layout, **tensors), w)
    # GPTQ v1: a stored 15 (zero 0 packed as -1) reads as 16, as GPTQ v1 kernels read it
    qweight, qzeros = int4_pack(torch.zeros(8, 8, dtype=torch.long), torch.zeros(1, 8), "gptq")
    w = int4_dequantize(qweight, torch.ones(1, 8), qzeros, -1, "gptq")
    assert torch.equal(w, torch.full((8, 8), -16.0))
    assert gptq_g_idx_is_trivial(torch.arange(256, dtype=torch.int32) // 128, 128)
    assert not gptq_g_idx_is_trivial(torch.arange(256, dtype=torch.int32).flip(0) // 128, 128)


@pytest.mark.parametrize("layout", ["awq", "gptq"])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_group_sizes(layout, group_size, dtype):
    tensors, w = _int4_case(256, 80, group_size, layout)  # N 80: a ragged last N tile
    x = _x(7, 256, dtype)
    y = int4_linear(x, group_size=group_size, layout=layout, **tensors)
    _close(y, x.float() @ w, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zeros", [True, False])
def test_gptq_act_order_g_idx(dtype, zeros):
    tensors, w = _int4_case(128, 64, 32, "gptq", zeros=zeros, act_order=True, seed=2)
    x = _x(5, 128, dtype)
    y = int4_linear(x, group_size=32, layout="gptq", **tensors)
    _close(y, x.float() @ w, dtype)
    ref = int4_dequantize(group_size=32, layout="gptq", **tensors)
    assert torch.equal(ref, w)


@pytest.mark.parametrize("layout", ["awq", "gptq"])
def test_int4_bias_split_k_leading_dims_and_narrow_groups(layout):
    tensors, w = _int4_case(192, 40, 8, layout, seed=3)  # groups of 8: scaled per element
    bias = torch.randn(40)
    x = _x(6, 192, torch.float32).reshape(2, 3, 192)
    ref = x @ w + bias
    _close(int4_linear(x, group_size=8, layout=layout, bias=bias, **tensors), ref, torch.float32)
    y = int4_linear(x, group_size=8, layout=layout, bias=bias, tiles=SPLIT_TILES, **tensors)
    _close(y, ref, torch.float32)
    tensors, w = _int4_case(192, 40, 64, layout, seed=4)
    y = int4_linear(x[:1, :1], group_size=64, layout=layout, tiles=SPLIT_TILES, **tensors)
    _close(y, x[:1, :1] @ w, torch.float32)  # M = 1, split K over aligned groups


def test_int4_fp16_and_empty_batch():
    tensors, w = _int4_case(64, 32, 32, "awq")
    x = _x(3, 64, torch.float16)
    _close(int4_linear(x, group_size=32, layout="awq", **tensors), x.float() @ w, torch.float16)
    assert int4_linear(x[:0], group_size=32, layout="awq", **tensors).shape == (0, 32)


def _fp8_case(n, k, kind, block=(32, 32), seed=5, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    if kind == "tensor":
        scale = torch.tensor(0.003)
    elif kind == "tensor1":
        scale = torch.tensor([0.003])
    elif kind == "channel":
        scale = torch.rand(n, generator=gen) * 0.004 + 0.001
    elif kind == "channel2d":
        scale = torch.rand(n, 1, generator=gen) * 0.004 + 0.001
    else:
        shape = (-(-n // block[0]), -(-k // block[1]))
        scale = torch.rand(shape, generator=gen) * 0.004 + 0.001
    block_size = block if kind == "block" else None
    w = weight.float() * _expand(scale, n, k, block_size)
    return weight.to(device), scale.to(device), block_size, w.to(device)


def _expand(scale, n, k, block_size):
    """The scale of each weight element, written out element by element."""
    if block_size is None:
        return scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(())
    rows = torch.arange(n)[:, None] // block_size[0]
    cols = torch.arange(k)[None, :] // block_size[1]
    return scale[rows, cols]


@pytest.mark.parametrize("kind", ["tensor", "tensor1", "channel", "channel2d", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_scale_kinds(kind, dtype):
    weight, scale, block_size, w = _fp8_case(72, 112, kind)  # ragged: 72 % 32, 112 % 32
    assert torch.equal(fp8_dequantize(weight, scale, block_size), w)
    x = _x(9, 112, dtype)
    _close(fp8_linear(x, weight, scale, block_size), x.float() @ w.T, dtype)


@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
def test_fp8_w8a8_dynamic_per_token(kind):
    """w8a8: x quantized per token to fp8 (scale max|row| / 448), fp8 x fp8 products; equal
    to the fp32 product of the quantized operands, within 1e-1 of the unquantized one."""
    weight, scale, block_size, w = _fp8_case(72, 112, kind, seed=7)
    x = _x(9, 112, torch.bfloat16) * torch.linspace(0.1, 10, 9)[:, None].bfloat16()
    xq, xs = fp8_quantize_rows(x)
    assert xq.dtype == torch.float8_e4m3fn and xs.shape == (9,)
    assert torch.equal(xq.float().abs().amax(-1), torch.full((9,), 448.0))
    ref = (xq.float() * xs[:, None]) @ w.T
    bias = torch.randn(72).bfloat16()
    y = fp8_linear(x, weight, scale, block_size, bias, w8a8=True)
    _close(y, ref + bias.float(), torch.bfloat16)
    y = fp8_linear(x, weight, scale, block_size, w8a8=True, tiles=SPLIT_TILES)
    _close(y, ref, torch.bfloat16)
    exact = x.float() @ w.T
    assert (y.float() - exact).abs().max() <= 0.1 * exact.abs().max()


def test_fp8_128_blocks_bias_split_k_and_fp16():
    weight, scale, block_size, w = _fp8_case(160, 320, "block", block=(128, 128), seed=6)
    bias = torch.randn(160)
    x = _x(3, 320, torch.float32).reshape(3, 1, 320)
    ref = x @ w.T + bias
    _close(fp8_linear(x, weight, scale, block_size, bias), ref, torch.float32)
    _close(fp8_linear(x, weight, scale, block_size, bias, tiles=SPLIT_TILES), ref, torch.float32)
    x16 = x.half()
    _close(
        fp8_linear(x16, weight, scale, block_size, bias.half()),
        x16.float() @ w.T + bias,
        torch.float16,
    )


def test_tile_table_splits_k_for_decode_only():
    """H200: 132 SMs. Decode rows split K until ~2 programs per SM (keeping >= 4 K tiles per
    split); prefill splits only under half a wave; tiles grow with M."""
    decode = tile_table(1, 4096, 4096, 132)
    assert decode.block_m == 16 and decode.split_k == 5  # 64 N tiles x 5 >= 264
    assert tile_table(1, 14336, 4096, 132).split_k == 2
    assert tile_table(1, 4096, 512, 132).split_k == 1  # 4 K tiles: no split
    assert [tile_table(m, 4096, 4096, 132).block_m for m in (16, 17, 64, 65, 256, 257)] == [
        16,
        32,
        32,
        64,
        64,
        128,
    ]
    assert tile_table(2048, 4096, 4096, 132).split_k == 1
    assert tile_table(256, 4096, 4096, 132).split_k == 1  # 128 tiles: one near-full wave
    assert tile_table(256, 1024, 4096, 132).split_k == 5  # 32 tiles: split to 132 / 32


def test_validation_errors_name_the_field():
    tensors, _ = _int4_case(64, 32, 32, "awq")
    x = _x(2, 64, torch.float32)
    cases = [
        (dict(layout="marlin"), "layout"),
        (dict(group_size=48), "multiple of group_size"),
        (dict(group_size=0), "group_size"),
        (dict(scales=tensors["scales"][:1]), "scales"),
        (dict(qzeros=tensors["qzeros"].to(torch.int64)), "qzeros"),
        (dict(qweight=tensors["qweight"].float()), "qweight"),
        (dict(g_idx=torch.zeros(64, dtype=torch.int32)), "g_idx"),
        (dict(bias=torch.zeros(31)), "bias"),
    ]
    for change, match in cases:
        kw = dict(tensors, group_size=32, layout="awq") | change
        with pytest.raises(ValueError, match=match):
            int4_linear(x, **kw)
    with pytest.raises(ValueError, match="in 64"):
        int4_linear(_x(2, 63, torch.float32), group_size=32, layout="awq", **tensors)
    with pytest.raises(ValueError, match="x must be"):
        int4_linear(x.to(torch.int32), group_size=32, layout="awq", **tensors)
    weight, scale, _, _ = _fp8_case(64, 64, "channel")
    with pytest.raises(ValueError, match="weight must be float8_e4m3fn"):
        fp8_linear(x, weight.float(), scale)
    with pytest.raises(ValueError, match="weight_scale must be"):
        fp8_linear(x, weight, scale[:10])
    with pytest.raises(ValueError, match=r"weight_scale must be \[2, 2\]"):
        fp8_linear(x, weight, scale, (32, 32))
    with pytest.raises(ValueError, match="multiple of 16"):
        fp8_linear(x, weight, torch.ones(8, 8), (8, 8))
    with pytest.raises(ValueError, match="block_size"):
        fp8_linear(x, weight, scale, 32)
    with pytest.raises(ValueError, match="tiles"):
        fp8_linear(x, weight, scale, tiles=Tiles(16, 8, 16))


def test_kernels_compile_for_hopper_and_pipeline():
    """The compiled (not interpreted) kernels: built for sm_90 by Triton's own ptxas at
    tile_table's four tile rows, each format, loads software-pipelined, shared
    memory within an H100/H200's 227 KiB per block. Needs no GPU."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(str(root / d) for d in ("tests", "kernels", "python"))
    script = root / "tests" / "fixtures" / "quant_aot.py"
    run = subprocess.run(
        [sys.executable, str(script), "90"], env=env, capture_output=True, text=True, timeout=300
    )
    if run.returncode and "ptxas" in run.stderr and "not found" in run.stderr.lower():
        pytest.skip("Triton's ptxas is not installed")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if "smem" in line]
    assert len(lines) == 20 and all(line.endswith(", pipelined") for line in lines), run.stdout
    smem = [int(m) for m in re.findall(r": (\d+) B smem", run.stdout)]
    assert len(smem) == 20 and max(smem) <= 227 * 1024


# ---- compiled on a GPU: real shapes ----


@functools.lru_cache(maxsize=1)
def _gpu_int4(case):
    """One 4096x4096 weight per case, shared by its M values (packing 16M values is slow)."""
    layout = "awq" if case == "awq" else "gptq"
    kw = dict(zeros=case != "gptq_sym", act_order=case == "gptq_act_order")
    return layout, *_int4_case(4096, 4096, 128, layout, device="cuda", **kw)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 16, 256])
@pytest.mark.parametrize("case", ["awq", "gptq", "gptq_act_order", "gptq_sym"])
def test_gpu_int4_4096(m, case):
    layout, tensors, w = _gpu_int4(case)
    x = _x(m, 4096, torch.bfloat16, device="cuda")
    y = int4_linear(x, group_size=128, layout=layout, **tensors)
    _close(y, x.float() @ w, torch.bfloat16)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 16, 256])
@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
def test_gpu_fp8_4096(m, kind):
    weight, scale, block_size, w = _fp8_case(4096, 4096, kind, block=(128, 128), device="cuda")
    x = _x(m, 4096, torch.bfloat16, device="cuda")
    bias = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    y = fp8_linear(x, weight, scale, block_size, bias)
    _close(y, x.float() @ w.T + bias.float(), torch.bfloat16)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [16, 256])
@pytest.mark.parametrize("kind", ["channel", "block"])
def test_gpu_fp8_w8a8_4096(m, kind):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need sm_89+")
    weight, scale, block_size, w = _fp8_case(4096, 4096, kind, block=(128, 128), device="cuda")
    x = _x(m, 4096, torch.bfloat16, device="cuda")
    xq, xs = fp8_quantize_rows(x)
    y = fp8_linear(x, weight, scale, block_size, w8a8=True)
    _close(y, (xq.float() * xs[:, None]) @ w.T, torch.bfloat16)


@gpu
@needs_cuda
def test_gpu_graph_capture():
    """No host sync: both GEMMs (split K at M 4) replay from a CUDA graph."""
    tensors, w = _int4_case(4096, 1024, 128, "awq", device="cuda")
    weight, scale, block_size, w8 = _fp8_case(1024, 4096, "block", block=(128, 128), device="cuda")
    x = _x(4, 4096, torch.bfloat16, device="cuda")

    def step():
        return (
            int4_linear(x, group_size=128, layout="awq", **tensors),
            fp8_linear(x, weight, scale, block_size),
        )

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y4, y8 = step()
    x.copy_(_x(4, 4096, torch.bfloat16, seed=9, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    _close(y4, x.float() @ w, torch.bfloat16)
    _close(y8, x.float() @ w8.T, torch.bfloat16)
