"""Writing the k-quants (Q4_K, Q5_K, Q6_K) in numpy, which gguf-py can read but not write.

The fit is plain: per sub-block (32 weights; 16 for Q6_K) a min/max (Q4_K, Q5_K: `w = s * q
- m` with q in 0..2^bits-1) or an absolute max (Q6_K: `w = s * (q - 32)`); the sub-block
scales are then quantized to 6 bits (8 bits for Q6_K) under the super-block's f16 scales,
and the levels rounded against the scales as stored. llama.cpp searches its scales to
lower the error; the byte layout is the same (rust/quant/src/format.rs), so any reader takes
these files.
"""

from __future__ import annotations

import numpy as np


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bytes `[..., 2]`, the value as stored in float32)."""
    half = x.astype(np.float16)
    return half.reshape(*half.shape, 1).view(np.uint8), half.astype(np.float32)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), 0)


def _pack_k4_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins `[n, 8]` -> the 12 packed bytes `[n, 12]`."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    return out


def _quantize_k4(blocks: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (bits 4) or Q5_K (bits 5): `blocks` float32 `[n, 256]` -> bytes `[n, 144 | 176]`."""
    top = (1 << bits) - 1
    sub = blocks.reshape(-1, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0)  # the min is subtracted: keep 0 representable
    scale = (sub.max(axis=-1) - low) / top
    d_bytes, d = _f16(scale.max(axis=-1) / 63)
    m_bytes, dmin = _f16(-low.min(axis=-1) / 63)
    sc = np.clip(np.rint(_ratio(scale, d[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_ratio(-low, dmin[:, None])), 0, 63).astype(np.uint8)
    step = (d[:, None] * sc)[..., None]
    offset = (dmin[:, None] * mn)[..., None]
    q = np.clip(np.rint(_ratio(sub + offset, np.broadcast_to(step, sub.shape))), 0, top)
    q = q.astype(np.uint8)  # [n, 8, 32]
    low4 = q & 0xF
    qs = (low4[:, 0::2] | (low4[:, 1::2] << 4)).reshape(-1, 128)
    parts = [d_bytes, m_bytes, _pack_k4_scales(sc, mn)]
    if bits == 5:
        high = (q >> 4) & 1  # group j's bit -> bit j of each of the 32 bytes
        parts.append((high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1))
    parts.append(qs)
    return np.concatenate([p.astype(np.uint8).reshape(len(blocks), -1) for p in parts], axis=1)


def _quantize_q6k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K: `blocks` float32 `[n, 256]` -> bytes `[n, 210]`."""
    sub = blocks.reshape(-1, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31
    d_bytes, d = _f16(scale.max(axis=-1) / 127)
    sc = np.clip(np.rint(_ratio(scale, d[:, None])), -128, 127).astype(np.int8)
    step = np.broadcast_to((d[:, None] * sc)[..., None], sub.shape)
    q = (np.clip(np.rint(_ratio(sub, step)), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # [n, half, s, l]: weight h * 128 + s * 32 + l
    ql = np.concatenate(
        [
            (q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
            (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4),
        ],
        axis=-1,
    )  # [n, 2, 64]
    qh = sum(((q[:, :, s] >> 4) & 3) << (2 * s) for s in range(4)).astype(np.uint8)  # [n, 2, 32]
    parts = [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d_bytes.reshape(-1, 2)]
    return np.concatenate(parts, axis=1)


def quantize_k(qtype: str, weight: np.ndarray) -> np.ndarray:
    """float32 `[rows, in_features]` (a multiple of 256) -> uint8 `[rows, row_bytes]`."""
    rows, cols = weight.shape
    blocks = weight.reshape(-1, 256).astype(np.float32)
    if qtype == "Q4_K":
        out = _quantize_k4(blocks, 4)
    elif qtype == "Q5_K":
        out = _quantize_k4(blocks, 5)
    elif qtype == "Q6_K":
        out = _quantize_q6k(blocks)
    else:
        raise ValueError(f"quantize_k: {qtype!r} is not a k-quant (Q4_K, Q5_K, Q6_K)")
    return out.reshape(rows, -1)
