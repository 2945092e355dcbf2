"""Rotary position embedding over the whole head in the half-split layout, for every family.

Rotation of x = [x1 | x2] (halves of head_dim): `x * [cos | cos] + [x2 | x1] * [-sin | sin]`,
i.e. transformers' `x*cos + rotate_half(x)*sin`: pair i is (i, i + head_dim/2). One
`[rows, 2 * head_dim]` table of `[cos | cos | -sin | sin]` serves the native CPU kernel
(sglite.layers.cpu_ops.rope) and torch alike.

Other layouts reduce to this one at load time, by permuting the dims of each q and k head
(`rotary_permutation`; attention scores are unchanged when q and k are permuted alike, and
v is left alone):
- partial rotary (`partial_rotary_factor`, rotated part `rotary_dim` < head_dim): the
  rotated pairs move to (i, i + head_dim/2) for i < rotary_dim/2 and the pass-through dims
  fill the rest; their frequencies are 0 (cos 1, sin 0), so they pass unchanged.
- interleaved (GPT-J style, Cohere, GLM-4): pair i is (2i, 2i + 1) in the checkpoint.

Length-dependent types pick table rows per request (`lookup`, once per forward):
- `longrope`: the table holds the short rows, then the long rows; a token reads the long
  ones when its request's length at this step (cached prefix + this step's tokens) exceeds
  `original_max_position_embeddings`, transformers' rule applied per request.
- `dynamic`: a request longer than the model's `max_position_embeddings` gets rows computed
  for its length (a larger base); shorter ones read the plain table.
Keys already in the KV cache keep the rotation they were stored with, as in transformers'
forward stepping its own cache (and its `generate` for dynamic; for Phi-3's longrope,
`generate` recomputes the whole cache once the length first passes the original one, which a
server sharing cached prefixes across requests does not). So a request that crosses the
boundary while decoding, a prompt that crosses it only within chunked prefill, or a cached
prefix reused by a longer request, differs from transformers' one-shot forward of the whole
sequence, which rotates every token by the final length. Requests that stay on one side
match it exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sglite.layers import cpu_ops
from sglite.layers.module import DirectCall
from sglite.layers.rope_scaling import (
    check_rope_type,
    dynamic_exponents,
    dynamic_inv_freq,
    longrope_inv_freq,
    static_inv_freq,
)

if TYPE_CHECKING:
    from sglite.model_executor.forward_batch import ForwardBatch


def rotary_pairs(rotary_dim: int) -> int:
    """How many frequency pairs transformers rotates for `int(head_dim * factor)` dims."""
    return (rotary_dim + 1) // 2


def rotary_permutation(head_dim: int, rotary_dim: int, interleaved: bool) -> torch.Tensor | None:
    """Index of the checkpoint dim each of our head dims takes (None: the identity)."""
    pairs, half = rotary_pairs(rotary_dim), head_dim // 2
    if pairs == half and not interleaved:
        return None
    if interleaved:
        first, second = list(range(0, 2 * pairs, 2)), list(range(1, 2 * pairs, 2))
    else:
        first, second = list(range(pairs)), list(range(pairs, 2 * pairs))
    passed = list(range(2 * pairs, head_dim))
    rest = half - pairs
    return torch.tensor(first + passed[:rest] + second + passed[rest:], dtype=torch.int64)


def permute_heads(t: torch.Tensor, perm: torch.Tensor, head_dim: int, dim: int) -> torch.Tensor:
    """`t` with the dims of each head (consecutive runs of `head_dim` along `dim`) permuted."""
    dim %= t.dim()
    heads = t.unflatten(dim, (-1, head_dim))
    return heads.index_select(dim + 1, perm).flatten(dim, dim + 1)


def _table(inv_freq: torch.Tensor, positions: torch.Tensor, half: int, scale: float):
    """`[..., 2 * head_dim]` rows of `[cos | cos | -sin | sin]`; pairs past `inv_freq` pass."""
    freqs = positions[..., None].to(torch.float32) * inv_freq
    cos, sin = freqs.cos() * scale, freqs.sin() * scale
    pad = half - inv_freq.shape[-1]
    if pad:
        cos = torch.cat([cos, cos.new_ones((*cos.shape[:-1], pad))], dim=-1)
        sin = torch.cat([sin, sin.new_zeros((*sin.shape[:-1], pad))], dim=-1)
    return torch.cat([cos, cos, -sin, sin], dim=-1)


def token_seq_lens(batch: ForwardBatch) -> torch.Tensor:
    """`[T]`: the length of each token's request after this step."""
    if batch.forward_mode.is_decode():
        return batch.seq_lens
    return torch.repeat_interleave(
        batch.seq_lens, batch.extend_seq_lens, output_size=batch.num_tokens
    )


class RotaryEmbedding(DirectCall, nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict[str, Any] | None = None,
        *,
        rotary_dim: int | None = None,
        model_max_positions: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        """`max_position`: the rows to serve (the context); `model_max_positions`: the
        model's `max_position_embeddings` (the dynamic and longrope defaults)."""
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim {rotary_dim} must be in 1..head_dim ({head_dim})")
        self.rope_type = check_rope_type(rope_scaling)
        self.head_dim, self.rotary_dim, self.base = head_dim, rotary_dim, float(base)
        self.model_max_positions = model_max_positions or max_position
        self.params = dict(rope_scaling or {})
        positions = torch.arange(max_position, dtype=torch.float32)
        half = head_dim // 2
        if self.rope_type == "longrope":
            short, long, scale = longrope_inv_freq(
                rotary_dim, base, self.params, self.model_max_positions
            )
            self.long_after = int(self.params["original_max_position_embeddings"])
            table = torch.cat([_table(inv, positions, half, scale) for inv in (short, long)])
        else:
            static_type = "default" if self.rope_type == "dynamic" else self.rope_type
            inv, scale = static_inv_freq(
                static_type, rotary_dim, base, self.params, self.model_max_positions
            )
            table = _table(inv, positions, half, scale)
        self.max_position = max_position
        self.register_buffer("cos_sin", table.to(dtype=dtype, device=device), persistent=False)
        if self.rope_type == "dynamic":
            exps = dynamic_exponents(rotary_dim).to(device)
            self.register_buffer("exponents", exps, persistent=False)

    def lookup(
        self, positions: torch.Tensor, batch: ForwardBatch | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, table) the tokens at `positions` read: once per forward, for every layer."""
        if self.rope_type == "longrope" and batch is not None:
            is_long = token_seq_lens(batch) > self.long_after
            return positions + is_long.to(positions.dtype) * self.max_position, self.cos_sin
        if self.rope_type == "dynamic" and batch is not None:
            factor, lens = float(self.params["factor"]), token_seq_lens(batch)
            inv = dynamic_inv_freq(
                self.rotary_dim, self.base, factor, self.model_max_positions, lens, self.exponents
            )
            rows = _table(inv, positions, self.head_dim // 2, 1.0).to(self.cos_sin.dtype)
            return torch.arange(positions.shape[0], device=positions.device), rows
        return positions, self.cos_sin

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        table: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q `[T, Hq, D]` and k `[T, Hkv, D]` by the `table` rows `positions` (from
        `lookup`; plain positions and this module's table by default); returns new tensors."""
        table = self.cos_sin if table is None else table
        rotated = cpu_ops.rope(positions, q, k, table)
        if rotated is not None:
            return rotated
        cos_sin = table.index_select(0, positions).unsqueeze(1)
        cos, sin = cos_sin.split(self.head_dim, dim=-1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        swapped = x.roll(self.head_dim // 2, dims=-1)
        return torch.addcmul(x * cos, swapped, sin)
