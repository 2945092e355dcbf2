"""DecoderMLAttention: the skeleton's attention for a spec with `mla` (DeepSeek-V2/V3's projections).

Projections (checkpoint names), per token x:
- q: `q_proj` (x -> heads x [nope | rope]) or, with `q_lora_rank`, `q_a_proj` (x -> q_lora_rank),
  `q_a_layernorm`, `q_b_proj` (-> heads x [nope | rope]);
- `kv_a_proj_with_mqa`: x -> `[c | k_pe]` (kv_lora_rank + rope), `kv_a_layernorm` over c;
- `kv_b_proj`: c -> heads x [k_nope | v] (read by sglite.layers.latent_attention);
- `o_proj`: heads x v -> hidden.
RoPE rotates q's rope dims of every head and k_pe (one key shared by all heads). With the
checkpoint's rope dims interleaved (pairs (2i, 2i + 1): DeepSeek-V2, V3 with
`rope_interleave`), their rows of q_proj/q_b_proj and kv_a_proj_with_mqa are permuted as they
load (the skeleton's `head_permutation` over the rope dims), so the half-split kernel applies.

Tensor parallelism: the heads split across ranks (q_proj/q_b_proj and kv_b_proj by rows,
o_proj by columns); q_a_proj, kv_a_proj_with_mqa and their norms are replicated (every rank
computes the same latent, and holds the same latent KV pool).
"""

from __future__ import annotations

import torch
from torch import nn

from sglite.layers.latent_attention import LatentAttention
from sglite.layers.layernorm import NormSpec
from sglite.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    loader_of,
)
from sglite.layers.rotary_embedding import RotaryEmbedding, permute_heads
from sglite.model_executor.forward_batch import ForwardBatch
from sglite.models.decoder import Build, Rope

# q_a_layernorm and kv_a_layernorm: transformers' default epsilon (not the config's)
LATENT_NORM_EPS = 1e-6


class LatentUpProjection(ColumnParallelLinear):
    """`kv_b_proj`: its plain weight is what the absorbed decode multiplies by, so it stays
    unpacked on CPU."""

    def prepack(self) -> bool:
        return False


def _permute_rows_on_load(linear: nn.Module, perm: torch.Tensor, width: int) -> None:
    """Permute the rows of each `width`-row block of the linear's weight (and bias) as they
    load (before the rank's shard is taken)."""
    for param in linear.parameters():
        inner = loader_of(param)

        def load(p, loaded, shard_id=None, inner=inner):
            inner(p, permute_heads(loaded, perm, width, 0), shard_id)

        param.weight_loader = load


class DecoderMLAttention(nn.Module):
    def __init__(
        self,
        b: Build,
        layer_id: int,
        rotary_emb: RotaryEmbedding | None,
        head_permutation: torch.Tensor | None,
    ) -> None:
        super().__init__()
        config, spec, m = b.config, b.spec, b.spec.mla
        if rotary_emb is None:
            raise ValueError(f"{config.architecture}: MLA layers rotate their rope dims")
        hidden, heads = config.hidden_size, config.num_heads
        bias = dict(bias=spec.qkv_bias, dtype=b.dtype, device=b.device)
        self.spec = m
        if m.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * m.qk_head_dim, bias=False, **b.kw)
            q_out = self.q_proj
        else:
            self.q_a_proj = ReplicatedLinear(hidden, m.q_lora_rank, **bias)
            self.q_a_layernorm = NormSpec("rms", LATENT_NORM_EPS).build(
                m.q_lora_rank, b.dtype, b.device
            )
            self.q_b_proj = ColumnParallelLinear(
                m.q_lora_rank, heads * m.qk_head_dim, bias=False, **b.kw
            )
            q_out = self.q_b_proj
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            hidden, m.kv_lora_rank + m.qk_rope_head_dim, **bias
        )
        self.kv_a_layernorm = NormSpec("rms", LATENT_NORM_EPS).build(
            m.kv_lora_rank, b.dtype, b.device
        )
        self.kv_b_proj = LatentUpProjection(
            m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False, **b.kw
        )
        self.o_proj = RowParallelLinear(heads * m.v_head_dim, hidden, bias=spec.o_bias, **b.kw)
        if head_permutation is not None:  # rope dims follow the nope dims of each row block
            for linear, lead in (
                (q_out, m.qk_nope_head_dim),
                (self.kv_a_proj_with_mqa, m.kv_lora_rank),
            ):
                perm = torch.cat([torch.arange(lead), lead + head_permutation])
                _permute_rows_on_load(linear, perm, lead + m.qk_rope_head_dim)
        self.num_heads = heads // b.tp_group.size  # this rank's
        self.rotary_emb = rotary_emb
        scaling = spec.attn_scale if spec.attn_scale is not None else m.qk_head_dim**-0.5
        self.attn = LatentAttention(m, self.num_heads, scaling, layer_id, self.kv_b_proj)
        self.out_scale = spec.residual_scale

    def forward(self, rope: Rope, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        m, num_tokens = self.spec, x.shape[0]
        if m.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(num_tokens, self.num_heads, m.qk_head_dim)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split(
            [m.kv_lora_rank, m.qk_rope_head_dim], dim=-1
        )
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = self.rotary_emb(
            rope[0], q_pe.contiguous(), k_pe.unsqueeze(1).contiguous(), rope[1]
        )
        out = self.o_proj(self.attn(q_nope, q_pe, latent, k_pe[:, 0], batch))
        return out if self.out_scale == 1.0 else out * self.out_scale
