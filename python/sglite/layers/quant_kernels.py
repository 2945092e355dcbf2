"""Launcher of the native CPU kernels for GGUF block-quantized weights (`sglite._core.quant_*`,
rust/quant): `y = x W^T` and dequantization, W kept as the file's blocks.

A weight is a uint8 tensor `[rows, row_bytes]` of whole blocks, exactly the bytes of a GGUF
tensor (`quant_formats.row_bytes(qtype, in_features)` per row). Rows may be strided (a
row-parallel shard is a window of whole blocks of each row: `narrow(1, ...)` of the file's
rows), the bytes of a row must be contiguous. This module checks that layout contract,
keeps the tensors alive for each call and runs the kernels on torch's OpenMP team.

Two layouts. The file's (`matmul`, `Prepared`): `gemv` and `gemm_f32` (`KERNELS`) are exact,
the weights dequantized to f32 in registers or tiles (the `exact` kernel); `None` picks the
GEMV up to `gemv_max_rows()` rows of x, the tiles beyond. Panels (`Panels`, `panel_matmul`): the weight
repacked once into panels of 16 rows (rust/quant/src/panel.rs), one kernel for every batch
size with the activations rounded per 32 values to `int16` levels (+-16383: the default, within
~3e-5 of the exact product) or `int8` (llama.cpp's rounding). Instruction sets: `isas()`,
fastest first; `None` is the fastest.
"""

from __future__ import annotations

import functools
import mmap

import torch

from sglite.layers.quant_formats import QUANT_TYPES, row_bytes

KERNELS = ("gemv", "gemm_f32")


@functools.cache
def _native():
    """`sglite._core` when it has the kernels, else None."""
    try:
        from sglite import _core
    except ImportError:
        return None
    if not hasattr(_core, "quant_matmul"):
        return None
    from sglite.attention.cpu_kernel import share_torch_openmp

    share_torch_openmp()
    return _core


def unavailable_reason() -> str | None:
    """None when the kernels can run here, else why not."""
    if _native() is None:
        return "the native module sglite._core lacks quant_matmul (not built, or older)"
    return None


def limit_isa(name: str) -> str:
    """Cap every CPU kernel's instructions at `name` (sglite.env's SGL_CPU_ISA choices);
    returns the fastest they now use."""
    return _native().limit_cpu_isa(name)


def isas() -> tuple[str, ...]:
    """The instruction sets this CPU runs the kernels with, fastest first; () without them."""
    core = _native()
    return tuple(core.quant_isas()) if core is not None else ()


def gemv_max_rows() -> int:
    """The most activation rows the automatic choice sends to the exact GEMV (beyond: the
    tiles, whose cost per call of dequantizing W pays off from ~32 rows)."""
    core = _native()
    return core.GEMV_MAX_ROWS if core is not None else 0


def check_weight(qtype: str, weight: torch.Tensor, in_features: int) -> None:
    """Raise ValueError unless `weight` holds rows of `in_features` weights in `qtype` blocks."""
    if qtype not in QUANT_TYPES:
        raise ValueError(f"quant type {qtype!r}: one of {', '.join(QUANT_TYPES)}")
    need = row_bytes(qtype, in_features)  # raises on a partial block
    if weight.dtype != torch.uint8 or weight.dim() != 2:
        raise ValueError(
            f"{qtype} weight must be 2-D uint8 [rows, bytes], got {weight.dtype} "
            f"{tuple(weight.shape)}"
        )
    if weight.shape[1] != need:
        raise ValueError(
            f"{qtype} weight rows have {weight.shape[1]} bytes; {in_features} weights take {need}"
        )
    if weight.shape[1] > 1 and weight.stride(1) != 1:
        raise ValueError(f"{qtype} weight: each row's bytes must be contiguous")
    if weight.device.type != "cpu":
        raise ValueError(f"{qtype} weight is on {weight.device}; the native kernels run on CPU")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """(address, element count from the first to past the last) of a 2-D row-strided view."""
    rows, width = t.shape
    count = 0 if rows == 0 else (rows - 1) * t.stride(0) + width
    return t.data_ptr(), count


def _row_stride(t: torch.Tensor) -> int:
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


class Prepared:
    """A weight checked once (`check_weight`) for many calls: the layers' path, which then
    pays one native call per segment and nothing else (a decode step makes hundreds)."""

    def __init__(self, qtype: str, weight: torch.Tensor, in_features: int) -> None:
        core = _native()
        if core is None:
            raise ValueError(unavailable_reason())
        check_weight(qtype, weight, in_features)
        self.core, self.weight, self.rows = core, weight, weight.shape[0]
        self.args = (qtype, _span(weight), self.rows, in_features, _row_stride(weight))

    def run(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        col: int,
        kernel: str | None,
        num_threads: int,
        isa: str | None = None,
    ) -> None:
        """`out[:, col : col + rows] = x W^T`. The caller guarantees x float32 `[n, in]`
        contiguous and out float32 `[n, ld]` contiguous, both on the CPU (the native side
        checks every size again)."""
        n, ld = out.shape
        span = (out.data_ptr() + 4 * col, (n - 1) * ld + self.rows if n else 0)
        x_raw = (x.data_ptr(), x.numel())
        self.core.quant_matmul(*self.args, x_raw, n, span, ld, isa, kernel, num_threads)


PRECISIONS = ("int16", "int8")


class Panels:
    """A weight repacked into panels of 16 rows (owns its bytes, about the file's size)."""

    def __init__(self, qtype: str, weight: torch.Tensor, in_features: int) -> None:
        core = _native()
        if core is None:
            raise ValueError(unavailable_reason())
        check_weight(qtype, weight, in_features)
        self.core, self.qtype, self.in_features = core, qtype, in_features
        self.rows = weight.shape[0]
        self.data = huge_page_empty(core.quant_panel_bytes(qtype, self.rows, in_features))
        core.quant_repack(
            qtype, _span(weight), self.rows, in_features, _row_stride(weight),
            (self.data.data_ptr(), self.data.numel()), torch.get_num_threads(),
        )  # fmt: skip

    def segment(self, col: int) -> tuple:
        """This weight as a segment of `panel_matmul` writing columns `col ..`."""
        return (self.qtype, (self.data.data_ptr(), self.data.numel()), self.rows, col)

    def dequantize(self) -> torch.Tensor:
        """float32 `[rows, in_features]`."""
        out = torch.empty((self.rows, self.in_features), dtype=torch.float32)
        self.core.quant_panel_dequantize(
            self.qtype, (self.data.data_ptr(), self.data.numel()), self.rows, self.in_features,
            (out.data_ptr(), out.numel()),
        )  # fmt: skip
        return out


def panel_matmul(
    segments: list[tuple],
    x: torch.Tensor,
    out: torch.Tensor,
    precision: str,
    num_threads: int,
    isa: str | None = None,
) -> None:
    """`out[:, col_s : col_s + rows_s] = x W_s^T` for `Panels.segment(col_s)` of one
    `in_features`. The caller guarantees x float32 `[n, in]` and out float32 `[n, ld]`,
    contiguous, on the CPU (the native side checks every size again)."""
    n, ld = out.shape
    _native().quant_panel_matmul(
        segments, x.shape[1], (x.data_ptr(), x.numel()), n, (out.data_ptr(), out.numel()), ld,
        precision, isa, num_threads,
    )  # fmt: skip


def huge_page_empty(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of `nbytes` in an anonymous mapping of its own that the kernel may back
    with 2 MB pages (Linux's transparent huge pages, asked for by madvise): a 7B's panels
    take 512x fewer page faults to fill, and its decode step streams them with 512x fewer
    TLB entries. Plain memory where the platform has no such advice."""
    if nbytes < 2 << 20 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=torch.uint8)  # holds `region` alive


def release_mapped_pages(view: torch.Tensor, source: mmap.mmap) -> None:
    """Drop this process's mapping of the whole pages under `view` (bytes of the read-only
    file mapping `source`): they leave the RSS, and come back from the page cache if read."""
    base = _mapping_address(source)
    start = view.data_ptr() - base
    end = start + _span(view)[1] * view.element_size()
    if start < 0 or end > len(source):
        raise ValueError("the view is not inside the mapping")
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page
    if last > first:
        source.madvise(mmap.MADV_DONTNEED, first, last - first)


def _mapping_address(source: mmap.mmap) -> int:
    import numpy as np

    return np.frombuffer(source, dtype=np.uint8, count=1).ctypes.data


def segments_call(native: list[tuple[int, Prepared | torch.Tensor]]) -> tuple | None:
    """`(sglite._core.quant_matmul_many, its segment arguments)` for a merged weight's
    prepared segments `[(first output column, Prepared)]`: one native call that rounds x
    once and spreads every segment's rows over the threads (q, k and v; gate and up). None
    for a single segment or one held as float rows."""
    core = _native()
    if len(native) < 2 or not hasattr(core, "quant_matmul_many"):
        return None
    if not all(isinstance(p, Prepared) for _, p in native):
        return None
    # Prepared.args: (qtype, span, rows, in_features, row stride)
    args = [(p.args[0], p.args[1], p.args[2], p.args[4], col) for col, p in native]
    return core.quant_matmul_many, args


def matmul(
    x: torch.Tensor,
    qtype: str,
    weight: torch.Tensor,
    in_features: int,
    out: torch.Tensor | None = None,
    *,
    isa: str | None = None,
    kernel: str | None = None,
    num_threads: int | None = None,
) -> torch.Tensor:
    """`x W^T` for x float32 `[n, in_features]` (contiguous). Writes `out` `[n, rows]` (float32,
    rows of it may be strided: a column slice of a wider output) when given, else a new
    tensor; returns it."""
    prepared = Prepared(qtype, weight, in_features)
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be float32 [n, {in_features}], got {x.dtype} {tuple(x.shape)}")
    if x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError("x must be a contiguous CPU tensor")
    rows = prepared.rows
    if out is None:
        out = torch.empty((x.shape[0], rows), dtype=torch.float32)
    elif (
        out.dtype != torch.float32
        or out.device.type != "cpu"
        or out.shape != (x.shape[0], rows)
        or (rows > 1 and out.stride(1) != 1)
    ):
        raise ValueError(
            f"out must be float32 [{x.shape[0]}, {rows}] on CPU with contiguous rows, got "
            f"{out.dtype} {tuple(out.shape)}"
        )
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r}: one of {', '.join(KERNELS)}")
    prepared.core.quant_matmul(
        *prepared.args,
        (x.data_ptr(), x.numel()),
        x.shape[0],
        _span(out),
        _row_stride(out),
        isa,
        kernel,
        num_threads if num_threads is not None else torch.get_num_threads(),
    )
    return out


def dequantize(
    qtype: str,
    weight: torch.Tensor,
    in_features: int,
    *,
    isa: str | None = None,
    num_threads: int | None = None,
) -> torch.Tensor:
    """The weight as float32 `[rows, in_features]` (each value rounded once, as gguf-py)."""
    core = _native()
    if core is None:
        raise ValueError(unavailable_reason())
    check_weight(qtype, weight, in_features)
    out = torch.empty((weight.shape[0], in_features), dtype=torch.float32)
    core.quant_dequantize(
        qtype,
        _span(weight),
        weight.shape[0],
        in_features,
        _row_stride(weight),
        (out.data_ptr(), out.numel()),
        isa,
        num_threads if num_threads is not None else torch.get_num_threads(),
    )
    return out
