"""The GGUF -> Hugging Face mapping per architecture: tensor names and per-tensor transforms.

This is the half of the converter that knows llama.cpp's conventions; dequantizing and
writing are convert.py's, and a loader that keeps the weights packed can reuse `plan_tensors`
as is. What llama.cpp's own HF -> GGUF conversion does, and so what is undone here:

- names: `token_embd`, `output_norm`, `output` and `blk.{i}.{attn_q, attn_k, ffn_up, ...}`
  (the tables below), each with a `.weight` or `.bias` suffix;
- llama (and Mistral, which llama.cpp writes as llama) interleaves the two rotary halves of
  each Q and K head (rows (j, j + d/2) adjacent): `TensorPlan.permute_heads` says with how
  many heads to undo it. Qwen2/3, Gemma, Phi-3 and Starcoder2 are stored unpermuted
  (they use the half-split rotary layout natively);
- Gemma 1/2/3 RMSNorms compute `x * (1 + w)`: transformers stores `w`, llama.cpp `1 + w`,
  so `TensorPlan.offset` is -1 on every `*norm.weight` of those families;
- Phi-3 keeps transformers' fused `qkv_proj` and `gate_up_proj` (GGUF `attn_qkv`, `ffn_up`);
  its `rope_factors_long/short` tensors are config (longrope factors), not weights;
- llama 3's `rope_freqs` (the per-frequency rope divisors) is config too (hf_config.py);
- mixture-of-experts (qwen2moe, qwen3moe): each layer's routed experts are stacked, one
  `[experts, rows, cols]` tensor per projection (`ffn_{gate,up,down}_exps`), split back into
  transformers' per-expert tensors (`TensorPlan.per_expert`); the router is `ffn_gate_inp`,
  Qwen2-MoE's shared expert `ffn_*_shexp` with its gate `ffn_gate_inp_shexp` (a vector in
  llama.cpp, `[1, hidden]` in transformers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sglite.models.gguf.reader import GGUFFile, UnsupportedGGUF

GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_ATTN = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
_GATED_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_MOE = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_SHARED_EXPERT = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
LLAMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    **_ATTN,
    **_GATED_MLP,
}
# Gemma 2/3 norm around both sub-blocks; llama.cpp's ffn_norm is the pre-MLP one there
GEMMA2_BLOCK = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    **_ATTN,
    **_GATED_MLP,
}
PHI3_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",  # [gate; up] fused, as transformers' Phi-3 keeps it
    "ffn_down": "mlp.down_proj",
}
STARCODER2_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    **_ATTN,
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}


@dataclass(frozen=True)
class ArchMapping:
    """How one GGUF `general.architecture` maps onto a transformers architecture."""

    gguf_arch: str
    hf_architecture: str
    model_type: str
    block_tensors: dict[str, str]
    permute_qk: bool = False  # llama.cpp interleaved the rotary halves of Q and K
    norm_plus_one: bool = False  # llama.cpp stored 1 + w for every RMSNorm weight
    config_tensors: frozenset[str] = field(default_factory=frozenset)  # read into config.json


ARCHS = {
    m.gguf_arch: m
    for m in (
        ArchMapping("llama", "LlamaForCausalLM", "llama", LLAMA_BLOCK, permute_qk=True,
                    config_tensors=frozenset({"rope_freqs.weight"})),
        ArchMapping("mistral", "MistralForCausalLM", "mistral", LLAMA_BLOCK, permute_qk=True),
        ArchMapping("qwen2", "Qwen2ForCausalLM", "qwen2", LLAMA_BLOCK),
        ArchMapping("qwen3", "Qwen3ForCausalLM", "qwen3", {**LLAMA_BLOCK, **_QK_NORM}),
        ArchMapping("gemma", "GemmaForCausalLM", "gemma", LLAMA_BLOCK, norm_plus_one=True),
        ArchMapping("gemma2", "Gemma2ForCausalLM", "gemma2", GEMMA2_BLOCK, norm_plus_one=True),
        ArchMapping("gemma3", "Gemma3ForCausalLM", "gemma3_text", {**GEMMA2_BLOCK, **_QK_NORM},
                    norm_plus_one=True),
        ArchMapping("phi3", "Phi3ForCausalLM", "phi3", PHI3_BLOCK,
                    config_tensors=frozenset({"rope_factors_long.weight",
                                              "rope_factors_short.weight"})),
        ArchMapping("starcoder2", "Starcoder2ForCausalLM", "starcoder2", STARCODER2_BLOCK),
        ArchMapping("qwen2moe", "Qwen2MoeForCausalLM", "qwen2_moe",
                    {**_NORMS, **_ATTN, **_MOE, **_SHARED_EXPERT}),
        ArchMapping("qwen3moe", "Qwen3MoeForCausalLM", "qwen3_moe",
                    {**_NORMS, **_ATTN, **_QK_NORM, **_MOE}),
    )
}  # fmt: skip


@dataclass(frozen=True)
class TensorPlan:
    """One GGUF tensor's way into the HF checkpoint: dequantize, then un-permute the rows
    of each of `permute_heads` heads (when set), then add `offset`. A packed loader can
    apply the permutation to the packed rows as well (ggml quantizes each row on its own,
    in blocks along it); `offset` is only ever set on 1-D norm weights, which are F32.
    `per_expert`: a stacked expert tensor, written as one HF tensor per expert (`hf_name`
    with `experts.{e}.`); `as_row`: a vector written as a `[1, n]` matrix."""

    gguf_name: str
    hf_name: str
    permute_heads: int | None = None
    offset: float = 0.0
    per_expert: bool = False
    as_row: bool = False

    def hf_names(self, num_experts: int) -> list[str]:
        if not self.per_expert:
            return [self.hf_name]
        return [self.hf_name.replace(".experts.", f".experts.{e}.") for e in range(num_experts)]


def mapping_for(gguf: GGUFFile) -> ArchMapping:
    if gguf.arch not in ARCHS:
        raise UnsupportedGGUF(
            f"{gguf.path.name}: GGUF architecture {gguf.arch!r} is not supported; "
            f"supported: {', '.join(sorted(ARCHS))}"
        )
    return ARCHS[gguf.arch]


def hf_tensor_name(mapping: ArchMapping, gguf_name: str) -> str | None:
    """The transformers name of a GGUF tensor, or None when the mapping does not know it."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if base in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        module = mapping.block_tensors.get(parts[2])
        if module is not None:
            return f"model.layers.{int(parts[1])}.{module}.{suffix}"
    return None


def plan_tensors(gguf: GGUFFile, mapping: ArchMapping | None = None) -> list[TensorPlan]:
    """The plan for every weight tensor of the file (config tensors excluded). Refuses a
    tensor the mapping does not know before anything is dequantized."""
    mapping = mapping or mapping_for(gguf)
    num_heads = int(gguf.arch_get("attention.head_count"))
    num_kv_heads = uniform_count(gguf, "attention.head_count_kv", num_heads)
    plans = []
    for name in gguf.tensors:
        if name in mapping.config_tensors:
            continue
        hf = hf_tensor_name(mapping, name)
        if hf is None:
            raise UnsupportedGGUF(
                f"{gguf.path.name}: tensor {name!r} has no counterpart in transformers' "
                f"{mapping.hf_architecture} (sglite's GGUF mapping for {mapping.gguf_arch} "
                "does not know it)"
            )
        heads = None
        if mapping.permute_qk and ".attn_q." in name:
            heads = num_heads
        elif mapping.permute_qk and ".attn_k." in name:
            heads = num_kv_heads
        offset = -1.0 if mapping.norm_plus_one and name.endswith("norm.weight") else 0.0
        per_expert, as_row = "_exps." in name, ".ffn_gate_inp_shexp." in name
        plans.append(TensorPlan(name, hf, heads, offset, per_expert, as_row))
    return plans


def unpermute_rows(w: Any, num_heads: int) -> Any:
    """Undo llama.cpp's Q/K permutation. Per head of d rows llama.cpp stored
    `hf.reshape(2, d/2, cols).swapaxes(0, 1)`; viewing the rows as (d/2, 2) and swapping
    back restores transformers' order. Works on numpy arrays and torch tensors, weights
    (rows, cols) and biases (rows,)."""
    rows = w.shape[0]
    if rows % (2 * num_heads):
        raise UnsupportedGGUF(f"cannot un-permute {rows} rows over {num_heads} heads")
    return w.reshape(num_heads, rows // num_heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def uniform_count(gguf: GGUFFile, key: str, default: int | None = None) -> int:
    """A per-model count (`{arch}.key`; required without a default) that llama.cpp may also
    write per layer, as a list: then all layers must agree."""
    value = gguf.arch_get(key) if default is None else gguf.arch_get(key, default)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise UnsupportedGGUF(
                f"{gguf.path.name}: {gguf.arch}.{key} differs between layers ({sorted(set(value))})"
                "; per-layer sizes are not supported"
            )
        value = value[0]
    return int(value)
