"""LatentAttention: multi-head latent attention (MLA) over the latent KV pool; prefill expanded, decode absorbed.

The pool (sglite.mem_cache.mla_pool) holds, per token and layer, one row `[c | k_pe]`: the
latent `c` (`kv_lora_rank` dims) and the rotated rope key `k_pe` (`qk_rope_head_dim`),
shared by all heads. `kv_b_proj` maps a latent to every head's `[k_nope | v]`; per head h
its rows are `W_UK[h]` `[qk_nope_head_dim, kv_lora_rank]` then `W_UV[h]` `[v_head_dim,
kv_lora_rank]`. A head's key is `[W_UK[h] c | k_pe]`, its value `W_UV[h] c`, and its score
`scaling * (q_nope[h] . W_UK[h] c + q_pe[h] . k_pe)`.

- Extend (prefill, chunks, prefix hits), the expanded form: the latents of the request's
  cached prefix (read from the pool) and of its new tokens are up-projected with
  `kv_b_proj` (one matmul for the whole batch) into per-head keys and values, then ordinary
  causal attention over prefix + new tokens (query t of a request with prefix p sees keys
  0..p+t). This is the math transformers runs.
- Decode, the absorbed form: `q_nope[h] . W_UK[h] c == (W_UK[h]^T q_nope[h]) . c`, so the
  query becomes `[W_UK^T q_nope | q_pe]` (`kv_lora_rank + rope` dims) and attends the pool's
  rows as an MQA with one KV head whose values are the latents (`RadixAttention` with
  `v_head_dim = kv_lora_rank`, run by the attention backend); `W_UV[h]` then maps each head's
  output back to `v_head_dim`. Nothing of the context is up-projected: a step costs
  O(context x heads x (kv_lora_rank + rope)) in attention and O(heads x nope x kv_lora_rank)
  for the absorption.
- Mixed batches: a request with one new token (a decode row) attends absorbed (through torch
  on the gathered rows), the others expanded.

Both forms are the same function of the weights (fp32 results agree to rounding). The
absorbed one needs `kv_b_proj`'s plain weight: that layer is never prepacked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from sglite.attention.attend import attend_rows, attend_tokens
from sglite.layers.radix_attention import RadixAttention

if TYPE_CHECKING:
    from sglite.model_executor.forward_batch import ForwardBatch


@dataclass(frozen=True)
class MLASpec:
    """The latent attention of a DeepSeek-V2/V3 config (sglite.models.deepseek_v2)."""

    kv_lora_rank: int
    q_lora_rank: int | None  # None: q_proj straight from the hidden state (V2-Lite)
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class LatentAttention(nn.Module):
    def __init__(
        self, spec: MLASpec, num_heads: int, scaling: float, layer_id: int, kv_b_proj: nn.Module
    ) -> None:
        """`num_heads`: this rank's heads; `kv_b_proj`: their rows of the up-projection
        (the owner registers it; the layer reads its weight)."""
        super().__init__()
        self.spec, self.num_heads, self.layer_id = spec, num_heads, layer_id
        lora, rope = spec.kv_lora_rank, spec.qk_rope_head_dim
        # the absorbed form: one KV head of [c | k_pe], values c
        self.attn = RadixAttention(num_heads, lora + rope, scaling, 1, layer_id, v_head_dim=lora)
        # the expanded form's shape (not a layer of its own: it reads no pool)
        self.__dict__["expanded"] = RadixAttention(
            num_heads, spec.qk_head_dim, scaling, num_heads, layer_id, v_head_dim=spec.v_head_dim
        )
        self.__dict__["kv_b_proj"] = kv_b_proj

    def _w(self) -> torch.Tensor:
        s = self.spec
        return self.kv_b_proj.weight.view(self.num_heads, s.qk_nope_head_dim + s.v_head_dim, -1)

    def absorb(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """`[T, H, nope]`, `[T, H, rope]` -> the absorbed query `[T, H, kv_lora_rank + rope]`."""
        w_uk = self._w()[:, : self.spec.qk_nope_head_dim]  # [H, nope, lora]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        return torch.cat([q_lat, q_pe], dim=-1)

    def unabsorb(self, out_lat: torch.Tensor) -> torch.Tensor:
        """Each head's latent output `[T, H, kv_lora_rank]` -> its value space `[T, H, v]`."""
        w_uv = self._w()[:, self.spec.qk_nope_head_dim :]  # [H, v, lora]
        return torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """q_nope `[T, H, nope]`, q_pe `[T, H, rope]` (rotated), latent `[T, kv_lora_rank]`
        (normed), k_pe `[T, rope]` (rotated); returns `[T, H * v_head_dim]`."""
        rows = torch.cat([latent, k_pe], dim=-1).unsqueeze(1)  # [T, 1, lora + rope]
        values = rows[..., : self.spec.kv_lora_rank]
        if batch.forward_mode.is_decode():
            out_lat = self.attn(self.absorb(q_nope, q_pe), rows, values, batch)
            out = self.unabsorb(out_lat.view(-1, self.num_heads, self.spec.kv_lora_rank))
        else:
            batch.attn_backend.save_kv(self.attn, batch, rows, values)
            out = self._extend(q_nope, q_pe, rows[:, 0], batch)
        return out.reshape(q_nope.shape[0], -1)

    # ---------------------------------------------------------------- extend
    def _extend(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        s, h = self.spec, self.num_heads
        table = batch.req_to_token_pool.req_to_token
        pool_rows = batch.req_pool_indices.tolist()
        out = q_nope.new_empty((q_nope.shape[0], h, s.v_head_dim))
        singles, segments, gathered, start = [], [], [], 0
        for i, (prefix, ext) in enumerate(
            zip(batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu)
        ):
            if ext == 1:
                singles.append((start, pool_rows[i], prefix + 1))
            else:
                if prefix:
                    slots = table[pool_rows[i], :prefix].to(torch.int64)
                    gathered.append(self._pool_rows(batch, slots).to(rows.dtype))
                gathered.append(rows[start : start + ext])
                segments.append((start, prefix, ext))
            start += ext
        if segments:
            keys_all = torch.cat(gathered) if len(gathered) > 1 else gathered[0]
            kv = self.kv_b_proj(keys_all[:, : s.kv_lora_rank]).view(
                -1, h, s.qk_nope_head_dim + s.v_head_dim
            )
            k_pe = keys_all[:, None, s.kv_lora_rank :].expand(-1, h, -1)
            keys = torch.cat([kv[..., : s.qk_nope_head_dim], k_pe], dim=-1)
            values = kv[..., s.qk_nope_head_dim :]
            q = torch.cat([q_nope, q_pe], dim=-1)
            at = 0
            for start, prefix, ext in segments:
                n = prefix + ext
                mask = None
                if prefix:  # query t sees keys 0 .. prefix + t
                    mask = torch.ones(ext, n, dtype=torch.bool, device=q.device).tril_(prefix)
                out[start : start + ext] = attend_tokens(
                    q[start : start + ext], keys[at : at + n], values[at : at + n],
                    self.expanded, mask, is_causal=not prefix,
                )  # fmt: skip
                at += n
        if singles:
            tokens = torch.tensor([t for t, _, _ in singles], device=q_nope.device)
            q_abs = self.absorb(q_nope[tokens], q_pe[tokens])
            out[tokens] = self.unabsorb(self._absorbed_rows(q_abs, singles, batch))
        return out

    def _pool_rows(self, batch: ForwardBatch, slots: torch.Tensor) -> torch.Tensor:
        """The stored `[c | k_pe]` rows of `slots`: `[len, kv_lora_rank + rope]`."""
        return batch.kv_pool.k_buffer[self.layer_id].index_select(0, slots)[:, 0]

    def _absorbed_rows(self, q_abs: torch.Tensor, singles: list, batch: ForwardBatch):
        """One-token requests of an extend batch, absorbed: q_abs `[n, H, lora + rope]` over
        each one's stored rows (padded to the longest, masked) -> `[n, H, kv_lora_rank]`."""
        table = batch.req_to_token_pool.req_to_token
        lens = [n for _, _, n in singles]
        longest = max(lens)
        slots = torch.zeros(len(singles), longest, dtype=torch.int64, device=q_abs.device)
        for j, (_, row, n) in enumerate(singles):
            slots[j, :n] = table[row, :n]
        keys = self._pool_rows(batch, slots.view(-1)).view(len(singles), 1, longest, -1)
        mask = None
        if min(lens) != longest:
            seen = torch.arange(longest, device=q_abs.device) < torch.tensor(
                lens, device=q_abs.device
            ).unsqueeze(1)
            mask = seen.view(len(singles), 1, 1, longest)
        values = keys[..., : self.spec.kv_lora_rank]
        out = attend_rows(q_abs.unsqueeze(1), keys.to(q_abs.dtype), values, self.attn, mask)
        return out[:, 0]
