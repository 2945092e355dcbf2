"""RadixAttention: the attention layer of every model; stores this step's K/V, then attends.

The layer holds its shape and the three per-layer variations of the math, which every
attention backend implements (one that cannot must refuse at construction, never compute
something else):

- `sliding_window` W (None: full attention): the query at position p sees the keys at
  positions j with p - W < j <= p, i.e. the last W positions including its own
  (transformers' `kv_idx > q_idx - sliding_window`).
- `logit_cap` c (0: none): the scores s = q.k * scaling become c * tanh(s / c) before the
  softmax (Gemma 2's `attn_logit_softcapping`).
- `sinks` (None: none): one learned logit per query head of this rank, `[num_heads]`, that
  joins the softmax's denominator only: out = sum_j exp(s_j) v_j / (exp(sink) + sum_j
  exp(s_j)) (gpt-oss). The model owns the parameter (its checkpoint name is the model's);
  the layer keeps a reference to it, not a registration, so it is neither loaded nor moved
  twice.

Values may be narrower than keys (`v_head_dim`, default `head_dim`): MLA's absorbed form
(sglite.layers.latent_attention) attends with keys `[c_kv | k_pe]` and values `c_kv`, the
first `v_head_dim` dims of each key row.

The KV pool and the backend come with the batch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from sglite.layers.module import DirectCall

if TYPE_CHECKING:
    from sglite.model_executor.forward_batch import ForwardBatch


class RadixAttention(DirectCall, nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scaling: float,
        num_kv_heads: int,
        layer_id: int,
        *,
        sliding_window: int | None = None,
        logit_cap: float = 0.0,
        sinks: torch.Tensor | None = None,
        v_head_dim: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
            )
        if sliding_window is not None and (
            isinstance(sliding_window, bool) or int(sliding_window) != sliding_window
            or sliding_window < 1
        ):  # fmt: skip
            raise ValueError(
                f"layer {layer_id}: sliding_window must be a positive integer or None, "
                f"got {sliding_window!r}"
            )
        if not (math.isfinite(logit_cap) and logit_cap >= 0):
            raise ValueError(
                f"layer {layer_id}: logit_cap must be a finite number >= 0 (0: no cap), "
                f"got {logit_cap!r}"
            )
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(
                f"layer {layer_id}: sinks must have one logit per query head, shape "
                f"({num_heads},), got {tuple(sinks.shape)}"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim is None else int(v_head_dim)
        if not 0 < self.v_head_dim <= head_dim:
            raise ValueError(
                f"layer {layer_id}: v_head_dim must be in 1..head_dim ({head_dim}), "
                f"got {v_head_dim!r}"
            )
        self.scaling = scaling
        self.layer_id = layer_id
        self.sliding_window = int(sliding_window) if sliding_window is not None else None
        self.logit_cap = float(logit_cap)
        # In __dict__, not _parameters: the owner registers (and loads) it.
        self.__dict__["sinks"] = sinks

    def extra_repr(self) -> str:
        extras = [f"heads={self.num_heads}/{self.num_kv_heads}", f"head_dim={self.head_dim}"]
        if self.v_head_dim != self.head_dim:
            extras.append(f"v_head_dim={self.v_head_dim}")
        if self.sliding_window is not None:
            extras.append(f"sliding_window={self.sliding_window}")
        if self.logit_cap:
            extras.append(f"logit_cap={self.logit_cap}")
        if self.sinks is not None:
            extras.append("sinks")
        return ", ".join(extras)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """q `[T, Hq, D]` (or `[T, Hq*D]`), k `[T, Hkv, D]`, v `[T, Hkv, Dv]`; returns
        `[T, Hq*Dv]`."""
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.v_head_dim)
        backend = batch.attn_backend
        backend.save_kv(self, batch, k, v)
        out = backend.forward(q, k, v, self, batch)
        return out.reshape(num_tokens, self.num_heads * self.v_head_dim)
