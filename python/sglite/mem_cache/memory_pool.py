"""Device memory of the KV cache: the request->slot table and the per-layer K/V buffers.

Neither pool decides which slot is free: slot bookkeeping belongs to the tree core's
`PageAllocator` (`sglite.core.load().PageAllocator`), and row bookkeeping is the only
allocation done here (a free list of request rows).

Reserved index 0 everywhere: row 0 of `req_to_token` and slot 0 / page 0 of the K/V buffers
are padding targets (padded batch rows point at row 0, padded tokens write to slot 0), so
the allocator hands out slots 1.. and the buffers have `num_slots + page_size` rows.

The KV pool interface (what the backends, the radix cache, HiCache's host and file tiers
use; `KVPool` here, `MLAKVPool` in mla_pool.py):
- `k_buffer[layer]` `[rows, num_kv_heads, head_dim]` and `v_buffer[layer]` `[rows,
  num_kv_heads, v_head_dim]`: what attention reads. They may share storage (MLA: the value
  is the first `v_head_dim` dims of the key row, `v_buffer` a view of `k_buffer`).
- `set_kv(layer, loc, k, v)`: store this step's rows at slots `loc`, cast to the pool's
  `dtype` (`--kv-cache-dtype`; fp8 saturated, see sglite.mem_cache.kv_dtype). Readers
  convert K/V to their compute dtype.
- `buffers`: every tensor that holds the cache, each indexed by slot along dim 0, with no
  tensor listed twice. Whatever moves KV between tiers copies exactly these (row r of every
  buffer is slot r's KV) and nothing else, so a new layout needs no change there; it
  scatters rows with `kv_dtype.copy_rows` (fp8 has no CPU `index_copy_`).
- `layout`: the frozen description the pool was built from (`bytes_per_token`, `describe`,
  `key`: what must be equal for two servers to share stored pages); `like(num_slots,
  device)` builds an empty pool of the same layout (the host tier's).

A model declares its layout (`kv_layout()`, see sglite.models.causal_lm); the runner sizes
and builds the pool from it (the CPU default: sglite.mem_cache.kv_sizing).

Memory: CPU buffers are anonymous mappings (`untouched_zeros`): zero by the kernel's
guarantee and committed page by page on first write, so a pool costs RSS for the tokens
written, not its capacity (`torch.zeros` would write every byte at start-up).
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sglite.layers import cpu_ops
from sglite.mem_cache.kv_dtype import copy_rows, to_store
from sglite.mem_cache.kv_sizing import kv_slots_for_budget as kv_slots_for_budget

# below this, a mapping of its own is not worth a system call (and a page-rounded tail)
MAPPED_MIN_BYTES = 1 << 20


def untouched_zeros(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    pin_memory: bool = False,
) -> torch.Tensor:
    """`torch.zeros(shape)` whose pages a CPU tensor commits only when written: an anonymous
    mapping of its own (zero-filled by the kernel on first touch). CUDA, pinned and small
    buffers are plain `torch.zeros`."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if device.type != "cpu" or pin_memory or nbytes < MAPPED_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # frombuffer keeps `region` alive; the mapping goes when the last view of it does
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)


class ReqToTokenPool:
    """`req_to_token[row, pos]` is the KV slot of position `pos` of the request in `row`.

    The scheduler owns the contents of a row: it writes the slots of the cached prefix and of
    each newly allocated token before the forward that reads them.
    """

    def __init__(self, size: int, max_context_len: int, device: torch.device | str) -> None:
        if size < 1 or max_context_len < 1:
            raise ValueError(
                f"ReqToTokenPool needs size >= 1 and max_context_len >= 1, "
                f"got size={size}, max_context_len={max_context_len}"
            )
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = untouched_zeros((size + 1, max_context_len), torch.int32, self.device)
        # Pop from the tail: rows 1, 2, ... come out first.
        self._free_rows = list(range(size, 0, -1))
        self._is_free = np.ones(size + 1, dtype=bool)
        self._is_free[0] = False

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self, n: int) -> list[int] | None:
        """Take `n` rows, or return None (changing nothing) when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} request rows")
        if n > len(self._free_rows):
            return None
        rows = [self._free_rows.pop() for _ in range(n)]
        self._is_free[rows] = False
        return rows

    def free(self, rows: int | Sequence[int]) -> None:
        rows = [rows] if isinstance(rows, int) else list(rows)
        for row in rows:
            if not 1 <= row <= self.size:
                raise ValueError(f"request row {row} is not in 1..{self.size}")
            if self._is_free[row]:
                raise ValueError(f"request row {row} is already free (double free)")
        self._is_free[rows] = True
        self._free_rows.extend(reversed(rows))

    def write(self, row: int, start: int, slots: torch.Tensor | np.ndarray | Sequence[int]) -> None:
        """Set `req_to_token[row, start:start + len(slots)] = slots`."""
        if isinstance(slots, torch.Tensor):
            slots = slots.to(dtype=torch.int32).reshape(-1)
        else:
            slots = torch.as_tensor(np.asarray(slots), dtype=torch.int32).reshape(-1)
        end = start + slots.numel()
        if end > self.max_context_len:
            raise ValueError(
                f"request row {row} would hold {end} tokens; the context is {self.max_context_len}"
            )
        self.req_to_token[row, start:end] = slots.to(self.device, non_blocking=True)

    def clear(self) -> None:
        self._free_rows = list(range(self.size, 0, -1))
        self._is_free[1:] = True


@dataclass(frozen=True)
class MHALayout:
    """Per-head K and V of every layer (MHA, GQA, MQA): the KVPool's layout."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize

    def describe(self, dtype: torch.dtype) -> str:
        return f"K and V of {self.num_kv_heads} KV heads x {self.head_dim} dims"

    def key(self, dtype: torch.dtype) -> str:
        return (
            f"layers={self.num_layers}|kv_heads={self.num_kv_heads}|head_dim={self.head_dim}|"
            f"dtype={dtype}"
        )

    def build(
        self,
        num_slots: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        pin_memory: bool = False,
    ) -> KVPool:
        return KVPool(
            num_slots, page_size, self.num_layers, self.num_kv_heads, self.head_dim, dtype,
            device, pin_memory=pin_memory,
        )  # fmt: skip


class KVPool:
    """Per-layer K and V buffers `[num_slots + page_size, num_kv_heads, head_dim]` (NHD).

    Slot `s` of page `p` is row `p * page_size + s % page_size`; page 0 is never handed out.
    """

    # the value rows are separate tensors (MLA's are views of the key rows)
    values_in_keys = False

    def __init__(
        self,
        num_slots: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        pin_memory: bool = False,  # host buffers that copy to/from CUDA (HiCache's host pool)
    ) -> None:
        if num_slots < page_size or num_slots % page_size:
            raise ValueError(
                f"KV pool of {num_slots} slots is not a positive multiple of page_size {page_size}"
            )
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_slots + page_size, num_kv_heads, head_dim)

        def buf() -> torch.Tensor:
            return untouched_zeros(shape, dtype, self.device, pin_memory)

        self.k_buffer = [buf() for _ in range(num_layers)]
        self.v_buffer = [buf() for _ in range(num_layers)]
        self.layout = MHALayout(num_layers, num_kv_heads, head_dim)

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Every tensor of the cache, indexed by slot (see the module docstring)."""
        return self.k_buffer + self.v_buffer

    @property
    def bytes_per_token(self) -> int:
        return self.layout.bytes_per_token(self.dtype)

    def like(self, num_slots: int, device: torch.device | str, pin_memory: bool = False):
        """An empty pool of this layout, page size and dtype with `num_slots` slots."""
        return self.layout.build(num_slots, self.page_size, self.dtype, device, pin_memory)

    @staticmethod
    def bytes_per_slot(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Scatter this step's K/V (`[T, num_kv_heads, head_dim]`) to slots `loc` (`[T]`, int64)."""
        for buf, rows in ((self.k_buffer[layer_id], k), (self.v_buffer[layer_id], v)):
            if cpu_ops.kv_store(buf, loc, rows) is None:  # not a CPU pool the kernel takes
                copy_rows(buf, loc, to_store(rows, self.dtype))

    def memory_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)
