"""GGUF metadata -> the config.json fields of the mixture-of-experts architectures
(qwen2moe, qwen3moe); the rest of the config is hf_config.py's.

llama.cpp builds every layer of these as sparse and fixes per architecture what the HF
config states: qwen3moe renormalises the top-k weights, qwen2moe does not; the router is a
softmax. A file stating otherwise (`expert_weights_norm`, `expert_gating_func`) is refused,
as is a layer without experts.
"""

from __future__ import annotations

from typing import Any

from sglite.models.gguf.reader import GGUFFile, UnsupportedGGUF


def _has(gguf: GGUFFile, block_tensor: str) -> bool:
    return f"blk.0.{block_tensor}" in gguf.tensors


MOE_ARCHS = {"qwen2moe": False, "qwen3moe": True}  # -> whether top-k is renormalised
_SOFTMAX_GATING = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX


def qwen_moe_config(gguf: GGUFFile, config: dict[str, Any], consumed: set[str]) -> dict[str, Any]:
    get, name = gguf.arch_get, gguf.path.name
    consumed.update(("expert_weights_norm", "expert_gating_func", "expert_shared_count"))
    renormalize = MOE_ARCHS[gguf.arch]
    if bool(get("expert_weights_norm", renormalize)) != renormalize:
        raise UnsupportedGGUF(
            f"{name}: {gguf.arch}.expert_weights_norm = {get('expert_weights_norm')!r}: "
            f"llama.cpp's {gguf.arch} always runs {renormalize}"
        )
    if int(get("expert_gating_func", _SOFTMAX_GATING)) != _SOFTMAX_GATING:
        raise UnsupportedGGUF(
            f"{name}: {gguf.arch}.expert_gating_func = {get('expert_gating_func')!r}: "
            f"{gguf.arch} routes with softmax"
        )
    layers = range(config["num_hidden_layers"])
    dense = [i for i in layers if f"blk.{i}.ffn_gate_inp.weight" not in gguf.tensors]
    if dense:
        raise UnsupportedGGUF(
            f"{name}: layers {dense} have no experts; llama.cpp's {gguf.arch} layers are all sparse"
        )
    out: dict[str, Any] = {
        "num_experts": int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "norm_topk_prob": renormalize,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "use_sliding_window": False,
        "sliding_window": None,
    }
    if gguf.arch == "qwen2moe":
        if not _has(gguf, "attn_q.bias"):
            raise UnsupportedGGUF(f"{name}: a qwen2moe GGUF without Q/K/V biases")
        shared = int(get("expert_shared_feed_forward_length", 0))
        if shared and int(get("expert_shared_count", 1)) != 1:
            raise UnsupportedGGUF(f"{name}: {gguf.arch}.expert_shared_count must be 1")
        out["shared_expert_intermediate_size"] = shared
        if not shared and _has(gguf, "ffn_gate_shexp.weight"):
            raise UnsupportedGGUF(f"{name}: shared-expert tensors without their width")
    else:
        out["attention_bias"] = _has(gguf, "attn_q.bias")
    return out
