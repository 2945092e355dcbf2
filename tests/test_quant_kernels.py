"""GGUF block-quantized weights kept packed (rust/quant via sglite.layers.quant_kernels, and
the torch path of quant_formats): every format, kernel (the exact ones on the file's blocks,
the panels' int16 and int8) and instruction set, against a float64 reference built from
gguf-py's dequantized weights; an instruction set this CPU lacks is skipped by name.

Tolerances are error bounds. An f32 dot product of K terms is within `gamma_K * sum |term|`
of the exact one in any summation order (`gamma_K = K u / (1 - K u)`, `u = 2^-24`); a term is
`(|scale * q| + |offset|) * |x|` since the kernels may add a block's scale part and offset part
apart (`offsets()` gets each weight's offset by clearing its levels). The panel kernels are
the exact product with the activations rounded per 32 values (`round_activations`, the
kernels' rule), so they meet that bound against the float64 product with the rounded
activations, and the product with the true ones within `sum |w| * |x - x_rounded|` more.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from sglite.layers import quant_kernels
from sglite.layers.quant_formats import QUANT_TYPES, dequantize, quantize, row_bytes

pytestmark = pytest.mark.skipif(
    quant_kernels.unavailable_reason() is not None, reason="native quant kernels missing"
)

TYPES = list(QUANT_TYPES)
ISAS = quant_kernels.isas()
ALL_ISAS = ("avx512", "avx2vnni", "avx2", "scalar")  # what the kernels are compiled for


def needs(isa: str) -> None:
    if isa not in ISAS:
        pytest.skip(f"this CPU lacks {isa} (it runs {', '.join(ISAS)})")


U = 2.0**-24
# Bytes of each block holding levels (cleared: the weight is its offset) and f16 fields.
LEVEL_BYTES = {
    "Q8_0": (2, 34),
    "Q4_0": (2, 18),
    "Q4_1": (4, 20),
    "Q5_0": (2, 22),
    "Q5_1": (4, 24),
    "Q4_K": (16, 144),
    "Q5_K": (16, 176),
    "Q6_K": (0, 192),
}
HALF_FIELDS = {"Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def gguf_dequantize(qtype: str, data: np.ndarray) -> np.ndarray:
    return quants.dequantize(data, GGMLQuantizationType[qtype]).astype(np.float64)


def random_bytes(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks: every level pattern, with finite f16 scales of 2^-10 .. 2^-1."""
    size = QUANT_TYPES[qtype][1]
    data = rng.integers(0, 256, (rows, row_bytes(qtype, cols)), dtype=np.uint8)
    blocks = data.reshape(-1, size)
    for at in HALF_FIELDS.get(qtype, (0,)):
        halves = rng.uniform(2.0**-10, 0.5, len(blocks)) * rng.choice([-1, 1], len(blocks))
        blocks[:, at : at + 2] = halves.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return data


def quantized(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    return quantize(qtype, w * rng.uniform(0.05, 2.0, (rows, 1)).astype(np.float32))


def offsets(qtype: str, data: np.ndarray) -> np.ndarray:
    """Each weight's offset (the weight with its level cleared)."""
    start, end = LEVEL_BYTES[qtype]
    cleared = data.reshape(-1, QUANT_TYPES[qtype][1]).copy()
    cleared[:, start:end] = 0
    return gguf_dequantize(qtype, cleared.reshape(data.shape))


def round_activations(x: np.ndarray, top: int = 127) -> np.ndarray:
    """The kernels' int8 (`top` 127) or int16 (16383) activations, as float64: per 32 values
    `scale * q`, scale `max|x| / top`, q the nearest integer (ties to even) of `x * top / max|x|`."""
    groups = x.astype(np.float32).reshape(-1, 32)
    amax = np.abs(groups).max(axis=1, keepdims=True)
    inv = np.where(amax > 0, np.float32(top) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(groups * inv), -top, top)
    scale = (amax / np.float32(top)).astype(np.float32)
    return (scale.astype(np.float64) * q).reshape(x.shape)


def check_matmul(qtype, data, x, y, *, int8: bool, top: int = 127) -> None:
    """y (float32 [n, rows]) against the float64 reference (module doc); `int8`: x was
    rounded to `top` levels per 32 values (the panel kernels)."""
    w = gguf_dequantize(qtype, data)
    m = offsets(qtype, data)
    magnitude = np.abs(w - m) + np.abs(m)
    k = w.shape[1]
    gamma = k * U / (1 - k * U) + 4 * U
    x = x.astype(np.float64)
    xr = round_activations(x, top) if int8 else x
    got = y.astype(np.float64)
    tol = gamma * (np.abs(xr) @ magnitude.T) + 1e-30
    assert np.all(np.abs(got - xr @ w.T) <= tol), np.max(np.abs(got - xr @ w.T) / tol)
    if int8:
        rounding = np.abs(x - xr) @ np.abs(w).T
        bound = tol + gamma * (np.abs(x) @ magnitude.T) + rounding
        assert np.all(np.abs(got - x @ w.T) <= bound)


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_equals_gguf_on_every_path(qtype):
    rng = np.random.default_rng(1)
    cols = QUANT_TYPES[qtype][0] * 3
    for data in (random_bytes(qtype, 9, cols, rng), quantized(qtype, 9, cols, rng)):
        want = gguf_dequantize(qtype, data)
        t = torch.from_numpy(data)
        # == rather than bits: gguf-py's d * (q - 8) is -0.0 where d * q + (-8 d) is +0.0
        assert np.array_equal(dequantize(qtype, t, cols).numpy(), want)
        for isa in ISAS:
            assert np.array_equal(quant_kernels.dequantize(qtype, t, cols, isa=isa).numpy(), want)


@pytest.mark.parametrize("qtype", TYPES)
def test_quantize_round_trips_through_gguf(qtype):
    """What `quantize` writes, gguf-py reads back close to the input (the 32-weight types are
    gguf-py's own quantizers; the k-quants ours, which gguf-py only reads)."""
    rng = np.random.default_rng(2)
    cols = QUANT_TYPES[qtype][0] * 2
    w = rng.standard_normal((32, cols)).astype(np.float32)
    data = quantize(qtype, w)
    assert data.shape == (32, row_bytes(qtype, cols)) and data.dtype == np.uint8
    back = gguf_dequantize(qtype, data)
    # relative RMS error of a plain fit on Gaussian weights: ~0.07 at 4 bits, halving per bit
    limit = {"Q8_0": 0.006, "Q6_K": 0.025, "Q5_0": 0.05, "Q5_1": 0.05, "Q5_K": 0.05}
    rel = np.sqrt(((back - w) ** 2).mean() / (w.astype(np.float64) ** 2).mean())
    assert rel < limit.get(qtype, 0.1), rel


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("kernel", quant_kernels.KERNELS)
@pytest.mark.parametrize("isa", ALL_ISAS)
def test_matmul_equals_float64_reference(qtype, kernel, isa):
    needs(isa)
    rng = np.random.default_rng(3)
    block = QUANT_TYPES[qtype][0]
    shapes = (
        [(1, block), (17, 2 * block), (33, 3 * block)]
        if block == 32
        else [
            (3, 256),
            (17, 512),
        ]
    )
    for rows, cols in shapes:
        data = random_bytes(qtype, rows, cols, rng)
        for n in (1, 2, 5, 8, 9, 16):
            x = rng.standard_normal((n, cols)).astype(np.float32) * [1.0, 30.0, 0.01][n % 3]
            y = quant_kernels.matmul(
                torch.from_numpy(x), qtype, torch.from_numpy(data), cols, isa=isa, kernel=kernel
            )
            assert y.shape == (n, rows) and y.dtype == torch.float32
            check_matmul(qtype, data, x, y.numpy(), int8=False)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("precision", quant_kernels.PRECISIONS)
@pytest.mark.parametrize("isa", ALL_ISAS)
def test_panels_equal_float64_reference(qtype, precision, isa):
    """The default kernels: a weight repacked into panels, activations rounded to int16 or
    int8 levels per 32 values; within f32 summation error of the float64 product with the
    rounded activations, on every instruction set, rows of x in blocks and remainders."""
    needs(isa)
    rng = np.random.default_rng(5)
    block = QUANT_TYPES[qtype][0]
    top = {"int16": 16383, "int8": 127}[precision]
    for rows, cols in [(1, block), (17, 2 * block), (40, block)]:
        data = random_bytes(qtype, rows, cols, rng)
        panels = quant_kernels.Panels(qtype, torch.from_numpy(data), cols)
        for n in (1, 3, 9, 17):
            x = rng.standard_normal((n, cols)).astype(np.float32) * [1.0, 30.0, 0.01][n % 3]
            y = torch.empty(n, rows)
            quant_kernels.panel_matmul(
                [panels.segment(0)], torch.from_numpy(x), y, precision, 2, isa
            )
            check_matmul(qtype, data, x, y.numpy(), int8=True, top=top)


@pytest.mark.parametrize("n", [1, 9, 32, 33, 40])
def test_auto_kernel_for_every_batch_size(n):
    """No kernel named: the exact GEMV up to gemv_max_rows() rows of x, the f32 tiles beyond."""
    rng = np.random.default_rng(4)
    assert quant_kernels.gemv_max_rows() == 32
    for qtype in ("Q4_K", "Q4_1", "Q8_0"):
        cols = QUANT_TYPES[qtype][0] * 2
        data = quantized(qtype, 45, cols, rng)
        x = rng.standard_normal((n, cols)).astype(np.float32)
        y = quant_kernels.matmul(torch.from_numpy(x), qtype, torch.from_numpy(data), cols)
        check_matmul(qtype, data, x, y.numpy(), int8=False)


def test_strided_rows_and_column_slices_of_the_output():
    """A row-parallel shard (a window of blocks of every row) into a column slice of a wider
    output, as a merged layer's segment writes it."""
    rng = np.random.default_rng(5)
    qtype, rows, cols = "Q5_K", 21, 1024
    data = torch.from_numpy(random_bytes(qtype, rows, cols, rng))
    window = data[:, 176 : 3 * 176]  # blocks 1 and 2: columns 256:768
    x = rng.standard_normal((6, 512)).astype(np.float32)
    for kernel in quant_kernels.KERNELS:
        out = torch.full((6, rows + 7), float("nan"))
        quant_kernels.matmul(
            torch.from_numpy(x), qtype, window, 512, out[:, 3 : 3 + rows], kernel=kernel
        )
        assert torch.isnan(out[:, :3]).all() and torch.isnan(out[:, 3 + rows :]).all()
        check_matmul(
            qtype,
            window.contiguous().numpy(),
            x,
            out[:, 3 : 3 + rows].numpy(),
            int8=False,
        )


def test_layout_contract_is_checked():
    data = torch.zeros((4, 18), dtype=torch.uint8)  # Q4_0, 32 columns
    x = torch.zeros((2, 32))
    ok = quant_kernels.matmul(x, "Q4_0", data, 32)
    assert ok.shape == (2, 4)
    bad = [
        dict(qtype="Q4_9"),
        dict(weight=data.to(torch.int8)),
        dict(weight=torch.zeros((4, 19), dtype=torch.uint8)),  # not whole blocks
        dict(in_features=48),  # not a multiple of the block
        dict(weight=torch.zeros((18, 4), dtype=torch.uint8).T),  # row bytes not contiguous
        dict(x=torch.zeros((2, 32), dtype=torch.float64)),
        dict(x=torch.zeros((2, 64))[:, ::2]),
        dict(x=torch.zeros((2, 31))),
        dict(out=torch.zeros((2, 5))),
        dict(kernel="gemm"),
        dict(isa="neon"),
    ]
    for case in bad:
        args = dict(x=x, qtype="Q4_0", weight=data, in_features=32) | case
        with pytest.raises(ValueError):
            quant_kernels.matmul(
                args.pop("x"),
                args.pop("qtype"),
                args.pop("weight"),
                args.pop("in_features"),
                **args,
            )
    with pytest.raises(ValueError):
        dequantize("Q4_K", torch.zeros((1, 144), dtype=torch.uint8), 128)
