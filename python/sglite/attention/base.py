"""The attention backend interface: how RadixAttention turns q/k/v into attention output.

Contract
- Construction: `Backend(runner)` with the `ModelRunner` (for its pools, model config,
  device and dtype). One backend instance serves every layer.
- `init_forward_metadata(batch)` is called once per forward, before the first layer. It
  builds whatever the layers share (slot index lists, masks, kernel metadata) from the
  batch's lengths and `req_to_token` rows and keeps it on the backend until the next call.
  It must not write the KV pool.
- For each layer, `RadixAttention` first calls `save_kv(layer, batch, k, v)` (default:
  `batch.kv_pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)`; a backend may override
  it with a fused store kernel), then `forward(q, k, v, layer, batch)`. So when `forward`
  runs, this step's K/V are already in the pool at `out_cache_loc` and the rows of
  `req_to_token` cover positions 0 .. seq_len-1 of every request.
- Shapes: q `[T, num_heads, head_dim]`, k `[T, num_kv_heads, head_dim]` and v `[T,
  num_kv_heads, v_head_dim]` (this step's new tokens only, T = batch.num_tokens),
  `num_heads % num_kv_heads == 0` (GQA: query head h reads KV head h // (num_heads //
  num_kv_heads)). Returns `[T, num_heads, v_head_dim]` in q's dtype. Softmax scale is
  `layer.scaling`. `layer.v_head_dim` is `head_dim` except in MLA's absorbed decode
  (sglite.layers.latent_attention), whose pool keeps the values inside the keys
  (`pool.values_in_keys`: `v_buffer[l]` is a view of the first v_head_dim dims of
  `k_buffer[l]`, and storing k stores v); backends must decode such layers. MLA's prefill
  does not go through `forward_extend` (it is torch over the gathered latents).
- Extend/mixed: token t of request i (position p = prefix_len_i + t) attends to positions
  0..p of request i (its cached prefix, then causally within the new tokens). Decode: the
  single new token attends to positions 0..seq_len-1.
- `forward` must not change `batch` or the pools (other than what `save_kv` wrote).
- Per-layer variations (see `sglite.layers.radix_attention`): `layer.sliding_window` W
  narrows the keys of position p to p - W < j <= p; `layer.logit_cap` caps the scores;
  `layer.sinks` adds one logit per query head to the softmax's denominator. A backend lists
  the ones it computes in `features`; the base constructor refuses a model whose layers use
  any other (a clear ValueError, never a silently different result).

CUDA graph hooks (optional; `supports_cuda_graph` says whether a backend has them). Decode
runs inside a captured graph only on backends that implement all three; the others run it
eagerly. The `CudaGraphRunner` (model_executor/cuda_graph_runner.py) calls, in order:
- `init_cuda_graph_state(max_bs)` once: allocate fixed-size metadata buffers for decode
  batches of up to `max_bs` requests of up to the context length (`req_to_token`'s width).
- `init_forward_metadata_capture(batch)` per captured batch size: bind the metadata of a
  decode batch of `batch.batch_size` rows to views of those buffers (the graph keeps their
  addresses) and fill them, like `init_forward_metadata_replay(batch, batch.batch_size)`.
- `init_forward_metadata_replay(batch, num_real)` before each replay: refill the same
  buffers in place, outside the graph, from `batch`'s device tensors. `batch` is the
  runner's static, padded batch: its first `num_real` rows are real, the others padding
  (request row 0, KV slot 0, seq_len 1). Its `seq_lens_cpu` are placeholders: read only
  the device tensors, and never synchronize with the device.
Under capture, `save_kv` and `forward_decode` must reach the metadata only through those
buffers and must not synchronize: the graph replays exactly the kernels they launched.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglite.layers.radix_attention import RadixAttention
    from sglite.model_executor.forward_batch import ForwardBatch
    from sglite.model_executor.model_runner import ModelRunner


def layer_features(layer: RadixAttention) -> set[str]:
    """The variations of plain causal softmax attention that `layer` uses."""
    used = set()
    if layer.sliding_window is not None:
        used.add("sliding_window")
    if layer.logit_cap:
        used.add("logit_cap")
    if layer.sinks is not None:
        used.add("sinks")
    return used


class AttentionBackend(ABC):
    """Paged attention over the KV pool. See the module docstring for the contract."""

    # The per-layer variations this backend computes (see the module docstring).
    features: frozenset[str] = frozenset()

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.check_layers(getattr(runner, "model", None))

    def check_layers(self, model) -> None:
        """Refuse a model with a layer this backend cannot compute exactly."""
        from sglite.layers.radix_attention import RadixAttention

        if model is None:
            return
        for module in model.modules():
            if isinstance(module, RadixAttention):
                missing = layer_features(module) - self.features
                if missing:
                    raise ValueError(
                        f"attention backend {type(self).__name__} cannot compute "
                        f"{', '.join(sorted(missing))} (layer {module.layer_id}); "
                        "use --attention-backend torch_native"
                    )

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Prepare the per-forward metadata every layer of this batch shares."""

    def save_kv(
        self, layer: RadixAttention, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store this step's K/V at `batch.out_cache_loc`."""
        batch.kv_pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        if batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, batch)
        return self.forward_extend(q, k, v, layer, batch)

    @abstractmethod
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """Extend and mixed batches."""

    @abstractmethod
    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """Decode batches (one new token per request)."""

    # ---------------------------------------------------------------- CUDA graph hooks
    supports_cuda_graph: bool = False

    def init_cuda_graph_state(self, max_bs: int) -> None:
        """Allocate the fixed-size decode metadata buffers (see the module docstring)."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        """Bind the decode metadata to the fixed buffers for capture, and fill them."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_replay(self, batch: ForwardBatch, num_real: int) -> None:
        """Refill the fixed buffers in place before a replay of `batch.batch_size` rows."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")
