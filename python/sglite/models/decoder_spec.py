"""DecoderSpec: what one model family's decoder does differently, declared as data.

Every dense family is the same skeleton (sglite.models.decoder): embed, N x (attention,
MLP), norm, LM head. A family's file only says how its checkpoint's config maps to a
`DecoderSpec` (and how its tensors are named); the skeleton reads the spec and nothing else.

Residual layouts (`layout`; h is the residual stream, n* the layer's norms):

| layout       | one layer                                                 | families          |
|--------------|-----------------------------------------------------------|-------------------|
| `pre`        | h += attn(n1(h)); h += mlp(n2(h))                         | Llama, most       |
| `sandwich`   | h += n3(attn(n1(h))); h += n4(mlp(n2(h)))                 | GLM-4, Gemma 2/3  |
| `post`       | h += n3(attn(h)); h += n4(mlp(h))                         | OLMo 2            |
| `parallel`   | h += attn(n1(h)) + mlp(n1(h))                             | Cohere, Phi       |
| `parallel2`  | h += attn(n1(h)) + mlp(n2(h))                             | GPT-NeoX          |

`ConfigFields` reads a family's config fields: a field the family needs and the config lacks
is a named error, and a value sglite does not implement is refused by name at start-up
(`refuse`), so a model is never built with silently different math.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglite.layers.activation import check_activation
from sglite.layers.latent_attention import MLASpec
from sglite.layers.layernorm import NormSpec
from sglite.layers.moe.block import MoESpec
from sglite.layers.qk_norm import QKNormSpec

LAYOUTS = ("pre", "sandwich", "post", "parallel", "parallel2")


@dataclass(frozen=True)
class DecoderSpec:
    norm: NormSpec
    act: str = "silu"
    layout: str = "pre"
    gated_mlp: bool = True  # [gate | up] -> act(gate) * up; else up -> act
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: QKNormSpec | None = None
    rotary_factor: float = 1.0  # the rotated share of each head (partial rotary)
    rope_interleaved: bool = False  # GPT-J pairs (2i, 2i + 1) in the checkpoint
    rope_layers: tuple[bool, ...] | None = None  # per layer: rotates (False: NoPE); None: all
    embed_scale: float = 1.0
    embed_scale_in_dtype: bool = False  # Gemma rounds sqrt(hidden) to the model dtype first
    residual_scale: float = 1.0  # Granite: each branch's output times this
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_logit_cap: float = 0.0  # Gemma 2: scores c * tanh(s / c) before the softmax; 0: none
    attn_sinks: bool = False  # gpt-oss: a learned logit per query head in the softmax (`sinks`)
    logit_scale: float = 1.0
    final_logit_softcap: float | None = None
    clip_qkv: float | None = None  # OLMo: q, k and v clamped to [-c, c]
    lm_head_bias: bool = False
    moe: MoESpec | None = None  # the sparse layers' MoE block (sglite.layers.moe.block)
    # multi-head latent attention (DeepSeek-V2/V3) instead of per-head K/V: its dims; rope
    # then covers its qk_rope_head_dim dims (sglite.models.decoder_mla)
    mla: MLASpec | None = None

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r} is not one of {', '.join(LAYOUTS)}")
        check_activation(self.act)
        if not self.attn_logit_cap >= 0.0:
            raise ValueError(f"attn_logit_softcapping={self.attn_logit_cap} must be >= 0")
        if not 0.0 < self.rotary_factor <= 1.0:
            raise ValueError(f"partial_rotary_factor={self.rotary_factor} must be in (0, 1]")


class ConfigFields:
    """A family's view of its transformers config (`ModelConfig.hf_config`)."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.hf = config.hf_config
        self.arch = config.architecture

    def has(self, name: str) -> bool:
        return getattr(self.hf, name, None) is not None

    def get(self, name: str, default: Any = None) -> Any:
        value = getattr(self.hf, name, None)
        return default if value is None else value

    def require(self, name: str) -> Any:
        if not self.has(name):
            raise ValueError(
                f"{self.arch}: config.json ({type(self.hf).__name__}) has no {name!r}, which "
                f"{self.arch} reads; is the architecture in config.json right?"
            )
        return getattr(self.hf, name)

    def refuse(self, name: str, value: Any, why: str) -> None:
        raise ValueError(f"{self.arch}: {name}={value!r} is not supported: {why}")

    def expect(self, name: str, neutral: Any, why: str = "sglite does not implement it") -> None:
        """Refuse unless the field is absent or has its neutral value."""
        value = getattr(self.hf, name, None)
        if value is not None and value != neutral:
            self.refuse(name, value, why)

    def attention_biases(self) -> dict[str, bool]:
        """`attention_bias` on Q/K/V and o_proj alike (Llama and most families)."""
        bias = bool(self.get("attention_bias", False))
        return dict(qkv_bias=bias, o_bias=bias)

    def act(self, name: str = "hidden_act") -> str:
        value = self.require(name)
        try:
            return check_activation(value)
        except ValueError as e:
            raise ValueError(f"{self.arch}: {e}") from None

    def norm(self, kind: str, eps_name: str) -> NormSpec:
        return NormSpec(kind, float(self.require(eps_name)))

    def rotary_factor(self) -> float:
        return float(self.config.partial_rotary_factor)

    def head_dim_is_hidden_over_heads(self) -> None:
        """Families whose attention always splits hidden_size evenly over the heads."""
        cfg = self.config
        even = cfg.hidden_size // cfg.num_heads
        if cfg.head_dim != even:
            self.refuse("head_dim", cfg.head_dim, f"{self.arch} uses hidden_size / heads = {even}")

    def one_kv_head_per_head(self) -> None:
        cfg = self.config
        if cfg.num_kv_heads != cfg.num_heads:
            self.refuse(
                "num_key_value_heads",
                cfg.num_kv_heads,
                f"{self.arch} has one KV head per query head ({cfg.num_heads})",
            )
