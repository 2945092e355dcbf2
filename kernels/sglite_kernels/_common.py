"""Layout-contract checks and small Triton helpers shared by the kernel launchers.

Each launcher validates its inputs once, on the host, without reading device memory (no
synchronisation); a violated contract raises ValueError naming the tensor and what to do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_float(name: str, t: torch.Tensor, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; expected float32, float16 or bfloat16")
    if t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last (head_dim) dim, got strides {t.stride()}; "
            "call .contiguous() first"
        )


def check_index(name: str, t: torch.Tensor, length: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; expected int32 or int64")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous; call .contiguous() first")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name} must have {length} entries, got {t.shape[0]}")


def check_same_dtype(**tensors: torch.Tensor) -> None:
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{n}={d}" for n, d in dtypes.items())
        raise ValueError(f"dtypes must match ({listed}); cast to one dtype first")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{n}={d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on one device ({listed})")
    if next(iter(devices.values())).type == "cpu" and not interpreted():
        raise ValueError(
            "CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before "
            "sglite_kernels is imported, or move the tensors to a GPU"
        )


def interpreted() -> bool:
    """Whether the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(tile_dot, JITFunction)


def check_head_dim(head_dim: int) -> None:
    if head_dim < 16 or head_dim > 512 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two in [16, 512], got {head_dim}")


def check_heads(num_q_heads: int, num_kv_heads: int) -> None:
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a positive multiple of "
            f"num_kv_heads ({num_kv_heads})"
        )


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs are multiplied exactly ("ieee"); tf32 would lose ~3 digits."""
    return "ieee" if dtype == torch.float32 else "tf32"


def dot_in_fp32(t: torch.Tensor) -> bool:
    """Whether tl.dot operands must be upcast: Triton's CPU interpreter multiplies bf16 as
    raw uint16 bits, so on CPU (interpreter only) bf16 tiles are widened first."""
    return t.device.type == "cpu" and t.dtype == torch.bfloat16


@triton.jit
def tile_dot(a, b, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b with fp32 accumulation (see dot_in_fp32 for DOT_FP32)."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


# A window wider than any context: the kernels' form of "no sliding window".
NO_WINDOW = 1 << 30


def window_arg(window: int | None) -> int:
    """The kernels' window argument: W, or NO_WINDOW for full attention."""
    if window is None:
        return NO_WINDOW
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    return min(window, NO_WINDOW)


def check_variant(logit_cap: float, sinks: torch.Tensor | None, num_q_heads: int, device) -> None:
    if not (logit_cap >= 0 and logit_cap != float("inf")):
        raise ValueError(f"logit_cap must be finite and >= 0 (0: none), got {logit_cap}")
    if sinks is not None:
        if sinks.dtype != torch.float32 or sinks.shape != (num_q_heads,):
            raise ValueError(
                f"sinks must be float32 [{num_q_heads}], got {sinks.dtype} {tuple(sinks.shape)}"
            )
        if not sinks.is_contiguous() or sinks.device != torch.device(device):
            raise ValueError(f"sinks must be contiguous on {device}")


@triton.jit
def soft_cap(x, cap):
    """cap * tanh(x / cap), from exp2 (the same in the interpreter and on every GPU)."""
    y = x / cap
    e = tl.exp2(-2.8853900817779268 * tl.abs(y))  # exp(-2|y|)
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(y >= 0, t, -t)
