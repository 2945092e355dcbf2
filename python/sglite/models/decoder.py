"""The decoder skeleton every dense family shares: attention, MLP, layer and model stack.

What varies is declared in a `DecoderSpec` (sglite.models.decoder_spec) and read here at
construction; the forward passes branch on nothing else. Q/K/V and gate/up run as one merged
matmul each (sglite.layers.linear). The residual add is fused into the next norm where the
layout allows it: a layer takes and returns `(x, residual)`, the stream being `x + residual`
(`residual` None before the first layer).

Parameter names (our side of the checkpoint mapping, see sglite.models.causal_lm):
`model.embed_tokens`, `model.layers.<i>.{input_layernorm, post_attention_layernorm (the MLP's
input), post_self_attn_layernorm, post_mlp_layernorm (the outputs' norms), self_attn.{qkv_proj,
o_proj, q_norm, k_norm, sinks}, mlp.{gate_up_proj or up_proj, down_proj}}`, `model.norm`, `lm_head`;
a MoE family's sparse layers hold `mlp` = sglite.layers.moe.block.SparseMoeBlock instead
(DecoderForCausalLM.mlp_for_layer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from sglite.distributed import NULL_TP_GROUP, TPGroup
from sglite.layers.activation import Activation, GatedActivation
from sglite.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from sglite.layers.module import DirectCall
from sglite.layers.qk_norm import permute_on_load
from sglite.layers.radix_attention import RadixAttention
from sglite.layers.rotary_embedding import RotaryEmbedding, rotary_permutation
from sglite.layers.vocab_parallel_embedding import VocabParallelEmbedding
from sglite.model_executor.forward_batch import ForwardBatch
from sglite.models.decoder_spec import DecoderSpec
from sglite.models.model_config import ModelConfig

Rope = tuple[torch.Tensor, torch.Tensor]  # (table rows, table): RotaryEmbedding.lookup


@dataclass(frozen=True)
class Build:
    """What every module of the skeleton is built from."""

    config: ModelConfig
    spec: DecoderSpec
    dtype: torch.dtype
    device: torch.device | None = None
    tp_group: TPGroup = NULL_TP_GROUP
    ep_size: int = 1  # MoE layers: expert-parallel groups (sglite.layers.moe.experts)
    packed: bool = False  # linear layers and embeddings over GGUF blocks (layers.quant_*)
    # the embedding and LM head packed too (None: as `packed`); a safetensors-quantized
    # checkpoint packs its linear layers only, its embeddings are floats
    packed_embedding: bool | None = None

    @property
    def kw(self) -> dict:
        return dict(dtype=self.dtype, device=self.device, tp_group=self.tp_group)

    @property
    def is_embedding_packed(self) -> bool:
        return self.packed if self.packed_embedding is None else self.packed_embedding

    def linear(self, cls: type) -> type:
        """`cls` (a layer of sglite.layers.linear), or its packed twin in a packed model."""
        if not self.packed:
            return cls
        from sglite.layers.quant_linear import packed_class

        return packed_class(cls)

    def embedding(self) -> nn.Module:
        size = (self.config.vocab_size, self.config.hidden_size)
        if not self.is_embedding_packed:
            return VocabParallelEmbedding(*size, **self.kw)
        from sglite.layers.quant_embedding import QuantVocabParallelEmbedding

        return QuantVocabParallelEmbedding(*size, **self.kw)

    def norm(self, size: int) -> nn.Module:
        return self.spec.norm.build(size, self.dtype, self.device)


class DecoderAttention(DirectCall, nn.Module):
    def __init__(
        self,
        b: Build,
        layer_id: int,
        rotary_emb: RotaryEmbedding | None,
        head_permutation: torch.Tensor | None,
    ) -> None:
        """`rotary_emb` None: a NoPE layer. `head_permutation`: the rotary layout's (it
        permutes the q and k rows as they load)."""
        super().__init__()
        config, spec = b.config, b.spec
        self.head_dim = d = config.head_dim
        self.qkv_proj = b.linear(QKVParallelLinear)(
            config.hidden_size, d, config.num_heads, config.num_kv_heads, bias=spec.qkv_bias, **b.kw
        )
        self.qkv_proj.head_permutation = head_permutation
        # This rank's heads (all of them with tp_size 1).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = b.linear(RowParallelLinear)(
            config.num_heads * d, config.hidden_size, bias=spec.o_bias, **b.kw
        )
        self.q_norm = self.k_norm = None
        self.norm_scope = spec.qk_norm.scope if spec.qk_norm else None
        if spec.qk_norm is not None:
            q_start = self.qkv_proj.tp_rank * self.num_heads
            build = spec.qk_norm.build
            self.q_norm = build(self.num_heads, config.num_heads, d, q_start, **b.kw)
            kv_start = self.qkv_proj.kv_head_start
            self.k_norm = build(self.num_kv_heads, config.num_kv_heads, d, kv_start, **b.kw)
            if head_permutation is not None:
                permute_on_load(self.q_norm, head_permutation, d)
                permute_on_load(self.k_norm, head_permutation, d)
        self.rotary_emb = rotary_emb
        self.clip_qkv, self.out_scale = spec.clip_qkv, spec.residual_scale
        scaling = spec.attn_scale if spec.attn_scale is not None else d**-0.5
        self.sinks = None
        if spec.attn_sinks:  # [H] in the checkpoint; this rank keeps its query heads' share
            self.sinks = nn.Parameter(
                torch.empty(self.num_heads, dtype=b.dtype, device=b.device), requires_grad=False
            )
            self.sinks.weight_loader = self._load_sinks
        self.attn = RadixAttention(
            self.num_heads,
            d,
            scaling,
            self.num_kv_heads,
            layer_id,
            sliding_window=config.sliding_window_for(layer_id),
            logit_cap=spec.attn_logit_cap,
            sinks=self.sinks,
        )

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = self.num_heads
        if loaded.dim() != 1 or loaded.shape[0] != n * self.qkv_proj.tp_size:
            raise ValueError(
                f"self_attn.sinks: checkpoint tensor has shape {tuple(loaded.shape)}, the model "
                f"expects ({n * self.qkv_proj.tp_size},) (one logit per query head)"
            )
        param.data.copy_(loaded.narrow(0, self.qkv_proj.tp_rank * n, n))

    def forward(self, rope: Rope | None, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        if self.norm_scope == "proj":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.norm_scope in ("head", "head_weights"):
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(rope[0], q, k, rope[1])
        out = self.o_proj(self.attn(q, k, v, batch))
        return out if self.out_scale == 1.0 else out * self.out_scale


class DecoderMLP(DirectCall, nn.Module):
    """Gated: `down(act(gate) * up)` over the merged `[gate | up]`; plain: `down(act(up))`."""

    def __init__(self, b: Build) -> None:
        super().__init__()
        config, spec = b.config, b.spec
        size, hidden = config.intermediate_size, config.hidden_size
        kw = dict(bias=spec.mlp_bias, **b.kw)
        if spec.gated_mlp:
            self.gate_up_proj = b.linear(MergedColumnParallelLinear)(hidden, [size, size], **kw)
            self.act_fn = GatedActivation(spec.act)
        else:
            self.up_proj = b.linear(ColumnParallelLinear)(hidden, size, **kw)
            self.act_fn = Activation(spec.act)
        self.down_proj = b.linear(RowParallelLinear)(size, hidden, **kw)
        self.up = self.gate_up_proj if spec.gated_mlp else self.up_proj
        self.out_scale = spec.residual_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.act_fn(self.up(x)))
        return out if self.out_scale == 1.0 else out * self.out_scale


# the norms each layout has (see DecoderSpec's table)
_LAYOUT_NORMS = {
    "pre": ("input_layernorm", "post_attention_layernorm"),
    "sandwich": (
        "input_layernorm",
        "post_attention_layernorm",
        "post_self_attn_layernorm",
        "post_mlp_layernorm",
    ),
    "post": ("post_self_attn_layernorm", "post_mlp_layernorm"),
    "parallel": ("input_layernorm",),
    "parallel2": ("input_layernorm", "post_attention_layernorm"),
}


class DecoderLayer(DirectCall, nn.Module):
    def __init__(self, b: Build, attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn, self.mlp = attn, mlp
        for name in _LAYOUT_NORMS[b.spec.layout]:
            setattr(self, name, b.norm(b.config.hidden_size))
        self.run = getattr(self, f"_{b.spec.layout}")

    def forward(
        self, rope: Rope | None, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.run(rope, x, residual, batch)

    def _norm_in(self, x, residual):
        if residual is None:
            return self.input_layernorm(x), x
        return self.input_layernorm(x, residual)

    def _pre(self, rope, x, residual, batch):
        x, residual = self._norm_in(x, residual)
        x = self.self_attn(rope, x, batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def _sandwich(self, rope, x, residual, batch):
        x, residual = self._norm_in(x, residual)
        x = self.post_self_attn_layernorm(self.self_attn(rope, x, batch))
        x, residual = self.post_attention_layernorm(x, residual)
        return self.post_mlp_layernorm(self.mlp(x)), residual

    def _post(self, rope, x, residual, batch):
        h = x if residual is None else x + residual
        h = h + self.post_self_attn_layernorm(self.self_attn(rope, h, batch))
        return self.post_mlp_layernorm(self.mlp(h)), h

    def _parallel(self, rope, x, residual, batch):
        x, residual = self._norm_in(x, residual)
        return self.self_attn(rope, x, batch) + self.mlp(x), residual

    def _parallel2(self, rope, x, residual, batch):
        h = x if residual is None else x + residual
        attn = self.self_attn(rope, self.input_layernorm(h), batch)
        return attn + self.mlp(self.post_attention_layernorm(h)), h


def dense_mlp(b: Build, layer_id: int) -> nn.Module:
    """Every layer's MLP of a dense family (the default `mlp_for_layer`)."""
    return DecoderMLP(b)


class DecoderModel(nn.Module):
    def __init__(
        self,
        b: Build,
        attention_cls: type[nn.Module] = DecoderAttention,
        mlp_for_layer: Callable[[Build, int], nn.Module] = dense_mlp,
    ) -> None:
        """`attention_cls(b, layer_id, rotary_emb, head_permutation)` builds each layer's
        attention; `mlp_for_layer(b, layer_id)` its MLP (a family may mix kinds)."""
        super().__init__()
        config, spec = b.config, b.spec
        self.embed_tokens = b.embedding()
        d = spec.mla.qk_rope_head_dim if spec.mla is not None else config.head_dim
        rotary_dim = int(d * spec.rotary_factor)
        perm = rotary_permutation(d, rotary_dim, spec.rope_interleaved)
        rotates = spec.rope_layers or (True,) * config.num_layers
        # One rotary table per distinct RopeParams among the rotating layers (Gemma 3: the
        # local base on sliding layers, the global one with rope_scaling on full layers);
        # `rope_idx[i]`: the table layer i reads, None for a NoPE layer.
        ropes, self.rope_idx = [], []
        for i in range(config.num_layers):
            params = config.rope_for(i) if rotates[i] else None
            if params is not None and params not in ropes:
                ropes.append(params)
            self.rope_idx.append(None if params is None else ropes.index(params))
        self.rotary_embs = nn.ModuleList(
            RotaryEmbedding(
                d,
                config.context_length,
                params.theta,
                params.scaling,
                rotary_dim=rotary_dim,
                model_max_positions=config.max_position_embeddings,
                dtype=b.dtype,
                device=b.device,
            )
            for params in ropes
        )
        self.layers = nn.ModuleList(
            DecoderLayer(
                b,
                attention_cls(b, i, None if j is None else self.rotary_embs[j], perm),
                mlp_for_layer(b, i),
            )
            for i, j in enumerate(self.rope_idx)
        )
        self.norm = b.norm(config.hidden_size)
        self.embed_scale = spec.embed_scale
        if spec.embed_scale_in_dtype:  # the scale as the model dtype holds it (Gemma)
            self.embed_scale = float(torch.tensor(spec.embed_scale, dtype=b.dtype))

    @property
    def rotary_emb(self) -> RotaryEmbedding:
        """The first rotary table (the only one unless the layer types rotate differently)."""
        return self.rotary_embs[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * self.embed_scale if self.embed_scale != 1.0 else x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch):
        x = self.embed(input_ids)
        ropes = [emb.lookup(positions, batch) for emb in self.rotary_embs]
        residual = None
        for layer, j in zip(self.layers, self.rope_idx):
            x, residual = layer(None if j is None else ropes[j], x, residual, batch)
        x, _ = self.norm(x, residual)
        return x
