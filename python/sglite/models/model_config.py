"""ModelConfig: the architecture facts sglite needs, read once from an HF folder's config.

Reads `config.json` through transformers' AutoConfig and accepts both config generations:
transformers 4.x (`rope_theta`, `rope_scaling` and `partial_rotary_factor` at the top level)
and 5.x (inside `rope_parameters`; for models whose layer types rotate differently, one
dict per layer type there: `rope_by_layer_type`). EOS ids are the union of the config's and
`generation_config.json`'s. These are the fields every decoder has (a missing one is a named
error); what only some families have (norm epsilon and kind, biases, multipliers, ...) each
family reads from `hf_config` into its DecoderSpec (sglite.models.decoder_spec).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RopeParams:
    """One rotary table's parameters: the base and the `rope_scaling` dict (None: default)."""

    theta: float
    scaling: dict[str, Any] | None = None


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _one_rope(params: dict[str, Any], hf: Any) -> tuple[float, dict[str, Any] | None, float | None]:
    """(theta, scaling dict or None, partial_rotary_factor or None) of one rope dict; what the
    dict lacks comes from the config's top level (the 4.x form)."""
    params = dict(params)
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = getattr(hf, "rope_theta", None)
    partial = params.pop("partial_rotary_factor", None)
    if partial is None:
        partial = getattr(hf, "partial_rotary_factor", None)
    rope_type = params.get("rope_type", params.get("type", "default"))
    scaling = params if rope_type != "default" else None
    theta = float(theta if theta is not None else 10000.0)
    return theta, scaling, None if partial is None else float(partial)


def _is_per_layer_type(params: dict[str, Any]) -> bool:
    """transformers 5's form for models whose layer types rotate differently (Gemma 3):
    `rope_parameters = {"sliding_attention": {...}, "full_attention": {...}}`."""
    return bool(params) and all(isinstance(v, dict) for v in params.values())


def _rope(hf: Any) -> tuple[float, dict[str, Any] | None, float, dict[str, RopeParams]]:
    """(rope_theta, scaling dict or None, partial_rotary_factor, per-layer-type ropes) from
    either config form. With per-layer-type ropes, the first three are the full-attention
    layers' (else the first type's)."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    legacy = getattr(hf, "rope_scaling", None)
    if not params and legacy:
        params = dict(legacy)
    if not _is_per_layer_type(params):
        theta, scaling, partial = _one_rope(params, hf)
        return theta, scaling, 1.0 if partial is None else partial, {}
    ropes = {kind: _one_rope(p, hf) for kind, p in params.items()}
    partials = {p for _, _, p in ropes.values()}
    if len(partials) > 1:
        raise ValueError(
            f"rope_parameters give the layer types different partial_rotary_factor values "
            f"({sorted(map(str, partials))}); sglite rotates one share of every head"
        )
    main = ropes.get("full_attention", next(iter(ropes.values())))
    by_type = {kind: RopeParams(theta, scaling) for kind, (theta, scaling, _) in ropes.items()}
    partial = partials.pop()
    return main[0], main[1], 1.0 if partial is None else partial, by_type


def _required(hf: Any, name: str) -> Any:
    """A field every decoder config has; its absence is a named error, not an AttributeError."""
    value = getattr(hf, name, None)
    if value is None:
        arch = (getattr(hf, "architectures", None) or ["?"])[0]
        raise ValueError(
            f"config.json of {arch} ({type(hf).__name__}) has no {name!r}; sglite needs it to "
            "build the model"
        )
    return value


def _layer_sliding_windows(hf: Any, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), as transformers attends it.

    A config class that declares `layer_types` (Qwen2/3, Gemma 2/3, ...) names each layer
    "sliding_attention" (window `sliding_window`) or "full_attention"; one that does not
    (Mistral) gives every layer its `sliding_window`, or, with `max_window_layers` (older
    Qwen2 configs), the layers from that index on. `use_sliding_window: false` turns every
    window off."""
    window = getattr(hf, "sliding_window", None)
    if getattr(hf, "use_bidirectional_attention", False):
        raise ValueError(
            "use_bidirectional_attention=True (a bidirectional encoder, e.g. EmbeddingGemma) "
            "is not supported: sglite serves causal language models"
        )
    if not window or getattr(hf, "use_sliding_window", True) is False:
        return (None,) * num_layers
    window = int(window)
    layer_types = getattr(hf, "layer_types", None) if hasattr(type(hf), "layer_types") else None
    if layer_types is None:
        first = int(getattr(hf, "max_window_layers", None) or 0)
        return tuple(window if i >= first else None for i in range(num_layers))
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    kinds = {"sliding_attention": window, "full_attention": None}
    unknown = sorted(set(layer_types) - set(kinds))
    if unknown:
        raise ValueError(
            f"layer_types {unknown} are not supported (sglite attends "
            "sliding_attention and full_attention layers)"
        )
    return tuple(kinds[t] for t in layer_types)


def _layer_types(hf: Any, num_layers: int, rope_by_type: dict[str, RopeParams]) -> tuple[str, ...]:
    """The config's `layer_types` (empty when its class declares none); every type must have
    its rope when the ropes are given per layer type."""
    declared = getattr(hf, "layer_types", None) if hasattr(type(hf), "layer_types") else None
    if not rope_by_type:
        return tuple(declared) if declared is not None and len(declared) == num_layers else ()
    if declared is None or len(declared) != num_layers:
        raise ValueError(
            f"rope_parameters are given per layer type ({', '.join(rope_by_type)}), but "
            f"layer_types names {0 if declared is None else len(declared)} layers of "
            f"{num_layers}"
        )
    missing = sorted(set(declared) - set(rope_by_type))
    if missing:
        raise ValueError(f"rope_parameters have no entry for the layer types {missing}")
    return tuple(declared)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_act: str | None
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    # the context sglite serves (the runner may lower or raise it) and the model's own
    context_length: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str | None
    # One per layer: its sliding window, None for full attention (empty: none anywhere).
    layer_sliding_windows: tuple[int | None, ...] = ()
    partial_rotary_factor: float = 1.0
    # One per layer when the config names them (sliding_attention, full_attention, ...).
    layer_types: tuple[str, ...] = ()
    # layer type -> its rotary table's parameters, when they differ by type (Gemma 3's local
    # base on sliding layers, rope_scaling on global ones); empty: rope_theta / rope_scaling
    # for every layer.
    rope_by_layer_type: dict[str, RopeParams] = field(default_factory=dict)
    # the transformers config: each model family reads the fields only it has from here
    hf_config: Any = field(default=None, repr=False, compare=False)

    def sliding_window_for(self, layer_id: int) -> int | None:
        """Layer `layer_id`'s sliding window (None: full attention)."""
        return self.layer_sliding_windows[layer_id] if self.layer_sliding_windows else None

    def rope_for(self, layer_id: int) -> RopeParams:
        """The rotary table layer `layer_id` reads (if the family's layer rotates at all)."""
        if self.rope_by_layer_type:
            return self.rope_by_layer_type[self.layer_types[layer_id]]
        return RopeParams(self.rope_theta, self.rope_scaling)

    @classmethod
    def from_pretrained(
        cls, model_path: str | Path, trust_remote_code: bool = False
    ) -> ModelConfig:
        from transformers import AutoConfig

        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{path} has no config.json; pass a Hugging Face model folder "
                "(config.json, *.safetensors, tokenizer files)"
            )
        hf = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        return cls.from_hf(hf, path)

    @classmethod
    def from_hf(cls, hf: Any, path: Path | None = None) -> ModelConfig:
        archs = getattr(hf, "architectures", None) or []
        if not archs:
            raise ValueError(f"config of {path} names no architectures; cannot pick a model class")
        hidden, num_heads = _required(hf, "hidden_size"), _required(hf, "num_attention_heads")
        head_dim = getattr(hf, "head_dim", None) or hidden // num_heads
        theta, scaling, partial, rope_by_type = _rope(hf)
        eos = list(_as_ids(getattr(hf, "eos_token_id", None)))
        if path is not None and (path / "generation_config.json").is_file():
            gen = json.loads((path / "generation_config.json").read_text())
            eos += [t for t in _as_ids(gen.get("eos_token_id")) if t not in eos]
        dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
        max_positions = int(getattr(hf, "max_position_embeddings", None) or 2048)
        num_layers = _required(hf, "num_hidden_layers")
        return cls(
            architecture=archs[0],
            model_type=getattr(hf, "model_type", ""),
            hidden_size=hidden,
            intermediate_size=_required(hf, "intermediate_size"),
            vocab_size=_required(hf, "vocab_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            hidden_act=getattr(hf, "hidden_act", None),
            rope_theta=theta,
            rope_scaling=scaling,
            context_length=max_positions,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            eos_token_ids=tuple(eos),
            bos_token_id=getattr(hf, "bos_token_id", None),
            torch_dtype=str(dtype).removeprefix("torch.") if dtype is not None else None,
            layer_sliding_windows=_layer_sliding_windows(hf, num_layers),
            partial_rotary_factor=partial,
            layer_types=_layer_types(hf, num_layers, rope_by_type),
            rope_by_layer_type=rope_by_type,
            hf_config=hf,
        )
