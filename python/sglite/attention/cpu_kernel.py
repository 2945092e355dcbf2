"""Launcher of the native CPU decode-attention kernel (`sglite._core.decode_attention`).

The kernel (rust/attn) reads K/V in place from one layer of the KV pool: query row i attends
to the slots `table[rows[i], :seq_lens[i]]` (with a sliding window W, only the last W of
them), GQA query head h to KV head `h // (num_heads // num_kv_heads)`; a layer may cap its
logits and add sinks (see `sglite.layers.radix_attention`). Values may be narrower than
keys: a contiguous `[slots, KVH, Dv]` buffer, or (MLA's latent pool) a view of the first Dv
dims of the key rows, which the kernel reads in place from the key buffer. K/V are q's dtype
(float32 or bfloat16) or narrower: a bfloat16 pool under float32 q, an fp8 pool (e4m3fn,
e5m2: `--kv-cache-dtype`) under either, widened to f32 as they are read. A forward pass plans its rows once (`DecodeRows`) and
attends in every layer; this module checks the layout contract (CPU, dtype, shape,
contiguity), keeps the tensors alive for each call and returns the output.

Threads: the kernel's parallel work runs on torch's own OpenMP team (`share_torch_openmp`),
whose workers are still spinning from the last torch op; threads of its own would wait for
them to give up the cores.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

# torch-free, so the main process can pick the default backend without importing torch
from sglite.attention import cpu_kernel_unavailable_reason as unavailable_reason  # noqa: F401

logger = logging.getLogger(__name__)

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}  # of q and the output
# of K/V: q's, or (the pool's --kv-cache-dtype) bfloat16 under float32 q, or fp8 under either
_KV_DTYPES = {
    **_DTYPES,
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
}


@functools.cache
def share_torch_openmp() -> bool:
    """Point the kernel at the `GOMP_parallel` of the OpenMP runtime torch loaded (once per
    process); False, and threads of the kernel's own, where torch does not run on OpenMP or
    the runtime is not found."""
    from sglite import _core

    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return False
    with open("/proc/self/maps") as maps:
        paths = {fields[5] for fields in map(str.split, maps) if len(fields) >= 6}
    names = ("libgomp", "libiomp", "libomp")
    for path in sorted(p for p in paths if os.path.basename(p).startswith(names)):
        try:
            runtime = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            address = ctypes.cast(runtime.GOMP_parallel, ctypes.c_void_p).value
        except (OSError, AttributeError):
            continue
        if address:
            _core.set_openmp_parallel(address)
            logger.debug("decode attention runs on the OpenMP team of %s", path)
            return True
    return False


def supports_dtype(dtype: torch.dtype) -> bool:
    """Whether q (and the output) may be of `dtype`."""
    return dtype in _DTYPES


def supports_kv_dtype(dtype: torch.dtype) -> bool:
    """Whether the kernel reads K/V of `dtype` in place (float32 or bfloat16 q over them)."""
    return dtype in _KV_DTYPES


def _pair_ok(q: torch.dtype, kv: torch.dtype) -> bool:
    return q in _DTYPES and kv in _KV_DTYPES and (kv == q or kv.itemsize < q.itemsize)


def _raw(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.numel()


class DecodeRows:
    """One forward's one-token rows, planned once (`sglite._core.DecodePlan`: the rows' slots
    copied and checked, rows sharing a cached prefix grouped), then attended in every layer.

    `table` int32 `[R, C]` (the request table), `rows` and `seq_lens` int64 `[n]`: row i
    attends to the slots `table[rows[i], :seq_lens[i]]`, or to their last `window`."""

    def __init__(
        self,
        table: torch.Tensor,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        num_kv_heads: int,
        window: int | None = None,
    ) -> None:
        from sglite import _core

        if table.dtype != torch.int32 or table.dim() != 2:
            raise ValueError(f"decode_attention: table must be 2-D int32, got {table.dtype}")
        if rows.dtype != torch.int64 or seq_lens.dtype != torch.int64:
            raise ValueError("decode_attention: rows and seq_lens must be int64")
        if rows.dim() != 1 or rows.shape != seq_lens.shape:
            raise ValueError(
                f"decode_attention: rows {tuple(rows.shape)} and seq_lens "
                f"{tuple(seq_lens.shape)} must both be [n]"
            )
        if window is not None and window < 1:
            raise ValueError(f"decode_attention: window must be >= 1 or None, got {window}")
        _check_cpu_contiguous(table, rows, seq_lens)
        share_torch_openmp()
        self.num_rows = rows.shape[0]
        self.plan = _core.DecodePlan(
            _raw(table), table.shape[1], _raw(rows), _raw(seq_lens), num_kv_heads, window
        )

    def attend(
        self,
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        scale: float,
        num_threads: int | None = None,
        *,
        logit_cap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q `[n, H, D]` over one layer's k `[num_slots, KVH, D]` and v `[num_slots, KVH,
        Dv]` (Dv <= D; contiguous, or a view of k's first Dv dims); returns `[n, H, Dv]` in
        q's dtype. K/V may be stored narrower than q (bfloat16, fp8): read widened to f32.
        `logit_cap` (0: none) caps the scores; `sinks` `[H]` join the softmax's denominator."""
        if (
            q.dim() != 3
            or k_buffer.dim() != 3
            or v_buffer.shape[:2] != k_buffer.shape[:2]
            or v_buffer.shape[2] > k_buffer.shape[2]
        ):
            raise ValueError(
                f"decode_attention: q must be [n, H, D], k [slots, KVH, D] and v [slots, KVH, "
                f"Dv <= D]; got {tuple(q.shape)}, {tuple(k_buffer.shape)}, "
                f"{tuple(v_buffer.shape)}"
            )
        n, num_heads, head_dim = q.shape
        if n != self.num_rows or k_buffer.shape[2] != head_dim:
            raise ValueError(
                f"decode_attention: q {tuple(q.shape)} and K/V {tuple(k_buffer.shape)} do not "
                f"fit {self.num_rows} rows of head_dim {head_dim}"
            )
        if k_buffer.dtype != v_buffer.dtype or not _pair_ok(q.dtype, k_buffer.dtype):
            raise ValueError(
                f"decode_attention: q must be float32 or bfloat16 and k, v one dtype: q's, "
                f"bfloat16 under float32 q, or float8_e4m3fn / float8_e5m2; got "
                f"{q.dtype}, {k_buffer.dtype}, {v_buffer.dtype}"
            )
        v_dim = v_buffer.shape[2]
        if _is_leading_view(v_buffer, k_buffer):
            v_buffer = k_buffer  # the kernel reads the values in place, from the key rows
        _check_cpu_contiguous(q, k_buffer, v_buffer)
        sink_arg = None
        if sinks is not None:
            if sinks.shape != (num_heads,) or sinks.device.type != "cpu":
                raise ValueError(
                    f"decode_attention: sinks must be [{num_heads}] on the CPU, got "
                    f"{tuple(sinks.shape)} on {sinks.device}"
                )
            sinks = sinks.detach().to(torch.float32).contiguous()
            sink_arg = _raw(sinks)
        out = q.new_empty((n, num_heads, v_dim))
        self.plan.run(
            _raw(q),
            _raw(k_buffer),
            _raw(v_buffer),
            _raw(out),
            num_heads,
            k_buffer.shape[1],
            head_dim,
            float(scale),
            _DTYPES[q.dtype],
            num_threads if num_threads is not None else torch.get_num_threads(),
            float(logit_cap),
            sink_arg,
            v_dim,
            _KV_DTYPES[k_buffer.dtype],
        )
        return out


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_threads: int | None = None,
    *,
    window: int | None = None,
    logit_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer, planned and run at once (see `DecodeRows`)."""
    if k_buffer.dim() != 3:
        raise ValueError(
            f"decode_attention: k must be [slots, KVH, D], got {tuple(k_buffer.shape)}"
        )
    plan = DecodeRows(table, rows, seq_lens, k_buffer.shape[1], window)
    return plan.attend(q, k_buffer, v_buffer, scale, num_threads, logit_cap=logit_cap, sinks=sinks)


def _is_leading_view(v: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether `v` is `k[..., :Dv]` of a contiguous `k` (MLA's values in its key rows)."""
    return (
        v.data_ptr() == k.data_ptr()
        and v.stride() == k.stride()
        and k.is_contiguous()
        and v.shape[2] < k.shape[2]
    )


def _check_cpu_contiguous(*tensors: torch.Tensor) -> None:
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError("decode_attention: every tensor must be on the CPU")
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("decode_attention: every tensor must be contiguous")
