"""No silent divergence: a table of config mutations, each matching transformers or refused.

A mutation changes config fields of a tiny checkpoint (tests/fixtures/tiny_models.py). In
MATCHES, the mutated checkpoint's prefill logits must equal transformers' on the same
weights: the field is implemented (or, where transformers' class ignores it, ignored alike).
In REFUSED, starting a ModelRunner on the mutated config.json must fail before any weight
is read, with a message naming the field and its value, never an AttributeError.
"""

from __future__ import annotations

import pytest
import torch

from fixtures.model_driver import Driver
from fixtures.tiny_models import tiny_config

ROPE = dict(rope_theta=10000.0)
YARN = dict(ROPE, rope_type="yarn", factor=4.0, original_max_position_embeddings=128)

# case -> (tiny arch, build options); each must match transformers
MATCHES = {
    "llama hidden_act=gelu_new": ("llama", {"config": {"hidden_act": "gelu_new"}}),
    "llama hidden_act=quick_gelu": ("llama", {"config": {"hidden_act": "quick_gelu"}}),
    "llama attention_bias+mlp_bias": ("llama", {"bias": True}),
    "llama head_dim=32 (not hidden/heads)": ("llama", {"head_dim": 32}),
    "llama tie_word_embeddings": ("llama", {"tie_word_embeddings": True}),
    "llama rope yarn": ("llama", {"rope_scaling": dict(YARN, rope_type="yarn")}),
    "llama rope yarn mscale, no truncate": (
        "llama",
        {
            "rope_scaling": dict(
                YARN, factor=8.0, mscale=0.707, mscale_all_dim=1.0, truncate=False, beta_fast=16
            )
        },
    ),
    "llama rope yarn attention_factor": (
        "llama",
        {"rope_scaling": dict(YARN, attention_factor=1.3)},
    ),
    # transformers' Llama reads no soft-cap: neither does sglite's
    "llama final_logit_softcapping (unread)": (
        "llama",
        {"config": {"final_logit_softcapping": 5.0}},
    ),
    "mistral attention_bias (unread)": ("mistral", {"config": {"attention_bias": True}}),
    "qwen2 mlp_bias (unread)": ("qwen2", {"config": {"mlp_bias": True}}),
    "gemma hidden_act=gelu (read as tanh)": ("gemma", {"config": {"hidden_act": "gelu"}}),
    "phi3 default rope, whole head": (
        "phi3",
        {"config": {"rope_parameters": dict(ROPE, partial_rotary_factor=1.0)}},
    ),
    "glm4 yarn over its partial rotary": (
        "glm4",
        {"config": {"rope_parameters": dict(YARN, partial_rotary_factor=0.5)}},
    ),
    "gpt_neox use_parallel_residual=False": (
        "gpt_neox",
        {"config": {"use_parallel_residual": False}},
    ),
    "stablelm use_parallel_residual, no qk norm": (
        "stablelm",
        {"config": {"use_parallel_residual": True, "qk_layernorm": False}},
    ),
    "cohere use_qk_norm=False": ("cohere", {"config": {"use_qk_norm": False}}),
    "phi qk_layernorm=False": ("phi", {"config": {"qk_layernorm": False}}),
    "olmo clip_qkv=None": ("olmo", {"config": {"clip_qkv": None}}),
    "smollm3 no_rope_layers longer than the layers": (
        "smollm3",
        {"config": {"no_rope_layers": [0, 1, 0, 1]}},
    ),
    # windowed layers rotate, the global one is NoPE (a window shorter than the prompt)
    "exaone4 hybrid layers": (
        "exaone4",
        {
            "config": {
                "sliding_window": 16,
                "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            }
        },
    ),
    # sliding_window set, every layer full: no layer rotates (transformers' rule)
    "exaone4 window, no sliding layer": (
        "exaone4",
        {"config": {"sliding_window": 16, "layer_types": ["full_attention"] * 3}},
    ),
    "gemma2 without soft-caps": (
        "gemma2",
        {"config": {"attn_logit_softcapping": None, "final_logit_softcapping": None}},
    ),
    "gemma2 attention_bias": ("gemma2", {"config": {"attention_bias": True}}),
    "gemma2 every layer full": ("gemma2", {"config": {"layer_types": ["full_attention"] * 4}}),
    "gemma3 final_logit_softcapping": ("gemma3", {"config": {"final_logit_softcapping": 2.0}}),
    "gemma3 layer_types full first": (
        "gemma3",
        {"config": {"layer_types": ["full_attention"] + ["sliding_attention"] * 5}},
    ),
    # Cohere 2 rotates exactly its windowed layers: none here
    "cohere2 every layer full (NoPE everywhere)": (
        "cohere2",
        {"config": {"layer_types": ["full_attention"] * 4}},
    ),
    # mixture-of-experts (tests/fixtures/tiny_moe.py): routing and layer-schedule fields
    "qwen2_moe norm_topk_prob": ("qwen2_moe", {"config": {"norm_topk_prob": True}}),
    "qwen2_moe decoder_sparse_step=2 with mlp_only_layers": (
        "qwen2_moe",
        {"config": {"decoder_sparse_step": 2, "mlp_only_layers": [1]}},
    ),
    "qwen2_moe num_experts=0 (every layer dense)": ("qwen2_moe", {"config": {"num_experts": 0}}),
    "qwen2_moe no shared expert": (
        "qwen2_moe",
        {"config": {"shared_expert_intermediate_size": 0}},
    ),
    "qwen2_moe qkv_bias=False": ("qwen2_moe", {"config": {"qkv_bias": False}}),
    "qwen2_moe sliding layers": (
        "qwen2_moe",
        {"config": {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 3}},
    ),
    # training-only fields: the router's aux loss and logits never change the model's logits
    "qwen2_moe output_router_logits, aux loss (training only)": (
        "qwen2_moe",
        {"config": {"output_router_logits": True, "router_aux_loss_coef": 0.5}},
    ),
    "qwen3_moe norm_topk_prob=False": ("qwen3_moe", {"config": {"norm_topk_prob": False}}),
    "qwen3_moe attention_bias": ("qwen3_moe", {"config": {"attention_bias": True}}),
    "qwen3_moe use_sliding_window": (
        "qwen3_moe",
        {"config": {"use_sliding_window": True, "sliding_window": 16}},
    ),
    "qwen3_moe top-1 of 4 experts": (
        "qwen3_moe",
        {"config": {"num_experts": 4, "num_experts_per_tok": 1}},
    ),
    "mixtral router_jitter_noise (training only)": (
        "mixtral",
        {"config": {"router_jitter_noise": 0.1}},
    ),
    "mixtral head_dim=32": ("mixtral", {"head_dim": 32}),
    "mixtral top-3": ("mixtral", {"config": {"num_experts_per_tok": 3}}),
    "olmoe norm_topk_prob": ("olmoe", {"config": {"norm_topk_prob": True}}),
    "olmoe attention_bias": ("olmoe", {"config": {"attention_bias": True}}),
    "gpt_oss attention_bias=False": ("gpt_oss", {"config": {"attention_bias": False}}),
    # transformers' experts run the clamped SwiGLU whatever hidden_act says: so do sglite's
    "gpt_oss swiglu_alpha, swiglu_limit, hidden_act=gelu (unread)": (
        "gpt_oss",
        {"config": {"swiglu_alpha": 1.0, "swiglu_limit": 0.5, "hidden_act": "gelu"}},
    ),
    "gpt_oss layer_types full, sliding, sliding, full": (
        "gpt_oss",
        {
            "config": {
                "layer_types": ["full_attention", *["sliding_attention"] * 2, "full_attention"]
            }
        },
    ),
}

# case -> (tiny arch, config options, the refusal's message); refused at start-up
REFUSED = {
    "llama hidden_act=xielu": (
        "llama",
        {"config": {"hidden_act": "xielu"}},
        r"hidden_act='xielu' is not implemented",
    ),
    "llama rope proportional": (
        "llama",
        {"config": {"rope_parameters": dict(ROPE, rope_type="proportional")}},
        r"rope_type='proportional' is not implemented",
    ),
    "llama yarn over a partial rotary": (
        "llama",
        {"config": {"rope_parameters": dict(YARN, partial_rotary_factor=0.5)}},
        r"partial_rotary_factor=0.5 is not supported",
    ),
    "gemma bidirectional attention": (
        "gemma",
        {"config": {"use_bidirectional_attention": True}},
        r"use_bidirectional_attention=True.* is not supported",
    ),
    "gpt_neox with KV heads": (
        "gpt_neox",
        {"config": {"num_key_value_heads": 2}},
        r"num_key_value_heads=2 is not supported",
    ),
    "stablelm head_dim": (
        "stablelm",
        {"config": {"head_dim": 32}},
        r"head_dim=32 is not supported",
    ),
    "smollm3 short no_rope_layers": (
        "smollm3",
        {"config": {"no_rope_layers": [1, 0], "layer_types": ["full_attention"] * 3}},
        r"no_rope_layers has 2 entries for 3 layers",
    ),
    # a config class without the fields the named architecture reads: a named error
    "phi config as LlamaForCausalLM": (
        "phi",
        {"config": {"architectures": ["LlamaForCausalLM"]}},
        r"LlamaForCausalLM: config.json \(PhiConfig\) has no 'rms_norm_eps'",
    ),
    "llama config as GraniteForCausalLM": (
        "llama",
        {"config": {"architectures": ["GraniteForCausalLM"]}},
        r"has no 'embedding_multiplier'",
    ),
    "llama config as CohereForCausalLM": (
        "llama",
        {"config": {"architectures": ["CohereForCausalLM"]}},
        r"has no 'layer_norm_eps'",
    ),
    "gemma 3 multimodal (not served)": (
        "gemma",
        {"config": {"architectures": ["Gemma3ForConditionalGeneration"]}},
        r"'Gemma3ForConditionalGeneration' is not supported",
    ),
    # transformers' Gemma 3 reads the field but never applies it: ambiguous, refused
    "gemma3 attn_logit_softcapping": (
        "gemma3",
        {"config": {"attn_logit_softcapping": 50.0}},
        r"Gemma3ForCausalLM: attn_logit_softcapping=50.0 is not supported",
    ),
    "olmoe clip_qkv": (
        "olmoe",
        {"config": {"clip_qkv": 8.0}},
        r"OlmoeForCausalLM: clip_qkv=8.0 is not supported",
    ),
    "qwen3_moe more experts per token than experts": (
        "qwen3_moe",
        {"config": {"num_experts_per_tok": 9}},
        r"Qwen3MoeForCausalLM: num_experts_per_tok=9 must be in 1..num_experts=8",
    ),
    "qwen2_moe decoder_sparse_step=0": (
        "qwen2_moe",
        {"config": {"decoder_sparse_step": 0}},
        r"Qwen2MoeForCausalLM: .*decoder_sparse_step=0 .*must be >= 1",
    ),
    "gpt_oss quantized other than MXFP4": (
        "gpt_oss",
        {"config": {"quantization_config": {"quant_method": "gptq", "bits": 4}}},
        r"GptOssForCausalLM: quantization_config.quant_method='gptq' is not supported",
    ),
    "gpt_oss more experts per token than experts": (
        "gpt_oss",
        {"config": {"num_experts_per_tok": 9}},
        r"GptOssForCausalLM: num_experts_per_tok=9 must be in 1..num_experts=8",
    ),
    "mixtral no experts": (
        "mixtral",
        {"config": {"num_local_experts": 0}},
        r"MixtralForCausalLM: num_experts_per_tok=2 must be in 1..num_experts=0",
    ),
}

PROMPT = torch.randint(3, 384, (40,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.mark.parametrize("case", sorted(MATCHES))
def test_mutation_matches_transformers(case, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from sglite.model_executor.model_runner import ModelRunner

    arch, opts = MATCHES[case]
    path = tiny_model_dir(arch, **opts)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    driver = Driver(ModelRunner(path, device="cpu", max_total_tokens=256))
    logits = driver.extend([driver.new_seq()], [PROMPT], return_all_logits=True)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_mutation_is_refused_at_start_up_naming_the_field(case, tmp_path):
    from sglite.model_executor.model_runner import ModelRunner

    arch, opts, message = REFUSED[case]
    tiny_config(arch, **opts).save_pretrained(tmp_path)  # no weights: refused before them
    with pytest.raises(ValueError, match=message):
        ModelRunner(tmp_path, device="cpu", max_total_tokens=256)
