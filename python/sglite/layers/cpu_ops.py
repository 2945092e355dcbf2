"""The decoder layer's element-wise steps on the CPU, through the native kernels
(`sglite._core.rms_norm`, `gated_mul`, `rope`; rust/attn/src/ops.rs).

torch runs each step as several ops, and on a decode step their dispatch is what costs:
about 9 of a 100 ms step at 16 rows over 30 layers, where one native call per step takes
under a millisecond. Each function here takes the tensors the layer has, says whether the
native path applies (`None` when not: another device or dtype, a layout it does not take,
or no native module), and otherwise returns the result; the layers fall back to torch.
Outputs are new tensors, except that `rms_norm` adds `x` into `residual` in place.
"""

from __future__ import annotations

import functools

import torch

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


@functools.cache
def _native():
    """`sglite._core` when it has the kernels, else None."""
    try:
        from sglite import _core
    except ImportError:
        return None
    if not hasattr(_core, "rope"):
        return None
    from sglite.attention.cpu_kernel import share_torch_openmp

    share_torch_openmp()
    return _core


def _dtype(*tensors: torch.Tensor) -> str | None:
    """The dtype name when every tensor is a CPU tensor of one supported dtype."""
    first = tensors[0]
    name = _DTYPES.get(first.dtype)
    if name is None or first.device.type != "cpu":
        return None
    for t in tensors[1:]:
        if t.dtype != first.dtype or t.device.type != "cpu":
            return None
    return name if _native() is not None else None


def _raw(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.numel()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | None:
    """`norm(x) * weight` over the last dim; with `residual`, `residual += x` first (in
    place) and the sum is normalised."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    dtype = _dtype(*tensors)
    if dtype is None or not all(t.is_contiguous() for t in tensors):
        return None
    if residual is not None and residual.shape != x.shape:
        return None
    out = torch.empty_like(x)
    _native().rms_norm(
        _raw(x),
        None if residual is None else _raw(residual),
        _raw(weight),
        _raw(out),
        eps,
        dtype,
        torch.get_num_threads(),
    )
    return out


def _gated(activation: str, x: torch.Tensor) -> torch.Tensor | None:
    dtype = _dtype(x)
    if dtype is None or not x.is_contiguous() or x.shape[-1] % 2:
        return None
    run = getattr(_native(), "gated_mul", None)
    if run is None:  # a native module built before this kernel existed
        return None
    d = x.shape[-1] // 2
    out = x.new_empty((*x.shape[:-1], d))
    run(_raw(x), _raw(out), d, activation, dtype, torch.get_num_threads())
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """`silu(x[..., :d]) * x[..., d:]`."""
    return _gated("silu", x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """`gelu_tanh(x[..., :d]) * x[..., d:]` (GeGLU, torch's `approximate="tanh"`)."""
    return _gated("gelu_tanh", x)


def _head_rows(t: torch.Tensor) -> tuple[tuple[int, int], int] | None:
    """`[T, H, D]` with contiguous heads, rows any stride apart: ((address, span), stride)."""
    if t.dim() != 3 or t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        return None
    tokens, heads, dim = t.shape
    stride = t.stride(0) if tokens > 1 else heads * dim
    span = (tokens - 1) * stride + heads * dim if tokens else 0
    return (t.data_ptr(), span), stride


def rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rotate q `[T, Hq, D]` and k `[T, Hk, D]` at `positions` (the neox layout; `table` is
    `[max_position, 2D]` of `[cos | cos | -sin | sin]`); returns new contiguous tensors."""
    dtype = _dtype(q, k, table)
    if dtype is None or positions.dtype != torch.int64 or positions.device.type != "cpu":
        return None
    q_rows, k_rows = _head_rows(q), _head_rows(k)
    if q_rows is None or k_rows is None or not table.is_contiguous():
        return None
    positions = positions.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype)
    k_out = torch.empty(k.shape, dtype=k.dtype)
    _native().rope(
        _raw(positions),
        _raw(table),
        q_rows[0],
        q_rows[1],
        q.shape[1],
        k_rows[0],
        k_rows[1],
        k.shape[1],
        _raw(q_out),
        _raw(k_out),
        q.shape[2],
        dtype,
        torch.get_num_threads(),
    )
    return q_out, k_out


_POOL_DTYPES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
}


def kv_store(buffer: torch.Tensor, loc: torch.Tensor, rows: torch.Tensor) -> bool | None:
    """`buffer[loc] = rows` in the buffer's dtype (a KV pool layer `[slots, H, D]`; rows
    `[T, H, D]`, float32 or bfloat16, heads contiguous): torch's rounding, fp8 saturated as
    `kv_dtype.to_store` does. True when done, None when the native path does not apply."""
    pool_dtype = _POOL_DTYPES.get(buffer.dtype)
    dtype = _dtype(rows)
    if pool_dtype is None or dtype is None or buffer.device.type != "cpu":
        return None
    if loc.dtype != torch.int64 or loc.device.type != "cpu" or loc.dim() != 1:
        return None
    head_rows = _head_rows(rows)
    if head_rows is None or buffer.dim() != 3 or buffer.shape[1:] != rows.shape[1:]:
        return None
    if not buffer.is_contiguous() or loc.shape[0] != rows.shape[0]:
        return None
    loc = loc.contiguous()
    (addr, span), stride = head_rows
    _native().kv_store(
        (addr, span),
        stride,
        rows.shape[1] * rows.shape[2],
        _raw(loc),
        (buffer.data_ptr(), buffer.numel() * buffer.element_size()),
        dtype,
        pool_dtype,
        torch.get_num_threads(),
    )
    return True
