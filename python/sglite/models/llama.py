"""The Llama family (Llama 2/3, Mistral, SmolLM2), also the base of the Qwen2/Qwen3 classes.

A decoder layer is pre-norm attention then pre-norm SwiGLU MLP, with the residual add fused
into the next norm. Q/K/V and gate/up run as one merged matmul each; checkpoint tensors
(`q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj`) are loaded into their shards. The
variations between families are class attributes read at construction:

| attribute      | Llama              | Qwen2 | Qwen3              |
|----------------|--------------------|-------|--------------------|
| qkv bias       | config.attention_bias | yes | config.attention_bias |
| o_proj bias    | config.attention_bias | no  | config.attention_bias |
| per-head q/k RMSNorm before RoPE | no | no   | yes                |
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from sglite.distributed import NULL_TP_GROUP, TPGroup
from sglite.layers.activation import SiluAndMul
from sglite.layers.layernorm import RMSNorm
from sglite.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from sglite.layers.logits_processor import LogitsProcessor
from sglite.layers.radix_attention import RadixAttention
from sglite.layers.rotary_embedding import RotaryEmbedding
from sglite.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglite.model_executor.forward_batch import ForwardBatch
from sglite.models.model_config import ModelConfig


def default_weight_loader(
    param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(loaded.shape)}, the model expects "
            f"{tuple(param.shape)}"
        )
    param.data.copy_(loaded)


class LlamaMLP(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | None,
        tp_group: TPGroup = NULL_TP_GROUP,
    ):
        super().__init__()
        size, bias = config.intermediate_size, config.mlp_bias
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [size, size],
            bias=bias,
            dtype=dtype,
            device=device,
            tp_group=tp_group,
        )
        self.down_proj = RowParallelLinear(
            size, config.hidden_size, bias=bias, dtype=dtype, device=device, tp_group=tp_group
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary_emb: RotaryEmbedding,
        dtype: torch.dtype,
        device: torch.device | None,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        tp_group: TPGroup = NULL_TP_GROUP,
    ) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_heads,
            config.num_kv_heads,
            bias=qkv_bias,
            dtype=dtype,
            device=device,
            tp_group=tp_group,
        )
        # This rank's heads (all of them with tp_size 1).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_heads * self.head_dim,
            config.hidden_size,
            bias=o_bias,
            dtype=dtype,
            device=device,
            tp_group=tp_group,
        )
        self.q_norm = self.k_norm = None
        if qk_norm:
            eps = config.rms_norm_eps
            self.q_norm = RMSNorm(self.head_dim, eps, dtype=dtype, device=device)
            self.k_norm = RMSNorm(self.head_dim, eps, dtype=dtype, device=device)
        self.rotary_emb = rotary_emb
        self.attn = RadixAttention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_id,
            sliding_window=config.sliding_window_for(layer_id),
        )  # fmt: skip

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        attn: LlamaAttention,
        config: ModelConfig,
        dtype,
        device,
        tp_group: TPGroup = NULL_TP_GROUP,
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = attn
        self.mlp = LlamaMLP(config, dtype, device, tp_group)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        layers: list[LlamaDecoderLayer],
        config: ModelConfig,
        dtype,
        device,
        tp_group: TPGroup = NULL_TP_GROUP,
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, dtype=dtype, device=device, tp_group=tp_group
        )
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch):
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, batch)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    qk_norm = False

    # Checkpoint names merged into one of our parameters: (ours, theirs, shard id).
    stacked_params = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | None = None,
        tp_group: TPGroup = NULL_TP_GROUP,
    ) -> None:
        """With `tp_group` of size > 1 the model holds this rank's shard (see layers.linear)."""
        super().__init__()
        self.config = config
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.context_length,
            config.rope_theta,
            config.rope_scaling,
            dtype=dtype,
            device=device,
        )
        layers = [
            LlamaDecoderLayer(
                LlamaAttention(
                    config,
                    i,
                    self.rotary_emb,
                    dtype,
                    device,
                    qkv_bias=self.has_qkv_bias(config),
                    o_bias=self.has_o_bias(config),
                    qk_norm=self.qk_norm,
                    tp_group=tp_group,
                ),
                config,
                dtype,
                device,
                tp_group,
            )
            for i in range(config.num_layers)
        ]
        self.model = LlamaModel(layers, config, dtype, device, tp_group)
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, dtype=dtype, device=device, tp_group=tp_group
        )
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor()

    @staticmethod
    def has_qkv_bias(config: ModelConfig) -> bool:
        return config.attention_bias

    @staticmethod
    def has_o_bias(config: ModelConfig) -> bool:
        return config.attention_bias

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """float32 logits: `[B, vocab]`, or `[T, vocab]` with `batch.return_all_logits`."""
        hidden = self.model(input_ids, positions, batch)
        return self.logits_processor(hidden, self.lm_head, batch)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint tensors by HF name; unknown or missing tensors are an error."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, shard_id = name, None
            for ours, theirs, sid in self.stacked_params:
                if f".{theirs}." in name:
                    target, shard_id = name.replace(f".{theirs}.", f".{ours}."), sid
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}; "
                    "is the architecture in config.json right?"
                )
            getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
            loaded.add(name)
        missing = sorted(self._checkpoint_names() - loaded)
        if missing:
            raise ValueError(
                f"checkpoint lacks {len(missing)} tensor(s) of {type(self).__name__}, e.g. "
                + ", ".join(missing[:5])
            )

    def _checkpoint_names(self) -> set[str]:
        """The HF tensor names this model needs (stacked parameters expanded)."""
        names = set()
        for name, _ in self.named_parameters():
            stacked = [(o, t) for o, t, _ in self.stacked_params if f".{o}." in name]
            names |= {name.replace(f".{o}.", f".{t}.") for o, t in stacked} if stacked else {name}
        return names

    def prepack(self) -> int:
        """CPU: pack linear weights for oneDNN (see layers.linear). Returns how many packed."""
        return sum(
            1 for m in self.modules() if hasattr(m, "prepack") and m is not self and m.prepack()
        )


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama's graph; its `sliding_window` applies to every layer (the attention
    backends attend it: `ModelConfig.layer_sliding_windows`)."""
