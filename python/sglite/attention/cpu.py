"""The CPU attention backend: torch_native, with one-token rows computed by the native kernel.

Decode batches and the decode rows of mixed batches attend through
`sglite.attention.cpu_kernel` (rust/attn), which reads each row's K/V in place from the
pool (under a sliding window, only the row's last W keys; logit caps and sinks in the
kernel too; MLA's absorbed decode reads its values, the latents, from the key rows; bf16 and
fp8 pools are widened as they are read). torch_native gathers them into a padded copy in every layer instead, which on a
1,000-token context costs several times the decode step's matrix multiplications.

A request with several new tokens over a cached prefix, where the window hides nothing,
attends in two mask-free parts merged by their log-sum-exp: every new token sees the whole
prefix (one flash call, the query heads of a KV group stacked along the query axis, so no
K/V copy per query head), and the new tokens see each other causally; sinks join the merge's
denominator. torch_native builds a `[new, prefix + new]` mask instead, which the flash kernel
reads for every block (measured: 1.95 -> 1.52 ms for 128 tokens over a 1,024-token prefix,
9 heads). Requests without a prefix, segments a window cuts (they need a mask) and layers
with a logit cap (flash cannot cap) take torch_native's path.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglite.attention import cpu_kernel
from sglite.attention.torch_native import TorchNativeAttnBackend, _Segment

if TYPE_CHECKING:
    from sglite.layers.radix_attention import RadixAttention
    from sglite.model_executor.forward_batch import ForwardBatch


@dataclass(frozen=True, eq=False)
class _PoolRows:
    """One-token requests, planned for the kernel once per forward (and window)."""

    plan: cpu_kernel.DecodeRows
    tokens: torch.Tensor | None = None  # their token indices in a mixed batch


class CpuAttnBackend(TorchNativeAttnBackend):
    # Segments whose cached keys are all visible carry no mask: `_attend_segment` merges.
    mask_cached_keys = False

    def __init__(self, runner) -> None:
        reason = cpu_kernel.unavailable_reason()
        if reason is None and runner.device.type != "cpu":
            reason = f"it runs on the CPU, not {runner.device.type}"
        if reason is not None:
            raise ValueError(
                f"attention backend 'cpu' is unavailable: {reason}; "
                "use --attention-backend torch_native"
            )
        super().__init__(runner)
        # a pool the kernel cannot read (float16) takes torch_native's gather path
        self.kernel_reads_pool = cpu_kernel.supports_kv_dtype(runner.kv_pool.dtype)

    def _rows(
        self, batch: ForwardBatch, which, seq_lens: list[int], window: int | None, tokens=None
    ) -> _PoolRows:
        if not self.kernel_reads_pool:
            return super()._rows(batch, which, seq_lens, window, tokens)
        pool_rows = batch.req_pool_indices
        if len(which) != batch.batch_size:
            pool_rows = pool_rows[torch.tensor(list(which), device=pool_rows.device)]
        plan = cpu_kernel.DecodeRows(
            batch.req_to_token_pool.req_to_token,
            pool_rows.to(torch.int64).contiguous(),
            torch.tensor(seq_lens, dtype=torch.int64),
            batch.kv_pool.k_buffer[0].shape[1],
            window,
        )
        return _PoolRows(plan, tokens)

    def decode_plan(self, layer: RadixAttention):
        """The `sglite._core.DecodePlan` this decode batch's `layer` attends with (one per
        distinct window, planned once per forward): for the native decode step."""
        return self._meta(layer).rows.plan.plan

    def _decode_rows(
        self, q: torch.Tensor, layer: RadixAttention, batch: ForwardBatch, rows: _PoolRows
    ) -> torch.Tensor:
        if not self.kernel_reads_pool:
            return super()._decode_rows(q, layer, batch, rows)
        pool = batch.kv_pool
        k, v = pool.k_buffer[layer.layer_id], pool.v_buffer[layer.layer_id]
        # q as it is (float32, bfloat16) over its dtype's pool or a narrower one (bf16, fp8);
        # a float16 model's q in float32 (its pool is then bf16 or fp8: see kernel_reads_pool)
        q_in = q if cpu_kernel.supports_dtype(q.dtype) else q.float()
        out = rows.plan.attend(
            q_in.contiguous(),
            k,
            v,
            layer.scaling,
            logit_cap=layer.logit_cap,
            sinks=layer.sinks,
        )
        return out.to(q.dtype)

    def _attend_segment(
        self, q, k, v, layer: RadixAttention, batch: ForwardBatch, seg: _Segment
    ) -> torch.Tensor:
        if seg.kv_slots is None or seg.mask is not None or layer.v_head_dim != layer.head_dim:
            return super()._attend_segment(q, k, v, layer, batch, seg)
        if layer.logit_cap:  # the written-out softmax, with the mask the merge avoids
            num_cached = seg.kv_slots.shape[0]
            mask = torch.ones(seg.length, num_cached + seg.length, dtype=torch.bool)
            seg = dataclasses.replace(seg, mask=mask.tril_(num_cached))
            return super()._attend_segment(q, k, v, layer, batch, seg)
        end = seg.start + seg.length
        pool = batch.kv_pool
        new_q = q[seg.start : end]
        n, num_heads, d = new_q.shape
        num_kv = layer.num_kv_heads
        group = num_heads // num_kv
        prefix_k = pool.k_buffer[layer.layer_id].index_select(0, seg.kv_slots).to(q.dtype)
        prefix_v = pool.v_buffer[layer.layer_id].index_select(0, seg.kv_slots).to(q.dtype)
        stacked = new_q.view(n, num_kv, group, d).permute(1, 2, 0, 3).reshape(1, num_kv, -1, d)
        out_prefix, lse_prefix = _flash(
            stacked,
            prefix_k.transpose(0, 1).unsqueeze(0),
            prefix_v.transpose(0, 1).unsqueeze(0),
            0.0,
            False,
            scale=layer.scaling,
        )
        new_k, new_v = k[seg.start : end], v[seg.start : end]
        if group > 1:
            new_k = new_k.repeat_interleave(group, dim=1)
            new_v = new_v.repeat_interleave(group, dim=1)
        out_new, lse_new = _flash(
            new_q.transpose(0, 1).unsqueeze(0),
            new_k.transpose(0, 1).unsqueeze(0),
            new_v.transpose(0, 1).unsqueeze(0),
            0.0,
            True,
            scale=layer.scaling,
        )
        lse_prefix, lse_new = lse_prefix.reshape(num_heads, n), lse_new.reshape(num_heads, n)
        top = torch.maximum(lse_prefix, lse_new)
        sinks = None
        if layer.sinks is not None:
            sinks = layer.sinks.detach().float().view(num_heads, 1)
            top = torch.maximum(top, sinks)
        w_prefix = (lse_prefix - top).exp_().unsqueeze(-1)
        w_new = (lse_new - top).exp_().unsqueeze(-1)
        merged = out_prefix.reshape(num_heads, n, d).float() * w_prefix
        merged += out_new.reshape(num_heads, n, d).float() * w_new
        denom = w_prefix + w_new
        if sinks is not None:
            denom += (sinks - top).exp_().unsqueeze(-1)
        merged /= denom
        return merged.to(q.dtype).transpose(0, 1)


def _flash(q, k, v, dropout_p, is_causal, *, scale):
    """torch's CPU flash attention: `(out, logsumexp)`; causal is top-left aligned."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, is_causal, attn_mask=None, scale=scale
    )
