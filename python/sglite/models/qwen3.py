"""Qwen3: Llama's graph with a per-head RMSNorm on q and k before RoPE (q_norm, k_norm)."""

from __future__ import annotations

from sglite.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
