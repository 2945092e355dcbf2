"""MoE align: the router's (token, slot) pairs sorted by expert, each expert's run padded to
a multiple of BLOCK_M, so that every BLOCK_M tile of rows belongs to one expert.

Pairs are numbered `p = token * top_k + slot` (row-major over `topk_ids [T, K]`). The result,
built with torch ops on the ids' device and no host sync (its sizes depend on T, K and the
number of local experts only, so it can be captured in a CUDA graph):

- `sorted_ids [num_blocks * BLOCK_M]` int32: pair ids, expert by expert (ascending pair id
  within an expert), each expert's run followed by padding up to its next multiple of
  BLOCK_M; padding holds the sentinel `T * K` (an invalid pair). Pairs whose expert is not
  local (ids outside [expert_start, expert_start + num_local), held by another rank) are
  left out.
- `block_expert [num_blocks]` int32: the local expert of each tile, -1 for the tiles past the
  last expert's run (`num_blocks` is an upper bound: `ceil(T*K / BLOCK_M)` plus one partial
  tile per expert that has pairs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoeAlignment:
    sorted_ids: torch.Tensor  # [num_blocks * block_m] int32, sentinel num_pairs
    block_expert: torch.Tensor  # [num_blocks] int32, -1: no expert (skip the tile)
    num_pairs: int  # T * K
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]


def max_blocks(num_pairs: int, num_local: int, block_m: int) -> int:
    """Tiles enough for any routing: each expert with pairs adds at most one partial tile."""
    return -(-num_pairs // block_m) + min(num_pairs, num_local)


def moe_align(
    topk_ids: torch.Tensor, expert_start: int, num_local: int, block_m: int
) -> MoeAlignment:
    """Sort the pairs of `topk_ids [T, K]` by local expert and pad each run to `block_m`."""
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"topk_ids must be [T, K] int32/int64, got {topk_ids.dtype} {tuple(topk_ids.shape)}"
        )
    if num_local < 1 or block_m < 1:
        raise ValueError(f"num_local={num_local} and block_m={block_m} must be >= 1")
    device = topk_ids.device
    n = topk_ids.numel()
    nb = max_blocks(n, num_local, block_m)
    length = nb * block_m
    local = topk_ids.reshape(-1).to(torch.int64) - expert_start
    # other ranks' experts go to bucket num_local, which is given no rows
    local = torch.where((local >= 0) & (local < num_local), local, num_local)
    order = local.argsort(stable=True)
    sorted_local = local.index_select(0, order)
    # scatter_add rather than bincount: bincount reads the max on the host
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, local, torch.ones_like(local))
    padded = (counts + (block_m - 1)) // block_m * block_m
    padded[num_local] = 0
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded
    raw_start = counts.cumsum(0) - counts
    rank = torch.arange(n, device=device) - raw_start.index_select(0, sorted_local)
    dest = pad_start.index_select(0, sorted_local) + rank
    dest = torch.where(sorted_local < num_local, dest, length)  # row `length`: dropped
    sorted_ids = torch.full((length + 1,), n, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    tile_start = torch.arange(nb, device=device) * block_m
    expert = torch.searchsorted(pad_end[:num_local].contiguous(), tile_start, right=True)
    block_expert = torch.where(expert < num_local, expert, -1).to(torch.int32)
    return MoeAlignment(sorted_ids[:length], block_expert, n, block_m)
