"""DecoderForCausalLM: the skeleton as a causal LM, and how checkpoint tensors reach it.

A family subclasses it with a `decoder_spec(fields) -> DecoderSpec` classmethod (what its
config means, sglite.models.decoder_spec) and, where its checkpoint names differ from ours
(see sglite.models.decoder), `renames`: checkpoint name component -> ours, applied to each
dot-separated part at once (so renames may swap names). Separate q/k/v and gate/up tensors
load into their shards of the merged parameters; a fused tensor (Phi-3's `qkv_proj`,
`gate_up_proj`) loads whole, split by the layer's loader. `checkpoint_targets` is the hook for
anything else (GPT-NeoX's per-head QKV, StableLM's per-head norms). Every parameter must be
filled and every checkpoint tensor placed, else loading fails naming them.

Checked at construction, before any weight is read: the spec (activation, layout), the RoPE
type and whether this family rotates part of a head (`partial_rotary_factor`).

Hooks a family may override: `mlp_for_layer(b, layer_id)` (each layer's MLP: dense, or another
kind for some layers) and, through the spec, the attention (`spec.mla`: latent attention,
sglite.models.decoder_mla). `kv_layout()` tells the runner what the KV pool stores per token
(sglite.mem_cache.memory_pool: per-head K/V, or MLA's latent rows).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from sglite.distributed import NULL_TP_GROUP, TPGroup
from sglite.layers.linear import loader_of
from sglite.layers.logits_processor import LogitsProcessor
from sglite.layers.moe.block import SparseMoeBlock
from sglite.layers.rope_scaling import check_rope_type
from sglite.layers.vocab_parallel_embedding import ParallelLMHead
from sglite.mem_cache.memory_pool import MHALayout
from sglite.mem_cache.mla_pool import MLALayout
from sglite.model_executor.forward_batch import ForwardBatch
from sglite.models.decoder import Build, DecoderAttention, DecoderModel, dense_mlp
from sglite.models.decoder_mla import DecoderMLAttention
from sglite.models.decoder_spec import ConfigFields, DecoderSpec
from sglite.models.model_config import ModelConfig

# Checkpoint names merged into one of our parameters: (ours, theirs, shard id).
STACKED_QKV = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
)
STACKED_GATE_UP = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))


def _check(config: ModelConfig, spec: DecoderSpec) -> None:
    arch = config.architecture
    if spec.rope_layers is not None and len(spec.rope_layers) != config.num_layers:
        raise ValueError(
            f"{arch}: no_rope_layers has {len(spec.rope_layers)} entries for "
            f"{config.num_layers} layers"
        )
    ropes = [config.rope_for(i).scaling for i in range(config.num_layers)]
    for scaling in [config.rope_scaling, *ropes]:
        try:
            rope_type = check_rope_type(scaling)
        except ValueError as e:
            raise ValueError(f"{arch}: {e}") from None
        partial = config.partial_rotary_factor
        if partial != 1.0 and spec.rotary_factor == 1.0 and rope_type != "default":
            raise ValueError(
                f"{arch}: partial_rotary_factor={partial} is not supported: {arch} rotates "
                "the whole head"
            )


def _check_ep(config: ModelConfig, spec: DecoderSpec, tp_size: int, ep_size: int) -> None:
    if ep_size == 1:
        return
    arch, moe = config.architecture, spec.moe
    if moe is None:
        raise ValueError(f"--ep-size {ep_size}: {arch} has no mixture-of-experts layers")
    if ep_size < 1 or tp_size % ep_size:
        raise ValueError(f"--ep-size {ep_size}: must divide --tp-size {tp_size}")
    num, size, inner = moe.experts.num_experts, moe.experts.intermediate_size, tp_size // ep_size
    if num % ep_size:
        raise ValueError(f"--ep-size {ep_size}: does not divide {arch}'s {num} experts")
    if size % inner:
        raise ValueError(
            f"--ep-size {ep_size}: {arch}'s experts are {size} wide, which the --tp-size "
            f"{tp_size} / --ep-size {ep_size} = {inner} ranks of each expert group cannot split"
        )


class DecoderForCausalLM(nn.Module):
    renames: ClassVar[dict[str, str]] = {}
    # checkpoint tensors that are not weights (buffers some checkpoints carry)
    skipped_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)

    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        raise NotImplementedError

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | None = None,
        tp_group: TPGroup = NULL_TP_GROUP,
        ep_size: int = 1,
        packed: bool = False,
        packed_embedding: bool | None = None,
    ) -> None:
        """With `tp_group` of size > 1 the model holds this rank's shard (see layers.linear);
        with `ep_size` > 1 (dividing it) 1/ep_size of each MoE layer's experts. `packed`: the
        linear layers, embeddings and LM head hold GGUF blocks (loaded as `PackedRows` by
        `load_weights`; see sglite.models.gguf.weights); `packed_embedding` False keeps the
        embedding and LM head float in a packed model (sglite.models.quant_checkpoint)."""
        super().__init__()
        spec = self.decoder_spec(ConfigFields(config))
        _check(config, spec)
        _check_ep(config, spec, tp_group.size, ep_size)
        self.config, self.spec = config, spec
        attention_cls = DecoderAttention if spec.mla is None else DecoderMLAttention
        build = Build(
            config, spec, dtype, device, tp_group, ep_size=ep_size, packed=packed,
            packed_embedding=packed_embedding,
        )  # fmt: skip
        self.model = DecoderModel(build, attention_cls, self.mlp_for_layer)
        head_cls = ParallelLMHead
        if build.is_embedding_packed:
            from sglite.layers.quant_embedding import QuantParallelLMHead as head_cls
        self.lm_head = head_cls(
            config.vocab_size,
            config.hidden_size,
            bias=spec.lm_head_bias,
            dtype=dtype,
            device=device,
            tp_group=tp_group,
        )
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(spec.logit_scale, spec.final_logit_softcap)
        qkv = STACKED_QKV if spec.mla is None else ()  # MLA's q_proj is a plain projection
        self.stacked = qkv + (STACKED_GATE_UP if spec.gated_mlp else ())

    @classmethod
    def packed_unsupported(cls, config: ModelConfig) -> str | None:
        """Why this model cannot hold GGUF blocks packed (`packed=True`), or None."""
        spec = cls.decoder_spec(ConfigFields(config))
        if spec.moe is not None:
            return "its mixture-of-experts layers have no packed form"
        if spec.mla is not None:
            return "its latent attention (MLA) has no packed form"
        if cls.mlp_for_layer is not DecoderForCausalLM.mlp_for_layer:
            return "its MLP layers have no packed form"
        return None

    def mlp_for_layer(self, b: Build, layer_id: int) -> nn.Module:
        """Layer `layer_id`'s MLP: the MoE block on a sparse layer of a spec with `moe`
        (sglite.layers.moe), else dense (unless a family says otherwise)."""
        moe = b.spec.moe
        if moe is not None and moe.is_sparse(layer_id):
            return SparseMoeBlock(moe, b.config.hidden_size, **b.kw, ep_size=b.ep_size)
        return dense_mlp(b, layer_id)

    def skips_tensor(self, name: str) -> bool:
        """Whether checkpoint tensor `name` has no place on this rank (so is never read)."""
        return False

    def kv_layout(self) -> MHALayout | MLALayout:
        """What the KV pool stores per token for this model (this rank's share)."""
        cfg, mla = self.config, self.spec.mla
        if mla is not None:
            return MLALayout(
                cfg.num_layers, mla.kv_lora_rank, mla.qk_rope_head_dim, cfg.num_heads,
                mla.qk_head_dim, mla.v_head_dim,
            )  # fmt: skip
        attn = self.model.layers[0].self_attn
        return MHALayout(cfg.num_layers, attn.num_kv_heads, attn.head_dim)

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """float32 logits: `[B, vocab]`, or `[T, vocab]` with `batch.return_all_logits`."""
        hidden = self.model(input_ids, positions, batch)
        return self.logits_processor(hidden, self.lm_head, batch)

    def checkpoint_targets(
        self, name: str, tensor: torch.Tensor
    ) -> list[tuple[str, str | int | None, torch.Tensor]]:
        """(our parameter, shard id, tensor) for one checkpoint tensor."""
        name = ".".join(self.renames.get(part, part) for part in name.split("."))
        for ours, theirs, shard_id in self.stacked:
            if f".{theirs}." in name:
                return [(name.replace(f".{theirs}.", f".{ours}."), shard_id, tensor)]
        return [(name, None, tensor)]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint tensors by HF name; unknown or missing tensors are an error."""
        params = dict(self.named_parameters(remove_duplicate=False))
        # packed layers take their weights whole (`load_packed`), not as parameters
        packed = {
            f"{name}.weight": m for name, m in self.named_modules() if hasattr(m, "load_packed")
        }
        loaded: dict[str, set] = defaultdict(set)
        tied = self.config.tie_word_embeddings
        for name, tensor in weights:
            if name.endswith(self.skipped_suffixes):
                continue
            for target, shard_id, part in self.checkpoint_targets(name, tensor):
                if tied and target == "lm_head.weight":
                    continue
                if target in packed:
                    packed[target].load_packed(part, shard_id)
                    loaded[target].add(shard_id)
                    continue
                param = params.get(target)
                if param is None:
                    raise ValueError(
                        f"checkpoint tensor {name!r} has no place in {type(self).__name__}; "
                        "is the architecture in config.json right?"
                    )
                loader_of(param)(param, part, shard_id)
                loaded[target].add(shard_id)
        missing = [
            self._checkpoint_name(name, shard_id)
            for name, param in self.named_parameters()
            if None not in loaded[name]
            for shard_id in getattr(param, "shard_ids", (None,))
            if shard_id not in loaded[name]
        ]
        missing += [
            self._checkpoint_name(name, None)
            for name, m in packed.items()
            if not (m.is_loaded if hasattr(m, "is_loaded") else m.packed.is_complete)
        ]
        if missing:
            raise ValueError(
                f"checkpoint lacks {len(missing)} tensor(s) of {type(self).__name__}, e.g. "
                + ", ".join(missing[:5])
            )

    def _checkpoint_name(self, name: str, shard_id: str | int | None) -> str:
        """The checkpoint's name for our parameter (or one shard of it), for messages."""
        for ours, theirs, sid in self.stacked:
            if sid == shard_id and f".{ours}." in name:
                name, shard_id = name.replace(f".{ours}.", f".{theirs}."), None
                break
        theirs = {ours: theirs for theirs, ours in reversed(self.renames.items())}
        name = ".".join(theirs.get(part, part) for part in name.split("."))
        return name if shard_id is None else f"{name} (shard {shard_id})"

    def prepack(self) -> int:
        """CPU: pack linear weights for oneDNN (see layers.linear). Returns how many packed."""
        return sum(
            1 for m in self.modules() if hasattr(m, "prepack") and m is not self and m.prepack()
        )
