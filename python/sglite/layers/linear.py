"""Linear layers with tensor-parallel shapes (column split, row split, merged and QKV forms).

Each layer holds only its shard of the TP group `tp_group` (sglite.distributed): a
column-parallel layer keeps `out_features / tp_size` rows of the weight and needs no
communication, a row-parallel one keeps `in_features / tp_size` columns and all-reduces its
partial output (its bias is added once, after the all-reduce). With tp_size 1 the forward is
the plain matmul, no collective. Checkpoint tensors reach the shard through each parameter's
`weight_loader(param, tensor, shard_id)`: `place()` narrows the full tensor to this rank's
part and says where it goes (the packed GGUF layers of `quant_linear` place their rows by the
same code).
QKV: with fewer KV heads than ranks, each rank holds the one KV head its query heads read.

On CPU, `prepack()` converts the weight into oneDNN's blocked layout once after loading
(`torch.ops.mkldnn._reorder_linear_weight`): the matmuls of a decode step then run about 2x
faster than `F.linear` on the plain row-major weight. The plain weight is dropped (set to
None) once packed, so load weights first. Where the op is missing, nothing changes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from sglite.distributed import NULL_TP_GROUP, TPGroup, local_head_counts
from sglite.layers.module import DirectCall
from sglite.layers.rotary_embedding import permute_heads

logger = logging.getLogger(__name__)


def _param(shape: Sequence[int], dtype: torch.dtype, device: torch.device | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(tuple(shape), dtype=dtype, device=device), requires_grad=False)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"{what}: checkpoint tensor has shape {tuple(src.shape)}, "
            f"the model expects {tuple(dst.shape)}"
        )
    dst.copy_(src)


def default_weight_loader(
    param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
) -> None:
    """The loader of a parameter that holds the whole checkpoint tensor."""
    _copy_checked(param.data, loaded, "weight")


def loader_of(param: nn.Parameter):
    return getattr(param, "weight_loader", default_weight_loader)


def _check_divisible(value: int, tp_size: int, what: str) -> None:
    if value % tp_size:
        raise ValueError(f"{what}={value} is not divisible by tp_size={tp_size}")


class Placement(NamedTuple):
    """A checkpoint tensor's place in a layer's shard (`LinearBase.place`)."""

    row: int
    size: int | None
    shard: torch.Tensor
    what: str


def can_prepack(dtype: torch.dtype) -> bool:
    return (
        dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class LinearBase(DirectCall, nn.Module):
    """`y = x W^T + b` over a (possibly sharded) weight `[out_shard, in_shard]`."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = _param((out_features, in_features), dtype, device)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = _param((out_features,), dtype, device)
            self.bias.weight_loader = self.weight_loader
        self._packed: torch.Tensor | None = None

    def place(self, loaded: torch.Tensor, shard_id: str | int | None = None) -> Placement:
        """Where a checkpoint tensor (weight or bias) goes in this rank's shard: the first row,
        the rows there (None: all of them) and the part of `loaded` that belongs there.
        `loaded` is a tensor, or anything with `shape`, `dim()` and `narrow()` (the packed
        rows of `sglite.layers.quant_linear`), so both modes shard by the same code."""
        return Placement(0, None, loaded, type(self).__name__)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        self.store(param, self.place(loaded, shard_id))

    def store(self, param: nn.Parameter, where: Placement) -> None:
        """Copy a placed checkpoint tensor into `param` (the packed layers keep theirs)."""
        dst = param.data if where.size is None else param.data.narrow(0, where.row, where.size)
        _copy_checked(dst, where.shard, where.what)

    def _set_shard_ids(self, shard_ids: tuple) -> None:
        """The shards that together fill each parameter (the loader checks every one came;
        one tensor loaded with shard id None fills them all)."""
        for param in (self.weight, self.bias):
            if param is not None:
                param.shard_ids = shard_ids

    def prepack(self) -> bool:
        """Switch to oneDNN's packed weight (CPU only). Returns whether it did."""
        weight = self.weight
        if weight.device.type != "cpu" or not can_prepack(weight.dtype):
            return False
        try:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        except RuntimeError as e:  # an unusual build of torch: keep the plain weight
            logger.debug("oneDNN weight prepack unavailable (%s)", e)
            return False
        self.weight = None  # the packed copy replaces it; halves the weights' memory
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    """The full weight on every rank."""


class ColumnParallelLinear(LinearBase):
    """Splits the output features: rank r holds rows [r * out/tp, (r+1) * out/tp)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | None = None,
        tp_group: TPGroup = NULL_TP_GROUP,
    ) -> None:
        tp_size = tp_group.size
        _check_divisible(out_features, tp_size, "out_features")
        self.tp_size, self.tp_rank = tp_size, tp_group.rank
        super().__init__(
            in_features, out_features // tp_size, bias=bias, dtype=dtype, device=device
        )

    def _shard_rows(self, loaded: torch.Tensor, total: int) -> torch.Tensor:
        size = total // self.tp_size
        return loaded.narrow(0, self.tp_rank * size, size)

    def place(self, loaded: torch.Tensor, shard_id: str | int | None = None) -> Placement:
        return Placement(0, None, self._shard_rows(loaded, loaded.shape[0]), type(self).__name__)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (e.g. gate and up), loaded by index."""

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | None = None,
        tp_group: TPGroup = NULL_TP_GROUP,
    ) -> None:
        for size in output_sizes:
            _check_divisible(size, tp_group.size, "output size")
        self.output_sizes = list(output_sizes)
        super().__init__(
            in_features,
            sum(output_sizes),
            bias=bias,
            dtype=dtype,
            device=device,
            tp_group=tp_group,
        )
        self._set_shard_ids(tuple(range(len(output_sizes))))

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        """`shard_id` i: output i alone; None: all outputs fused in one tensor (Phi-3's
        `gate_up_proj`), split here."""
        if shard_id is None:
            if loaded.shape[0] != sum(self.output_sizes):
                raise ValueError(
                    f"MergedColumnParallelLinear: fused checkpoint tensor has {loaded.shape[0]} "
                    f"rows, the outputs {self.output_sizes} add up to {sum(self.output_sizes)}"
                )
            for i, part in enumerate(loaded.split(self.output_sizes)):
                self.weight_loader(param, part, i)
            return
        super().weight_loader(param, loaded, shard_id)

    def place(self, loaded: torch.Tensor, shard_id: str | int | None = None) -> Placement:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"MergedColumnParallelLinear: bad shard id {shard_id!r}")
        tp = self.tp_size
        return Placement(
            sum(self.output_sizes[:shard_id]) // tp,
            self.output_sizes[shard_id] // tp,
            self._shard_rows(loaded, self.output_sizes[shard_id]),
            f"MergedColumnParallelLinear shard {shard_id}",
        )


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul; output is [q heads | k heads | v heads]."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | None = None,
        tp_group: TPGroup = NULL_TP_GROUP,
    ) -> None:
        tp_size, tp_rank = tp_group.size, tp_group.rank
        _check_divisible(num_heads, tp_size, "num_attention_heads")
        if num_kv_heads % tp_size and tp_size % num_kv_heads:
            raise ValueError(
                f"num_key_value_heads={num_kv_heads} neither divides nor is divided by "
                f"tp_size={tp_size}"
            )
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads, self.num_kv_heads = local_head_counts(num_heads, num_kv_heads, tp_size)
        # Applied to the dims of every q and k head as they load (sglite.layers.rotary_embedding)
        self.head_permutation: torch.Tensor | None = None
        # The first KV head of this rank: its own slice, or the replicated head its q reads.
        replicas = max(1, tp_size // num_kv_heads)
        self.kv_head_start = tp_rank // replicas * self.num_kv_heads
        total = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(
            hidden_size,
            total,
            bias=bias,
            dtype=dtype,
            device=device,
            tp_group=tp_group,
        )
        self._set_shard_ids(("q", "k", "v"))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        """`shard_id` q, k or v: that projection alone; None: the three fused in one tensor
        as `[q | k | v]` rows (Phi-3's `qkv_proj`), split here."""
        if shard_id is None:
            d = self.head_dim
            sizes = [self.total_num_heads * d, self.total_num_kv_heads * d]
            sizes.append(sizes[1])
            if loaded.shape[0] != sum(sizes):
                raise ValueError(
                    f"QKVParallelLinear: fused checkpoint tensor has {loaded.shape[0]} rows, "
                    f"q, k and v need {sizes}"
                )
            for sid, part in zip("qkv", loaded.split(sizes)):
                self.weight_loader(param, part, sid)
            return
        super().weight_loader(param, loaded, shard_id)

    def place(self, loaded: torch.Tensor, shard_id: str | int | None = None) -> Placement:
        if shard_id in ("q", "k") and self.head_permutation is not None:
            if isinstance(loaded, torch.Tensor):
                loaded = permute_heads(loaded, self.head_permutation, self.head_dim, 0)
            else:  # packed rows: the same permutation of whole rows
                rows = torch.arange(loaded.shape[0])
                loaded = loaded.take_rows(
                    permute_heads(rows, self.head_permutation, self.head_dim, 0)
                )
        offsets = {
            "q": (0, self.q_size),
            "k": (self.q_size, self.kv_size),
            "v": (self.q_size + self.kv_size, self.kv_size),
        }
        if shard_id not in offsets:
            raise ValueError(f"QKVParallelLinear: shard id must be q, k or v, got {shard_id!r}")
        offset, size = offsets[shard_id]
        start = self.tp_rank * size if shard_id == "q" else self.kv_head_start * self.head_dim
        return Placement(
            offset, size, loaded.narrow(0, start, size), f"QKVParallelLinear shard {shard_id}"
        )


class RowParallelLinear(LinearBase):
    """Splits the input features: rank r holds columns [r * in/tp, (r+1) * in/tp)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | None = None,
        tp_group: TPGroup = NULL_TP_GROUP,
    ) -> None:
        tp_size = tp_group.size
        _check_divisible(in_features, tp_size, "in_features")
        self.tp_size, self.tp_rank, self.tp_group = tp_size, tp_group.rank, tp_group
        super().__init__(
            in_features // tp_size, out_features, bias=bias, dtype=dtype, device=device
        )

    def place(self, loaded: torch.Tensor, shard_id: str | int | None = None) -> Placement:
        if loaded.dim() == 2:  # the weight; the bias is whole on every rank
            size = self.in_features
            loaded = loaded.narrow(1, self.tp_rank * size, size)
        return Placement(0, None, loaded, "RowParallelLinear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        if self._packed is not None:
            out = torch.ops.mkldnn._linear_pointwise(x, self._packed, None, "none", [], "")
        else:
            out = F.linear(x, self.weight)
        out = self.tp_group.all_reduce(out)
        return out if self.bias is None else out + self.bias
