"""MLAKVPool: the KV pool of multi-head latent attention (DeepSeek-V2/V3), one latent row per token.

Per layer and token MLA stores only `[c_kv | k_pe]`: the compressed latent `c_kv`
(`kv_lora_rank` dims, after kv_a_layernorm) and the decoupled rope key `k_pe`
(`qk_rope_head_dim` dims, already rotated), shared by every head; per-head keys and values
are recomputed from the latent (sglite.layers.latent_attention). DeepSeek-V3's 512 + 64
dims are 1,152 bytes per layer in bf16 where per-head K and V would take 128 heads x (192 +
128) dims, 81,920 bytes.

Layout: `kv_buffer[layer]` `[num_slots + page_size, 1, kv_lora_rank + qk_rope_head_dim]`,
page 0 reserved as in `KVPool`. For attention it is an MQA with one KV "head":
`k_buffer[layer]` is the whole row (the key of the absorbed form), `v_buffer[layer]` a view
of its first `kv_lora_rank` dims (the latent is also the value), so `values_in_keys` is
True and `set_kv` stores the key rows only. `buffers` lists each layer's row once; the
host and file tiers copy those. Under tensor parallelism the latent is replicated: every
rank holds the same pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglite.mem_cache.kv_dtype import copy_rows, to_store
from sglite.mem_cache.memory_pool import untouched_zeros


@dataclass(frozen=True)
class MLALayout:
    """What MLA stores per token and layer, and the per-head K/V it replaces (for the log)."""

    num_layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    # the MHA form of the same attention (all heads, not one rank's), for the comparison
    num_heads: int
    qk_head_dim: int
    v_head_dim: int

    @property
    def row_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.num_layers * self.row_dim * dtype.itemsize

    def mha_bytes_per_token(self, dtype: torch.dtype) -> int:
        per_head = self.qk_head_dim + self.v_head_dim
        return self.num_layers * self.num_heads * per_head * dtype.itemsize

    def describe(self, dtype: torch.dtype) -> str:
        return (
            f"MLA latent {self.kv_lora_rank} + rope {self.qk_rope_head_dim}; MHA would need "
            f"{self.mha_bytes_per_token(dtype):,} B/token"
        )

    def key(self, dtype: torch.dtype) -> str:
        return (
            f"mla|layers={self.num_layers}|kv_lora_rank={self.kv_lora_rank}|"
            f"rope={self.qk_rope_head_dim}|dtype={dtype}"
        )

    def build(
        self,
        num_slots: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        pin_memory: bool = False,
    ) -> MLAKVPool:
        return MLAKVPool(num_slots, page_size, self, dtype, device, pin_memory=pin_memory)


class MLAKVPool:
    """Per-layer latent rows `[num_slots + page_size, 1, kv_lora_rank + qk_rope_head_dim]`."""

    values_in_keys = True
    num_kv_heads = 1

    def __init__(
        self,
        num_slots: int,
        page_size: int,
        layout: MLALayout,
        dtype: torch.dtype,
        device: torch.device | str,
        pin_memory: bool = False,
    ) -> None:
        if num_slots < page_size or num_slots % page_size:
            raise ValueError(
                f"KV pool of {num_slots} slots is not a positive multiple of page_size {page_size}"
            )
        self.num_slots, self.page_size, self.layout = num_slots, page_size, layout
        self.num_layers = layout.num_layers
        self.kv_lora_rank = layout.kv_lora_rank
        self.head_dim = layout.row_dim  # the key row of the absorbed form
        self.v_head_dim = layout.kv_lora_rank
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_slots + page_size, 1, layout.row_dim)
        self.kv_buffer = [
            untouched_zeros(shape, dtype, self.device, pin_memory) for _ in range(self.num_layers)
        ]
        self.k_buffer = self.kv_buffer
        self.v_buffer = [b[..., : layout.kv_lora_rank] for b in self.kv_buffer]

    @property
    def buffers(self) -> list[torch.Tensor]:
        return self.kv_buffer

    @property
    def bytes_per_token(self) -> int:
        return self.layout.bytes_per_token(self.dtype)

    def like(self, num_slots: int, device: torch.device | str, pin_memory: bool = False):
        return self.layout.build(num_slots, self.page_size, self.dtype, device, pin_memory)

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the rows `k` (`[T, 1, kv_lora_rank + rope]`: `[c_kv | k_pe]`) at slots `loc`;
        `v` is their first `kv_lora_rank` dims and is not stored twice."""
        copy_rows(self.kv_buffer[layer_id], loc, to_store(k, self.dtype))

    def memory_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.kv_buffer)
