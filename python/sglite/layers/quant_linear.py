"""Linear layers over GGUF block-quantized weights kept as the file's bytes.

`PackedRows` is a window of a quantized tensor: uint8 `[rows, row_bytes]` of whole blocks,
usually a zero-copy view of the mmap'd file. `PackedWeight` is a layer's weight
`[out_features, in_features]` as such windows placed at row offsets: a merged or QKV layer
gets one per checkpoint tensor, each in its own format (a Q4_K_M file keeps `attn_v` in Q6_K
next to Q4_K `attn_q`), and one output tensor takes their columns side by side. With the
`int16` (default) or `int8` kernel, `PackedWeight.repack()` (at load, on CPU) turns each
segment into `PanelRows`, the same blocks in panels of 16 rows (quant_kernels.Panels), and
gives the file's pages back (they leave the RSS): one copy of every weight.

`Quant*Linear` are the layers of `sglite.layers.linear` with the same constructors, TP shapes
and placement code (`place()`: column-parallel layers take whole rows, row-parallel ones a
window of whole blocks of every row, which needs `in_features / tp_size` to be a multiple of
the block). They allocate no float weight; the packed rows arrive by `load_packed(rows,
shard_id)` and the bias (float) by its parameter's `weight_loader` as before. Forward, in the
activations' dtype: on CPU the native kernels (`quant_kernels`: a GEMV for decode, int8 tiles
for prefill); elsewhere, or without the native module, the weight dequantized by torch
(`quant_formats.dequantize`) for each call. A tensor the file stores in a float type (or a
block type these kernels lack) arrives as `DenseRows` (float32) and is multiplied by torch.
`packed_class(cls)` maps each float layer class to its packed twin. A safetensors-quantized
checkpoint's rows (sglite.layers.quant_rows: w8a8 int8, fp8 and int4 for CUDA) are segments
too, ones that multiply themselves (`matmul`); a plain float tensor given to `load_packed` (a
layer the checkpoint kept float) becomes `DenseRows`.
"""

from __future__ import annotations

import mmap
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from sglite.layers import quant_kernels
from sglite.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    Placement,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from sglite.layers.quant_formats import QUANT_TYPES, dequantize, row_bytes


@dataclass(frozen=True)
class PackedRows:
    """`data` uint8 `[rows, row_bytes]`: rows of `in_features` weights in `qtype` blocks.
    Rows may be strided (a window of blocks of each row); a row's bytes are contiguous."""

    qtype: str
    data: torch.Tensor
    in_features: int
    # the read-only file mapping `data` views (None: memory of its own)
    source: mmap.mmap | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.qtype not in QUANT_TYPES:
            raise ValueError(f"quant type {self.qtype!r}: one of {', '.join(QUANT_TYPES)}")
        need = row_bytes(self.qtype, self.in_features)
        data = self.data
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != need:
            raise ValueError(
                f"{self.qtype} rows of {self.in_features} weights must be uint8 [rows, {need}], "
                f"got {data.dtype} {tuple(data.shape)}"
            )
        if data.shape[1] > 1 and data.stride(1) != 1:
            raise ValueError(f"{self.qtype} rows: each row's bytes must be contiguous")

    @classmethod
    def from_buffer(
        cls, qtype: str, raw: np.ndarray | torch.Tensor, shape: tuple[int, int]
    ) -> PackedRows:
        """A tensor's bytes as a GGUF file stores them (numpy or torch uint8, any shape,
        contiguous: e.g. `GGUFReader`'s mmap'd `tensor.data`, read-only), for the logical
        `shape` `(out_features, in_features)` (GGUF lists the dims the other way round).
        Zero-copy."""
        source = None
        if isinstance(raw, np.ndarray):
            source = _mapping_of(raw)
            with warnings.catch_warnings():  # a read-only mmap: nothing here writes to it
                warnings.filterwarnings("ignore", message=".*not writable.*")
                data = torch.from_numpy(raw)
        else:
            data = raw
        rows, cols = shape
        if data.dtype != torch.uint8 or not data.is_contiguous():
            raise ValueError(f"{qtype} tensor bytes must be contiguous uint8, got {data.dtype}")
        if data.numel() != rows * row_bytes(qtype, cols):
            raise ValueError(
                f"{qtype} tensor of shape {shape} takes {rows * row_bytes(qtype, cols)} bytes, "
                f"got {data.numel()}"
            )
        return cls(qtype, data.reshape(rows, row_bytes(qtype, cols)), cols, source)

    @property
    def num_rows(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_rows, self.in_features)

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> PackedRows:
        """Rows `start : start + length` (dim 0), or columns (dim 1: whole blocks only)."""
        if not 0 <= start <= start + length <= self.shape[dim if dim in (0, 1) else 0]:
            raise ValueError(
                f"{self.qtype} tensor {self.shape}: no {['rows', 'columns'][dim == 1]} "
                f"{start}:{start + length} (does the checkpoint fit the model's shapes?)"
            )
        if dim == 0:
            data = self.data.narrow(0, start, length)
            return PackedRows(self.qtype, data, self.in_features, self.source)
        if dim != 1:
            raise ValueError(f"PackedRows.narrow: dim must be 0 or 1, got {dim}")
        block, size = QUANT_TYPES[self.qtype][:2]
        if start % block or length % block:
            raise ValueError(
                f"a shard of columns {start}:{start + length} of a {self.qtype} weight is not "
                f"whole blocks of {block} (row-parallel layers need in_features / tp_size to "
                f"be a multiple of {block})"
            )
        data = self.data.narrow(1, start // block * size, length // block * size)
        return PackedRows(self.qtype, data, length, self.source)

    def take_rows(self, index: torch.Tensor) -> PackedRows:
        """The rows at `index` (a copy), e.g. to undo llama.cpp's Q/K row permutation."""
        return PackedRows(self.qtype, self.data.index_select(0, index), self.in_features)

    def split(self, sizes: list[int]) -> list[PackedRows]:
        """Consecutive row windows of `sizes` rows (a fused tensor's parts; zero-copy)."""
        return _split_rows(self, sizes)

    def dequantize(self) -> torch.Tensor:
        """float32 `[rows, in_features]` by torch, on the data's device."""
        return dequantize(self.qtype, self.data, self.in_features)

    def release_pages(self) -> None:
        """Give back this process's mapping of the file pages under these rows (no-op for
        rows in memory of their own); reading them again maps them back."""
        if self.source is not None:
            quant_kernels.release_mapped_pages(self.data, self.source)


def _mapping_of(raw: np.ndarray) -> mmap.mmap | None:
    """The mmap a numpy array views, if any."""
    base = raw
    while base is not None:
        if isinstance(base, mmap.mmap):
            return base
        nxt = getattr(base, "base", None)
        base = nxt if nxt is not None else getattr(base, "obj", None)
    return None


@dataclass(frozen=True)
class PanelRows:
    """Rows repacked into panels for the int16 / int8 kernels (`PackedWeight.repack`)."""

    panels: quant_kernels.Panels

    @property
    def qtype(self) -> str:
        return self.panels.qtype

    @property
    def data(self) -> torch.Tensor:
        return self.panels.data

    @property
    def num_rows(self) -> int:
        return self.panels.rows

    @property
    def in_features(self) -> int:
        return self.panels.in_features

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_rows, self.in_features)

    def dequantize(self) -> torch.Tensor:
        return self.panels.dequantize()


@dataclass(frozen=True)
class DenseRows:
    """Float32 rows `[rows, in_features]` in a packed layer: what the file stores in F32, F16
    or BF16 (or in a block type without native kernels), dequantized once at load."""

    data: torch.Tensor
    qtype: str = "F32"

    @property
    def num_rows(self) -> int:
        return self.data.shape[0]

    @property
    def in_features(self) -> int:
        return self.data.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_rows, self.in_features)

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> DenseRows:
        return DenseRows(self.data.narrow(dim, start, length), self.qtype)

    def take_rows(self, index: torch.Tensor) -> DenseRows:
        return DenseRows(self.data.index_select(0, index), self.qtype)

    def split(self, sizes: list[int]) -> list[DenseRows]:
        return _split_rows(self, sizes)

    def dequantize(self) -> torch.Tensor:
        return self.data.float()


def _split_rows(rows, sizes: list[int]) -> list:
    if sum(sizes) != rows.num_rows:
        raise ValueError(f"cannot split {rows.num_rows} {rows.qtype} rows into {list(sizes)}")
    starts = np.cumsum([0, *sizes[:-1]]).tolist()
    return [rows.narrow(0, start, size) for start, size in zip(starts, sizes)]


Rows = PackedRows | DenseRows | PanelRows


class PackedWeight:
    """A layer's weight `[out_features, in_features]` as `PackedRows` at row offsets."""

    def __init__(self, out_features: int, in_features: int) -> None:
        self.out_features, self.in_features = out_features, in_features
        self.segments: list[tuple[int, Rows]] = []
        # None or "int16": the panel kernels with int16 activations (the default); "int8":
        # with int8 ones; "exact": float32 activations on the file's blocks (the GEMV up to
        # quant_kernels.gemv_max_rows() rows, the f32 tiles beyond); or one file kernel
        self.kernel: str | None = None
        self._native: list[tuple[int, quant_kernels.Prepared | torch.Tensor]] | None = None
        # (function, segment args) of one native call for all the segments, or None
        self._many: tuple | None = None
        # the segments when some multiply themselves (quant_rows); () when none do
        self._own: list | tuple | None = None
        # after `repack`: the panel segments of one native call, and float rows (row, data)
        self._panels: list[tuple] | None = None
        self._dense: list[tuple[int, torch.Tensor]] = []

    def put(self, row: int, rows: Rows, size: int | None, what: str) -> None:
        """Place `rows` at `row`; `size` the rows expected there (None: the whole weight)."""
        want = self.out_features if size is None else size
        if rows.shape != (want, self.in_features) or not 0 <= row <= self.out_features - want:
            raise ValueError(
                f"{what}: packed rows {rows.shape} do not fit rows {row}:{row + want} of a "
                f"[{self.out_features}, {self.in_features}] weight"
            )
        for start, seg in self.segments:
            if start < row + want and row < start + seg.num_rows:
                raise ValueError(f"{what}: rows {row}:{row + want} are already loaded")
        self.segments.append((row, rows))
        self.segments.sort(key=lambda s: s[0])
        self._native = self._own = self._many = self._panels = None

    @property
    def is_complete(self) -> bool:
        return sum(seg.num_rows for _, seg in self.segments) == self.out_features

    @property
    def nbytes(self) -> int:
        return sum(seg.data.numel() * seg.data.element_size() for _, seg in self.segments)

    @property
    def precision(self) -> str | None:
        """The panel kernels' activation rounding, or None for the file's kernels."""
        if self.kernel is None:
            return quant_kernels.PRECISIONS[0]
        return self.kernel if self.kernel in quant_kernels.PRECISIONS else None

    def repack(self) -> bool:
        """For the panel kernels (CPU): each packed segment becomes `PanelRows` and its file
        pages are released; one-way (the file kernels need the file's layout). Returns whether
        it repacked. A no-op for the other kernels, without the native module, on another
        device, or with segments that multiply themselves (quant_rows)."""
        if self._panels is not None:
            return True
        if self.precision is None or quant_kernels.unavailable_reason() is not None:
            return False
        if self._own_segments() is not None or not self.is_complete:
            return False
        if any(seg.data.device.type != "cpu" for _, seg in self.segments):
            return False
        segments = []
        for row, seg in self.segments:
            if isinstance(seg, PackedRows):
                panels = quant_kernels.Panels(seg.qtype, seg.data, self.in_features)
                seg.release_pages()
                seg = PanelRows(panels)
            segments.append((row, seg))
        self.segments = segments
        self._native = self._many = None
        self._panels = [
            seg.panels.segment(row) for row, seg in segments if isinstance(seg, PanelRows)
        ]
        self._dense = [(row, seg.data) for row, seg in segments if isinstance(seg, DenseRows)]
        return True

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x W^T` for x `[..., in_features]`, in x's dtype."""
        if self._native is None and self._own is None and not self.is_complete:
            loaded = [(row, row + seg.num_rows) for row, seg in self.segments]
            raise ValueError(f"packed weight has rows {loaded} of {self.out_features} loaded")
        # Each torch op costs microseconds and a decode step runs hundreds of these: the
        # common case (2-D contiguous float32) goes straight to the kernels.
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if flat.device.type == "cpu" and (self._panels is not None or self.repack()):
            y = self._panel_matmul(flat)
        else:
            y = self._file_matmul(flat)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def _panel_matmul(self, flat: torch.Tensor) -> torch.Tensor:
        precision = self.precision
        if precision is None:
            raise ValueError(
                f"kernel {self.kernel!r} needs the file's blocks; this weight was repacked for "
                "the int16 / int8 kernels (set the kernel before the first matmul)"
            )
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.to(torch.float32).contiguous()
        y = torch.empty((flat.shape[0], self.out_features), dtype=torch.float32)
        if self._panels:
            quant_kernels.panel_matmul(self._panels, flat, y, precision, torch.get_num_threads())
        for row, data in self._dense:
            y[:, row : row + data.shape[0]] = flat @ data.T
        return y

    def _file_matmul(self, flat: torch.Tensor) -> torch.Tensor:
        own = self._own_segments()
        native = None
        if own is None and flat.device.type == "cpu" and quant_kernels.unavailable_reason() is None:
            native = self._prepared()
        if own is not None:
            parts = [
                seg.matmul(flat) if hasattr(seg, "matmul") else flat.float() @ seg.dequantize().T
                for seg in own
            ]
            return (
                parts[0]
                if len(parts) == 1
                else torch.cat([p.to(parts[0].dtype) for p in parts], -1)
            )
        if native is None:
            flat = flat.to(torch.float32)
            return torch.cat([flat @ seg.dequantize().T for _, seg in self.segments], dim=-1)
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.to(torch.float32).contiguous()
        y = torch.empty((flat.shape[0], self.out_features), dtype=torch.float32)
        threads, kernel = torch.get_num_threads(), self.kernel
        if kernel not in quant_kernels.KERNELS:  # exact, or repack() declined: by rows of x
            kernel = None
        if self._many is not None:  # one native call for all the segments
            x_raw, y_raw = (flat.data_ptr(), flat.numel()), (y.data_ptr(), y.numel())
            n, width = y.shape
            self._many[0](self._many[1], self.in_features, x_raw, n, y_raw, width, None,
                          kernel, threads)  # fmt: skip
        else:
            for row, prepared in native:
                if isinstance(prepared, torch.Tensor):  # DenseRows
                    y[:, row : row + prepared.shape[0]] = flat @ prepared.T
                else:
                    prepared.run(flat, y, row, kernel, threads)
        return y

    def _own_segments(self) -> list | None:
        """The segments in row order, consecutive ones of a kind that can `concat` merged
        (one activation rounding and one GEMM for a QKV layer's q, k, v), when any of them
        multiplies itself (sglite.layers.quant_rows: safetensors-quantized checkpoints); else
        None (GGUF rows and float rows: the native kernels)."""
        if self._own is None and not any(hasattr(seg, "matmul") for _, seg in self.segments):
            self._own = ()  # checked: none (the GGUF fast path pays this test once)
        if self._own is None:
            merged: list = []
            for _, seg in self.segments:
                if merged and type(merged[-1][-1]) is type(seg) and hasattr(seg, "concat"):
                    merged[-1].append(seg)
                else:
                    merged.append([seg])
            self._own = [run[0] if len(run) == 1 else type(run[0]).concat(run) for run in merged]
        return self._own or None

    def _prepared(self) -> list[tuple[int, quant_kernels.Prepared | torch.Tensor]] | None:
        """The segments checked for the file kernels (once), or None on another device."""
        if any(isinstance(seg, PanelRows) for _, seg in self.segments):
            raise ValueError(
                f"kernel {self.kernel!r} needs the file's blocks; this weight was repacked for "
                "the int16 / int8 kernels (set the kernel before the first matmul)"
            )
        if self._native is None:
            if all(seg.data.device.type == "cpu" for _, seg in self.segments):
                self._native = [
                    (row, seg.data)
                    if isinstance(seg, DenseRows)
                    else (row, quant_kernels.Prepared(seg.qtype, seg.data, self.in_features))
                    for row, seg in self.segments
                ]
                self._many = quant_kernels.segments_call(self._native)
        return self._native

    def dequantize(self) -> torch.Tensor:
        """float32 `[out_features, in_features]` (torch)."""
        return torch.cat([seg.dequantize() for _, seg in self.segments], dim=0)


class _Packed:
    """The packed mode of a `linear` layer: built on the meta device (shapes only), then the
    bias made real and the weight replaced by a `PackedWeight`."""

    def __init__(self, *args, device: torch.device | None = None, **kwargs) -> None:
        super().__init__(*args, device=torch.device("meta"), **kwargs)
        if self.bias is not None:
            meta = self.bias
            bias = torch.zeros(meta.shape, dtype=meta.dtype, device=device)
            self.bias = nn.Parameter(bias, requires_grad=False)
            self.bias.weight_loader = self.weight_loader
            if hasattr(meta, "shard_ids"):
                self.bias.shard_ids = meta.shard_ids
        self.weight = None
        self.packed = PackedWeight(self.out_features, self.in_features)

    def load_packed(self, rows: Rows, shard_id: str | int | None = None) -> None:
        """Place a checkpoint tensor's packed rows (the whole tensor: sharded here; a fused
        one, shard id None in a merged or QKV layer, split as the float layers split it)."""
        if isinstance(rows, torch.Tensor):  # a float tensor (a layer a checkpoint kept float)
            rows = DenseRows(rows.to(torch.float32))
        self.weight_loader(None, rows, shard_id)

    def store(self, param: nn.Parameter | None, where: Placement) -> None:
        if param is not None:  # the bias
            super().store(param, where)
        else:
            self.packed.put(where.row, where.shard, where.size, where.what)

    def prepack(self) -> bool:
        """Repack for the panel kernels (see `PackedWeight.repack`); whether it did."""
        return self.packed.repack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.packed.matmul(x)
        return y if self.bias is None else y + self.bias


class QuantReplicatedLinear(_Packed, ReplicatedLinear):
    """`ReplicatedLinear` over packed rows."""


class QuantColumnParallelLinear(_Packed, ColumnParallelLinear):
    """`ColumnParallelLinear` over packed rows (this rank's rows of the tensor)."""


class QuantMergedColumnParallelLinear(_Packed, MergedColumnParallelLinear):
    """`MergedColumnParallelLinear` over packed rows, one tensor per output (any formats)."""


class QuantQKVParallelLinear(_Packed, QKVParallelLinear):
    """`QKVParallelLinear` over packed rows: q, k and v each in their file's format."""


class QuantRowParallelLinear(_Packed, RowParallelLinear):
    """`RowParallelLinear` over packed rows: this rank's window of whole blocks of each row,
    the partial outputs all-reduced, the bias added once after."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.packed.matmul(x)
        if self.tp_size > 1:
            y = self.tp_group.all_reduce(y)
        return y if self.bias is None else y + self.bias


_PACKED_CLASSES = {
    ReplicatedLinear: QuantReplicatedLinear,
    ColumnParallelLinear: QuantColumnParallelLinear,
    MergedColumnParallelLinear: QuantMergedColumnParallelLinear,
    QKVParallelLinear: QuantQKVParallelLinear,
    RowParallelLinear: QuantRowParallelLinear,
}


def packed_class(cls: type) -> type:
    """The packed twin of a float layer class of `sglite.layers.linear`."""
    if cls not in _PACKED_CLASSES:
        raise ValueError(f"{cls.__name__} has no packed (GGUF) form")
    return _PACKED_CLASSES[cls]
