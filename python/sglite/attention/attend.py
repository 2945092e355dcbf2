"""Attention on gathered torch tensors, with the per-layer variations (window, logit cap, sinks).

The torch paths (torch_native, and the cpu backend's extend) gather keys into tensors and
call `attend`: SDPA when the layer is plain softmax attention, else the same math written
out (`_attend_math`: the scores in float32, capped, masked, softmaxed with the sink in the
denominator), in query chunks so that the score matrix stays small.

`plan_segment` cuts one request's new tokens into the pieces a sliding window makes
independent: a piece of queries reads only the keys of the last W positions before its
last query, so a long windowed prompt costs O(tokens * W), not O(tokens^2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from sglite.layers.radix_attention import RadixAttention

# Largest score matrix (query rows x keys x heads) `_attend_math` builds at once.
_MATH_CHUNK_ELEMS = 1 << 22
# Fewest queries per windowed piece (fewer, larger calls when W is tiny).
_MIN_PIECE = 64


def is_plain(layer: RadixAttention) -> bool:
    """Softmax attention with nothing to add (SDPA and flash kernels do it)."""
    return not layer.logit_cap and layer.sinks is None


@dataclass(frozen=True)
class Piece:
    """Queries: new tokens `q_from .. q_to-1` of one request (positions prefix + q_from...).
    Keys: cached positions `cached_from .. prefix-1`, then new tokens `new_from .. q_to-1`.
    `cut`: the window hides some of those keys from some queries (a mask is needed)."""

    q_from: int
    q_to: int
    cached_from: int
    new_from: int
    cut: bool


def plan_segment(prefix: int, ext: int, window: int | None) -> list[Piece]:
    """The pieces of a request with `prefix` cached and `ext` new tokens (see `Piece`)."""
    if window is None or prefix + ext <= window:
        return [Piece(0, ext, 0, 0, False)]
    size = max(window, _MIN_PIECE)
    pieces = []
    for q_from in range(0, ext, size):
        q_to = min(ext, q_from + size)
        first_key = max(0, prefix + q_from - window + 1)  # of the piece's first query
        pieces.append(Piece(q_from, q_to, min(first_key, prefix), max(0, first_key - prefix), True))
    return pieces


def piece_mask(piece: Piece, prefix: int, window: int | None, device) -> torch.Tensor:
    """[queries, keys] bool: key position j is visible to query position p iff
    p - window < j <= p (no lower bound without a window)."""
    q_pos = torch.arange(prefix + piece.q_from, prefix + piece.q_to, device=device)
    k_pos = torch.cat(
        [
            torch.arange(piece.cached_from, prefix, device=device),
            torch.arange(prefix + piece.new_from, prefix + piece.q_to, device=device),
        ]
    )
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    return visible


def attend_rows(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layer: RadixAttention,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """One query token per row: q `[n, KVH, G, D]` (the G query heads of a KV head stacked),
    keys/values `[n, KVH, L, D]`, mask `[n, 1, 1, L]` (True: visible) or None; -> q's shape."""
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    if is_plain(layer):
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=layer.scaling)
    mask = mask.unsqueeze(-2) if mask is not None else None
    return _attend_math(q.unsqueeze(-2), keys, values, layer, mask).squeeze(-2)


def attend_tokens(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layer: RadixAttention,
    mask: torch.Tensor | None,
    is_causal: bool = False,
) -> torch.Tensor:
    """Queries of one request: q `[M, H, D]`, keys `[N, KVH, D]`, values `[N, KVH, Dv]`, mask
    `[M, N]` (True: visible) or None; `is_causal`: top-left aligned causal (M == N). -> `[M, H,
    Dv]`."""
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    if is_plain(layer):
        return F.scaled_dot_product_attention(
            q.transpose(0, 1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=mask,
            is_causal=is_causal,
            scale=layer.scaling,
            enable_gqa=layer.num_heads != layer.num_kv_heads,
        ).transpose(0, 1)
    if is_causal:
        mask = torch.ones(q.shape[0], keys.shape[0], dtype=torch.bool, device=q.device).tril_()
    m, num_heads, d = q.shape
    num_kv = keys.shape[1]
    q5 = q.view(m, num_kv, num_heads // num_kv, d).permute(1, 2, 0, 3).unsqueeze(0)
    k4, v4 = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
    out = _attend_math(q5, k4, v4, layer, mask)  # [1, KVH, G, M, Dv]
    return out[0].permute(2, 0, 1, 3).reshape(m, num_heads, values.shape[-1])


def _attend_math(q, keys, values, layer: RadixAttention, mask) -> torch.Tensor:
    """q `[B, KVH, G, M, D]`, keys `[B, KVH, N, D]`, values `[B, KVH, N, Dv]`, mask broadcastable to
    `[B, KVH, G, M, N]` or None; the scores in float32, capped, masked, with the sink.
    The G query heads of a KV head multiply its keys as one `[G * M, D]` matrix (no copy
    of K/V per query head).

    Query chunks bound the score matrix; with a `[M, N]` mask (one request's tokens) each
    chunk reads only the span of keys its rows see (a causal chunk skips the keys after
    its last query, a windowed one those before its first)."""
    m, n = q.shape[-2], keys.shape[-2]
    step = max(1, _MATH_CHUNK_ELEMS // max(1, n * q[..., 0, 0].numel()))
    sinks = None
    if layer.sinks is not None:  # [H] -> [1, KVH, G, 1, 1], H = KVH * G
        sinks = layer.sinks.detach().float().view(1, *q.shape[1:3], 1, 1)
    keys, values = keys.float(), values.float()
    dv = values.shape[-1]
    out = torch.empty((*q.shape[:-1], dv), dtype=q.dtype, device=q.device)
    for lo in range(0, m, step):
        hi = min(m, lo + step)
        part, k_lo, k_hi = None, 0, n
        if mask is not None:
            part = mask[..., lo:hi, :] if mask.shape[-2] == m else mask
            if part.dim() == 2:
                seen = part.any(0).nonzero()
                if seen.numel():
                    k_lo, k_hi = int(seen[0]), int(seen[-1]) + 1
                    part = part[:, k_lo:k_hi]
        chunk_k, chunk_v = keys[..., k_lo:k_hi, :], values[..., k_lo:k_hi, :]
        q_chunk = q[..., lo:hi, :].float()
        stacked = q_chunk.reshape(*q.shape[:2], -1, q.shape[-1])  # [B, KVH, G * c, D]
        scores = torch.matmul(stacked, chunk_k.transpose(-1, -2))
        scores = scores.view(*q_chunk.shape[:-1], k_hi - k_lo).mul_(layer.scaling)
        if layer.logit_cap:
            scores.div_(layer.logit_cap).tanh_().mul_(layer.logit_cap)
        if part is not None:
            scores.masked_fill_(~part, float("-inf"))
        top = scores.amax(-1, keepdim=True)
        if sinks is not None:
            top = torch.maximum(top, sinks)
        weights = scores.sub_(top).exp_()
        denom = weights.sum(-1, keepdim=True)
        if sinks is not None:
            denom += torch.exp(sinks - top)
        weights = weights.div_(denom).view(*stacked.shape[:-1], k_hi - k_lo)
        out[..., lo:hi, :] = torch.matmul(weights, chunk_v).view(*q_chunk.shape[:-1], dv)
    return out
