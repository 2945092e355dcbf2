"""TritonAttnBackend: paged attention through the sglite_kernels Triton kernels (CUDA default).

Per forward, `init_forward_metadata` builds CSR addressing over slot ids on the device, with
no host sync (lengths come from the batch's `*_cpu` mirrors):

| mode           | kv_indptr / kv_indices cover             | also                            |
|----------------|------------------------------------------|---------------------------------|
| decode         | positions 0 .. seq_len-1 (new token too) | num_kv_splits [B]               |
| extend / mixed | the cached prefix 0 .. prefix_len-1      | qo_indptr [B+1], max_extend_len |

Every layer then stores its K/V with the `store_kv` kernel (`save_kv`) and runs one kernel:
split-KV decode, or extend (prefix through the slot list, new tokens from this step's k/v).
MLA's latent pool (`pool.values_in_keys`): rows stored with `set_kv`, decode through
`mla_decode_attention` (its extend is torch's, sglite.layers.latent_attention).
Slot-level indices work for any page size. The per-layer variations go to the kernels as
arguments: a layer's sliding window makes the kernels start each row at its window (the
slot lists still cover every position, so all layers share them); only the decode split
counts depend on the window (they split the keys a row reads), one tensor per window. On CPU the kernels run only through Triton's
interpreter (TRITON_INTERPRET=1 before start-up), which the test suite uses.

CUDA graphs (decode): `init_cuda_graph_state` allocates one set of fixed-size buffers
(`_GraphBuffers`) for the largest captured batch, with split counts for each window the
model's layers use; a captured batch of bs rows reads views of their first rows, and
`init_forward_metadata_replay` refills them in place before each replay (kv_indices holds up
to max_bs * context-length slot ids, so any lengths fit). Real rows get the same split
counts as in eager mode (computed over the real rows only), padded rows one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglite.attention.base import AttentionBackend
from sglite.layers.radix_attention import RadixAttention
from sglite_kernels import (
    decode_attention,
    extend_attention,
    fill_kv_indices,
    interpreted,
    mla_decode_attention,
    num_kv_splits,
    store_kv,
)

if TYPE_CHECKING:
    from sglite.model_executor.forward_batch import ForwardBatch

# Upper bound of decode splits per request: the stage-1 grid's third dim and the scratch size.
MAX_KV_SPLITS = 16


@dataclass(eq=False)
class _Metadata:
    kv_indptr: torch.Tensor  # [B+1] int32
    kv_indices: torch.Tensor  # int32 slot ids
    # Decode only: split counts per sliding window (None: full attention), made on first use
    # in eager mode and bound to the graph buffers under CUDA graphs.
    num_kv_splits: dict[int | None, torch.Tensor] | None = None
    mid_o: torch.Tensor | None = None  # split scratch, allocated by the first layer
    mid_lse: torch.Tensor | None = None
    # Extend only.
    qo_indptr: torch.Tensor | None = None
    max_extend_len: int = 0


@dataclass(eq=False)
class _GraphBuffers:
    """Decode metadata and split scratch of every captured batch size, allocated once."""

    kv_indptr: torch.Tensor  # [max_bs + 1] int32, entry 0 stays 0
    kv_indices: torch.Tensor  # [max_bs * max_context_len] int32
    num_kv_splits: dict[int | None, torch.Tensor]  # window -> [max_bs] int32
    mid_o: torch.Tensor  # [max_bs, num_heads, MAX_KV_SPLITS, widest v_head_dim] float32
    mid_lse: torch.Tensor  # [max_bs, num_heads, MAX_KV_SPLITS] float32

    @property
    def max_bs(self) -> int:
        return self.kv_indptr.shape[0] - 1


def _indptr(lens: torch.Tensor) -> torch.Tensor:
    indptr = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=lens.device)
    indptr[1:] = torch.cumsum(lens, 0)
    return indptr


def _window_lens(seq_lens: torch.Tensor, window: int | None) -> torch.Tensor:
    """The keys each decode row reads."""
    return seq_lens if window is None else seq_lens.clamp(max=window)


class TritonAttnBackend(AttentionBackend):
    features = frozenset({"sliding_window", "logit_cap", "sinks"})

    def __init__(self, runner) -> None:
        super().__init__(runner)
        self._meta: _Metadata | None = None
        self._batch: ForwardBatch | None = None
        self._num_sms: int | None = None
        self._graph: _GraphBuffers | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = batch.kv_pool.device
        if device.type == "cpu" and not interpreted():
            raise ValueError(
                "the triton attention backend on CPU needs TRITON_INTERPRET=1 set before "
                "start-up (slow, for tests); use --attention-backend torch_native"
            )
        if batch.forward_mode.is_decode():
            self._meta = self._decode_metadata(batch)
        else:
            self._meta = self._extend_metadata(batch)

    def _slot_lists(self, batch: ForwardBatch, lens: torch.Tensor, total: int):
        kv_indptr = _indptr(lens)
        kv_indices = torch.empty(total, dtype=torch.int32, device=lens.device)
        table = batch.req_to_token_pool.req_to_token
        fill_kv_indices(table, batch.req_pool_indices, lens, kv_indptr, kv_indices)
        return kv_indptr, kv_indices

    def _decode_metadata(self, batch: ForwardBatch) -> _Metadata:
        kv_indptr, kv_indices = self._slot_lists(batch, batch.seq_lens, sum(batch.seq_lens_cpu))
        self._batch = batch
        return _Metadata(kv_indptr, kv_indices, num_kv_splits={})

    def _splits(self, batch: ForwardBatch, seq_lens: torch.Tensor, window: int | None):
        return num_kv_splits(
            _window_lens(seq_lens, window),
            batch.kv_pool.num_kv_heads,
            self._sm_count(batch),
            MAX_KV_SPLITS,
        )

    def _splits_for(self, window: int | None) -> torch.Tensor:
        splits = self._meta.num_kv_splits.get(window)
        if splits is None:  # eager only: graph metadata holds every window's
            if self._batch is None:
                raise ValueError(
                    f"sliding window {window} is not among the windows the CUDA-graph "
                    f"buffers were made for ({sorted(map(str, self._meta.num_kv_splits))})"
                )
            splits = self._splits(self._batch, self._batch.seq_lens, window)
            self._meta.num_kv_splits[window] = splits
        return splits

    def _extend_metadata(self, batch: ForwardBatch) -> _Metadata:
        kv_indptr, kv_indices = self._slot_lists(
            batch, batch.extend_prefix_lens, sum(batch.extend_prefix_lens_cpu)
        )
        return _Metadata(
            kv_indptr,
            kv_indices,
            qo_indptr=_indptr(batch.extend_seq_lens),
            max_extend_len=max(batch.extend_seq_lens_cpu, default=0),
        )

    def _sm_count(self, batch: ForwardBatch) -> int:
        if self._num_sms is None:
            device = batch.kv_pool.device
            self._num_sms = (
                torch.cuda.get_device_properties(device).multi_processor_count
                if device.type == "cuda"
                else 1
            )
        return self._num_sms

    # ------------------------------------------------------------------ CUDA graphs
    supports_cuda_graph = True

    def init_cuda_graph_state(self, max_bs: int) -> None:
        table = self.runner.req_to_token_pool
        device = self.runner.kv_pool.device
        split_shape = (max_bs, self.runner.num_local_heads, MAX_KV_SPLITS)
        self._graph = _GraphBuffers(
            kv_indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=device),
            kv_indices=torch.zeros(
                max_bs * table.max_context_len, dtype=torch.int32, device=device
            ),
            num_kv_splits={
                w: torch.ones(max_bs, dtype=torch.int32, device=device) for w in self._windows()
            },
            mid_o=torch.zeros(
                (*split_shape, self._widest_value()), dtype=torch.float32, device=device
            ),
            mid_lse=torch.zeros(split_shape, dtype=torch.float32, device=device),
        )

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        g, bs = self._graph, batch.batch_size
        if g is None or bs > g.max_bs:
            raise ValueError(
                f"decode batch of {bs} rows is beyond the CUDA-graph buffers "
                f"({'none' if g is None else g.max_bs}); call init_cuda_graph_state first"
            )
        self._meta = _Metadata(
            g.kv_indptr[: bs + 1],
            g.kv_indices,
            num_kv_splits={w: splits[:bs] for w, splits in g.num_kv_splits.items()},
            mid_o=g.mid_o[:bs],
            mid_lse=g.mid_lse[:bs],
        )
        self._batch = None  # every window's split counts live in the graph buffers
        self.init_forward_metadata_replay(batch, bs)

    def init_forward_metadata_replay(self, batch: ForwardBatch, num_real: int) -> None:
        g, bs = self._graph, batch.batch_size
        seq_lens = batch.seq_lens
        g.kv_indptr[1 : bs + 1].copy_(torch.cumsum(seq_lens, 0))
        table = batch.req_to_token_pool.req_to_token
        fill_kv_indices(
            table, batch.req_pool_indices, seq_lens, g.kv_indptr[: bs + 1], g.kv_indices
        )
        for window, buf in g.num_kv_splits.items():
            buf[:num_real].copy_(self._splits(batch, seq_lens[:num_real], window))
            buf[num_real:bs].fill_(1)

    def _widest_value(self) -> int:
        """The widest value head of the model's layers (the split scratch's last dim)."""
        model = getattr(self.runner, "model", None)
        layers = model.modules() if model is not None else ()
        dims = [m.v_head_dim for m in layers if isinstance(m, RadixAttention)]
        return max(dims, default=self.runner.model_config.head_dim)

    def _windows(self) -> set[int | None]:
        """The sliding windows of the model's layers (None: full attention), for the graphs."""
        model = getattr(self.runner, "model", None)
        layers = model.modules() if model is not None else ()
        return {None} | {m.sliding_window for m in layers if isinstance(m, RadixAttention)}

    # ------------------------------------------------------------------ per layer
    def save_kv(
        self, layer: RadixAttention, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        pool = batch.kv_pool
        if pool.values_in_keys:  # MLA's latent rows: one buffer, the values inside the keys
            pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
            return
        store_kv(
            k.to(pool.dtype),
            v.to(pool.dtype),
            pool.k_buffer[layer.layer_id],
            pool.v_buffer[layer.layer_id],
            batch.out_cache_loc,
        )

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        meta, pool = self._meta, batch.kv_pool
        q_kv = q.to(pool.dtype)
        dv = layer.v_head_dim
        if meta.mid_o is None or meta.mid_o.shape[-1] < dv:
            shape = (q.shape[0], q.shape[1], MAX_KV_SPLITS)
            meta.mid_o = torch.empty((*shape, dv), dtype=torch.float32, device=q.device)
            meta.mid_lse = torch.empty(shape, dtype=torch.float32, device=q.device)
        out = q_kv.new_empty((*q.shape[:2], dv))
        if pool.values_in_keys:  # MLA's absorbed decode
            mla_decode_attention(
                q_kv, pool.k_buffer[layer.layer_id], out, meta.kv_indptr, meta.kv_indices,
                self._splits_for(layer.sliding_window), MAX_KV_SPLITS, layer.scaling,
                meta.mid_o[..., :dv], meta.mid_lse,
            )  # fmt: skip
            return out.to(q.dtype)
        decode_attention(
            q_kv,
            pool.k_buffer[layer.layer_id],
            pool.v_buffer[layer.layer_id],
            out,
            meta.kv_indptr,
            meta.kv_indices,
            self._splits_for(layer.sliding_window),
            MAX_KV_SPLITS,
            layer.scaling,
            meta.mid_o[..., :dv],
            meta.mid_lse,
            **_variant(layer),
        )
        return out.to(q.dtype)

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        meta, pool = self._meta, batch.kv_pool
        q_kv = q.to(pool.dtype)
        out = torch.empty_like(q_kv)
        extend_attention(
            q_kv,
            k.to(pool.dtype),
            v.to(pool.dtype),
            out,
            pool.k_buffer[layer.layer_id],
            pool.v_buffer[layer.layer_id],
            meta.qo_indptr,
            meta.kv_indptr,
            meta.kv_indices,
            meta.max_extend_len,
            layer.scaling,
            **_variant(layer),
        )
        return out.to(q.dtype)


def _variant(layer: RadixAttention) -> dict:
    """The kernels' keyword arguments for the layer's window, logit cap and sinks."""
    sinks = layer.sinks
    if sinks is not None:
        sinks = sinks.detach().to(torch.float32).contiguous()
    return dict(window=layer.sliding_window, logit_cap=layer.logit_cap, sinks=sinks)
