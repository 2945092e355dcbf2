"""GGUF metadata -> transformers `config.json` (in the Hub's form) and `generation_config.json`.

A GGUF has no config: its `{arch}.*` metadata keys are the config, and some facts are not
stored at all because llama.cpp hard-codes them per architecture; those are filled in with
llama.cpp's values, so the folder computes what llama.cpp computes:

- Gemma 2 / 3: the query scale (`query_pre_attn_scalar`) is the head size, except for the
  27B models (46 / 62 layers), where it is hidden_size / heads, unless the file states
  `{arch}.attention.scale`; the sliding-window layer pattern is every other layer (Gemma 2)
  or 5 local : 1 global (Gemma 3) unless `attention.sliding_window_pattern` says; Gemma 3's
  local RoPE base is 10000 unless `rope.freq_base_swa` says. Activation: gelu (tanh).
- Phi-3: the longrope factors are the `rope_factors_long/short` tensors; partial rotary is
  `rope.dimension_count / head_dim`.
- Qwen2-MoE / Qwen3-MoE: `expert_count`, `expert_used_count`, `expert_feed_forward_length`
  (and Qwen2-MoE's `expert_shared_feed_forward_length`); every layer sparse, as llama.cpp
  builds them; the top-k weights renormalised for qwen3moe and not for qwen2moe (llama.cpp's
  fixed choice per architecture; `expert_weights_norm`, when stated, must agree).
- llama 3: `rope_freqs` holds the per-frequency divisors of llama3 RoPE scaling; the
  parameters (factor, low/high frequency factors) are recovered from it and checked by
  recomputing every divisor.

A metadata key that changes the math and that this mapping does not implement is refused
(`UnsupportedGGUF` naming the key), never dropped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from sglite.models.gguf.archs import ArchMapping, uniform_count
from sglite.models.gguf.moe_config import MOE_ARCHS, qwen_moe_config
from sglite.models.gguf.reader import GGUFFile, UnsupportedGGUF

# {arch}.* keys that change the model's math; each must be consumed by the arch's builder
_MATH_KEYS = (
    "logit_scale",
    "embedding_scale",
    "residual_scale",
    "attention.scale",
    "attention.clamp_kqv",
    "attention.max_alibi_bias",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "use_parallel_residual",
    "attention.sliding_window_pattern",
    "rope.freq_base_swa",
    "attention.causal",
    "expert_weights_norm",
    "expert_weights_scale",
    "expert_gating_func",
    "expert_group_count",
    "expert_shared_count",
)
_HARMLESS = {
    "attention.causal": True,
    "expert_weights_scale": 1.0,
    "expert_group_count": 0,
}  # values of _MATH_KEYS that change nothing
_GELU_TANH = "gelu_pytorch_tanh"
_END_OF_TURN = ("<end_of_turn>", "<|im_end|>", "<|end|>", "<|eot_id|>", "<|eom_id|>")


def hf_config(gguf: GGUFFile, mapping: ArchMapping) -> dict[str, Any]:
    """The config.json dict for the converted folder."""
    experts = gguf.arch_get("expert_count", 0)
    if experts and mapping.gguf_arch not in MOE_ARCHS:
        raise UnsupportedGGUF(
            f"{gguf.path.name}: a mixture-of-experts GGUF ({gguf.arch}.expert_count = "
            f"{experts}); sglite converts dense models only"
        )
    consumed: set[str] = set()
    config = _common(gguf, mapping)
    config.update(_EXTRAS[mapping.gguf_arch](gguf, config, consumed))
    for key in _MATH_KEYS:
        if key not in consumed and gguf.has(f"{gguf.arch}.{key}"):
            value = gguf.arch_get(key)
            if _HARMLESS.get(key, object()) == value:
                continue
            raise UnsupportedGGUF(
                f"{gguf.path.name}: metadata {gguf.arch}.{key} = {value!r} changes the model's "
                f"math and is not supported for GGUF architecture {gguf.arch}"
            )
    return config


def generation_config(gguf: GGUFFile, template: str | None) -> dict[str, Any]:
    """bos and the ids that end generation: eos, eot/eom when the file names them, and the
    end-of-turn tokens its chat template writes (llama.cpp stops at those too)."""
    eos = [gguf.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    if template:
        tokens = gguf.get("tokenizer.ggml.tokens") or []
        eos += [i for i, t in enumerate(tokens) if t in _END_OF_TURN and t in template]
    ids = list(dict.fromkeys(i for i in eos if i is not None))
    return {
        "bos_token_id": gguf.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": ids[0] if len(ids) == 1 else ids or None,
    }


def _common(gguf: GGUFFile, mapping: ArchMapping) -> dict[str, Any]:
    get = gguf.arch_get
    if "token_embd.weight" not in gguf.tensors:
        raise UnsupportedGGUF(f"{gguf.path.name}: the file has no token_embd.weight tensor")
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    value_dim = int(get("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise UnsupportedGGUF(
            f"{gguf.path.name}: value head size {value_dim} != key head size {head_dim}"
        )
    config: dict[str, Any] = {
        "architectures": [mapping.hf_architecture],
        "model_type": mapping.model_type,
        "hidden_size": hidden,
        "intermediate_size": uniform_count(gguf, "feed_forward_length"),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": uniform_count(gguf, "attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": int(get("context_length", 2048)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "vocab_size": gguf.rows("token_embd.weight"),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "hidden_act": "silu",
        "bos_token_id": gguf.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": gguf.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    if gguf.has(f"{gguf.arch}.attention.layer_norm_rms_epsilon"):
        config["rms_norm_eps"] = _f32(get("attention.layer_norm_rms_epsilon"))
    scaling = _rope_scaling(gguf)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _f32(value: float) -> float:
    """A float32 from the file as the decimal the HF config had (9.99999997e-07 -> 1e-06)."""
    return float(f"{value:.7g}")


def _rope_scaling(gguf: GGUFFile) -> dict[str, Any] | None:
    kind = gguf.arch_get("rope.scaling.type", "none")
    factor = float(gguf.arch_get("rope.scaling.factor", 1.0))
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        out = {"rope_type": "yarn", "factor": factor}
        orig = gguf.arch_get("rope.scaling.original_context_length", None)
        if orig is not None:
            out["original_max_position_embeddings"] = int(orig)
        for key in ("beta_fast", "beta_slow"):
            value = gguf.arch_get(f"rope.scaling.yarn_{key}", None)
            if value is not None:
                out[key] = float(value)
        return out
    raise UnsupportedGGUF(
        f"{gguf.path.name}: {gguf.arch}.rope.scaling.type {kind!r} is not supported "
        "(none, linear, yarn)"
    )


def _full_rotary(gguf: GGUFFile, config: dict[str, Any]) -> None:
    rot = gguf.arch_get("rope.dimension_count", config["head_dim"])
    if int(rot) != config["head_dim"]:
        raise UnsupportedGGUF(
            f"{gguf.path.name}: {gguf.arch}.rope.dimension_count {rot} != head size "
            f"{config['head_dim']}: partial rotary is not supported for {gguf.arch}"
        )


def _has(gguf: GGUFFile, block_tensor: str) -> bool:
    return f"blk.0.{block_tensor}" in gguf.tensors


# ---------------------------------------------------------------------- per architecture
Extras = Callable[[GGUFFile, dict[str, Any], set[str]], dict[str, Any]]


def _llama(gguf: GGUFFile, config: dict[str, Any], consumed: set[str]) -> dict[str, Any]:
    _full_rotary(gguf, config)
    out: dict[str, Any] = {
        "attention_bias": _has(gguf, "attn_q.bias"),
        "mlp_bias": _has(gguf, "ffn_gate.bias"),
    }
    if "rope_freqs.weight" in gguf.tensors:
        if "rope_scaling" in config:
            raise UnsupportedGGUF(f"{gguf.path.name}: both rope_freqs and rope.scaling.type")
        scaling = llama3_rope_scaling(gguf, config)
        if scaling is not None:
            out["rope_scaling"] = scaling
    if gguf.arch == "mistral":
        consumed.add("attention.sliding_window")
        out["sliding_window"] = gguf.arch_get("attention.sliding_window", None)
    return out


def _qwen2(gguf: GGUFFile, config: dict[str, Any], consumed: set[str]) -> dict[str, Any]:
    _full_rotary(gguf, config)
    if not _has(gguf, "attn_q.bias"):
        raise UnsupportedGGUF(f"{gguf.path.name}: a qwen2 GGUF without Q/K/V biases")
    return {"use_sliding_window": False, "sliding_window": None}


def _qwen3(gguf: GGUFFile, config: dict[str, Any], consumed: set[str]) -> dict[str, Any]:
    _full_rotary(gguf, config)
    return {
        "attention_bias": _has(gguf, "attn_q.bias"),
        "use_sliding_window": False,
        "sliding_window": None,
    }


def _gemma(gguf: GGUFFile, config: dict[str, Any], consumed: set[str]) -> dict[str, Any]:
    _full_rotary(gguf, config)
    return {"hidden_act": _GELU_TANH, "hidden_activation": _GELU_TANH}


def _gemma2(gguf: GGUFFile, config: dict[str, Any], consumed: set[str]) -> dict[str, Any]:
    return _gemma_windowed(gguf, config, consumed, pattern=2, big_layers=46)


def _gemma3(gguf: GGUFFile, config: dict[str, Any], consumed: set[str]) -> dict[str, Any]:
    out = _gemma_windowed(gguf, config, consumed, pattern=6, big_layers=62)
    consumed.add("rope.freq_base_swa")
    out["rope_local_base_freq"] = float(gguf.arch_get("rope.freq_base_swa", 10000.0))
    return out


def _gemma_windowed(
    gguf: GGUFFile, config: dict[str, Any], consumed: set[str], pattern: int, big_layers: int
) -> dict[str, Any]:
    _full_rotary(gguf, config)
    get = gguf.arch_get
    consumed.update(
        ("attention.scale", "attention.sliding_window_pattern", "attn_logit_softcapping",
         "final_logit_softcapping")
    )  # fmt: skip
    layers, head_dim = config["num_hidden_layers"], config["head_dim"]
    scale = get("attention.scale", None)
    if scale is not None:
        scalar = _f32(1.0 / float(scale) ** 2)
    elif layers == big_layers:  # llama.cpp's 27B rule
        scalar = config["hidden_size"] // config["num_attention_heads"]
    else:
        scalar = head_dim
    swa = get("attention.sliding_window_pattern", pattern)
    if isinstance(swa, list):  # one flag per layer: True = sliding
        kinds = ["sliding_attention" if s else "full_attention" for s in swa]
    else:
        kinds = [
            "sliding_attention" if (i + 1) % int(swa) else "full_attention" for i in range(layers)
        ]
    soft = {k: get(k, None) for k in ("attn_logit_softcapping", "final_logit_softcapping")}
    return {
        "hidden_act": _GELU_TANH,
        "hidden_activation": _GELU_TANH,
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(get("attention.sliding_window")),
        "layer_types": kinds,
        **{k: (float(v) if v is not None else None) for k, v in soft.items()},
    }


def _phi3(gguf: GGUFFile, config: dict[str, Any], consumed: set[str]) -> dict[str, Any]:
    get = gguf.arch_get
    consumed.add("attention.sliding_window")
    rot = int(get("rope.dimension_count", config["head_dim"]))
    out: dict[str, Any] = {
        "sliding_window": get("attention.sliding_window", None),
        "original_max_position_embeddings": int(
            get("rope.scaling.original_context_length", config["max_position_embeddings"])
        ),
    }
    if rot != config["head_dim"]:
        out["partial_rotary_factor"] = rot / config["head_dim"]
    if "rope_factors_long.weight" in gguf.tensors:
        out["rope_scaling"] = {
            "type": "longrope",
            "long_factor": gguf.dequantize("rope_factors_long.weight").tolist(),
            "short_factor": gguf.dequantize("rope_factors_short.weight").tolist(),
        }
        attn = get("rope.scaling.attn_factor", None)
        orig = out["original_max_position_embeddings"]
        scale = config["max_position_embeddings"] / orig
        default = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
        if attn is not None and abs(attn - default) > 1e-6:  # else transformers' own value
            out["rope_scaling"]["attention_factor"] = _f32(attn)
    return out


def _starcoder2(gguf: GGUFFile, config: dict[str, Any], consumed: set[str]) -> dict[str, Any]:
    _full_rotary(gguf, config)
    return {
        "hidden_act": _GELU_TANH,
        "norm_epsilon": _f32(gguf.arch_get("attention.layer_norm_epsilon")),
        "use_bias": _has(gguf, "attn_q.bias"),
        "sliding_window": None,  # llama.cpp runs Starcoder2 without a window
    }


def _qwen_moe(gguf: GGUFFile, config: dict[str, Any], consumed: set[str]) -> dict[str, Any]:
    _full_rotary(gguf, config)
    return qwen_moe_config(gguf, config, consumed)


_EXTRAS: dict[str, Extras] = {
    "llama": _llama,
    "mistral": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "starcoder2": _starcoder2,
    "qwen2moe": _qwen_moe,
    "qwen3moe": _qwen_moe,
}


# ---------------------------------------------------------------------- llama 3 RoPE
def llama3_rope_divisors(
    theta: float, head_dim: int, factor: float, low: float, high: float, orig: int
) -> np.ndarray:
    """What llama3 RoPE scaling divides each inverse frequency by (1 at high frequencies,
    `factor` at low ones, a smooth blend between)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = np.clip((orig / wavelen - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1 - smooth) / factor + smooth)


def llama3_rope_scaling(gguf: GGUFFile, config: dict[str, Any]) -> dict[str, Any] | None:
    """Recover (factor, low_freq_factor, high_freq_factor) from `rope_freqs`.

    With x = 1 / wavelength, a frequency is divided by 1 where orig * x >= high, by
    `factor` where orig * x <= low, and blended with s = (orig * x - low) / (high - low)
    between. Every (orig, low, high) that gives the file's divisors at the model's own
    frequencies is the same model, so orig is 8192 (llama 3's; half the context when that is
    smaller) and low, high are solved
    from the blended frequencies (a line through two or more; llama 3's high = 4 * low
    through one; the region edges when none is blended), then checked by recomputing."""
    divisors = gguf.dequantize("rope_freqs.weight").astype(np.float64)
    theta, head_dim = config["rope_theta"], config["head_dim"]
    # transformers wants orig below the context; any value gives the same divisors
    ctx = config["max_position_embeddings"]
    factor, orig = float(divisors.max()), 8192 if ctx > 8192 else max(1, ctx // 2)
    if factor <= 1 + 1e-6:
        return None
    x = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim) / (2 * math.pi)
    ones, full = divisors <= 1 + 1e-6, divisors >= factor * (1 - 1e-6)
    blended = ~ones & ~full
    smooth = (1 / divisors - 1 / factor) / (1 - 1 / factor)  # the s of each frequency
    if len(divisors) != len(x):
        low = high = 0.0
    elif blended.sum() >= 2:
        slope, intercept = np.polyfit(x[blended], smooth[blended], 1)  # s = slope x + icpt
        span = orig / slope
        low = -intercept * span
        high = low + span
    elif blended.sum() == 1:
        low = orig * x[blended][0] / (3 * smooth[blended][0] + 1)
        high = 4 * low
    else:
        low = orig * x[full].max() if full.any() else 0.0
        high = orig * x[ones].min() if ones.any() else low + 1.0
    ok = 0 < low < high and len(divisors) == len(x)
    if not ok or not np.allclose(
        llama3_rope_divisors(theta, head_dim, factor, low, high, orig), divisors, rtol=1e-4
    ):
        raise UnsupportedGGUF(
            f"{gguf.path.name}: tensor rope_freqs is not llama3 RoPE scaling; "
            "other per-frequency RoPE factors are not supported"
        )
    return {
        "rope_type": "llama3",
        "factor": _f32(factor),
        "low_freq_factor": _f32(low),
        "high_freq_factor": _f32(high),
        "original_max_position_embeddings": orig,
    }
