"""Checkpoint weight formats of FP8 and AWQ/GPTQ int4 linears in pure torch: dequantize, pack.

The references the Triton GEMMs of quant_gemm.py are tested against (and what a CPU path may
run). Layouts, as the checkpoints store them:

- FP8 (e4m3): `weight [out, in]` float8_e4m3fn and a float scale, per tensor (0-d or [1]),
  per output channel ([out] or [out, 1]), or per (bn x bk) block ([ceil(out/bn),
  ceil(in/bk)], DeepSeek-V3 / Qwen3-FP8 `weight_scale_inv`): `W = weight * scale`, [out, in].
- AWQ (AutoAWQ GEMM): `qweight [in, out/8]` int32, eight 4-bit columns per int32, column
  `8j + ORDER[i]` in nibble i (bits 4i..4i+3), ORDER = (0, 2, 4, 6, 1, 3, 5, 7);
  `qzeros [in/g, out/8]` packed the same way; `scales [in/g, out]`;
  `W[k, n] = scales[k // g, n] * (q[k, n] - z[k // g, n])`.
- GPTQ (v1 checkpoints): `qweight [in/8, out]` int32, rows 8r..8r+7 of k in nibbles 0..7
  (low nibble first); `qzeros [groups, out/8]` int32, columns in nibble order, storing
  zero - 1 (so a stored 15 reads as 16, as GPTQ v1 kernels read it); `scales [groups, out]`;
  `g_idx [in]` the group of each input row (None: k // g, "desc_act" checkpoints permute it);
  qzeros None: symmetric, zero 8. `W[k, n] = scales[g_idx[k], n] * (q[k, n] - z[g_idx[k], n])`.
  group_size -1 is one group over all of `in`.
The int4 W is [in, out] (x @ W); the FP8 W is [out, in] (x @ W.T), as each format stores it.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column 8j + AWQ_ORDER[i]
# the nibble of column 8j + c: the inverse permutation, (c // 2) + 4 * (c % 2)
AWQ_NIBBLE = tuple(AWQ_ORDER.index(c) for c in range(8))
LAYOUTS = ("awq", "gptq")


def _shifts(device, awq: bool) -> torch.Tensor:
    return 4 * torch.tensor(AWQ_NIBBLE if awq else range(8), dtype=torch.int32, device=device)


def unpack_cols(packed: torch.Tensor, awq: bool) -> torch.Tensor:
    """[R, C/8] int32 -> [R, C] int32 nibbles (AWQ's column order or GPTQ's sequential one)."""
    q = (packed.to(torch.int32)[:, :, None] >> _shifts(packed.device, awq)) & 0xF
    return q.reshape(packed.shape[0], -1)


def pack_cols(q: torch.Tensor, awq: bool) -> torch.Tensor:
    """Inverse of unpack_cols: [R, C] values 0..15 -> [R, C/8] int32."""
    r, c = q.shape
    nib = (q.to(torch.int64) & 0xF).reshape(r, c // 8, 8)
    packed = (nib << _shifts(q.device, awq).to(torch.int64)).sum(-1)
    return _to_int32(packed)


def _to_int32(packed: torch.Tensor) -> torch.Tensor:
    """uint32 bit patterns held in int64 -> int32 with the same bits."""
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """GPTQ qweight [K/8, N] -> [K, N]: row 8r + i is nibble i of packed row r."""
    q = (packed.to(torch.int32)[:, None, :] >> _shifts(packed.device, False)[None, :, None]) & 0xF
    return q.reshape(-1, packed.shape[1])


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """Inverse of unpack_rows: [K, N] values 0..15 -> [K/8, N] int32."""
    k, n = q.shape
    nib = (q.to(torch.int64) & 0xF).reshape(k // 8, 8, n)
    shifts = _shifts(q.device, False).to(torch.int64)[None, :, None]
    return _to_int32((nib << shifts).sum(1))


def group_index(in_features: int, group_size: int, g_idx, device) -> torch.Tensor:
    """The group of each input row (int64 [in])."""
    if g_idx is not None:
        return g_idx.to(device=device, dtype=torch.int64)
    size = in_features if group_size == -1 else group_size
    return torch.arange(in_features, device=device) // size


def int4_dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor | None,
    group_size: int,
    layout: str,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fp32 W [in, out] of an AWQ or GPTQ int4 linear (see the module doc)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "awq":
        q = unpack_cols(qweight, awq=True)
        z = unpack_cols(qzeros, awq=True) if qzeros is not None else None
    else:
        q = unpack_rows(qweight)
        z = unpack_cols(qzeros, awq=False) + 1 if qzeros is not None else None
    g = group_index(q.shape[0], group_size, g_idx, q.device)
    zeros = z[g].float() if z is not None else 8.0
    return scales.float()[g] * (q.float() - zeros)


def int4_pack(
    q: torch.Tensor, zeros: torch.Tensor | None, layout: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(qweight, qzeros) of int4 values `q [in, out]` and zero points `zeros [groups, out]`
    (0..15; GPTQ stores zero - 1, AWQ the zero). zeros None: no qzeros (GPTQ symmetric)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    awq = layout == "awq"
    qweight = pack_cols(q, awq=True) if awq else pack_rows(q)
    if zeros is None:
        return qweight, None
    return qweight, pack_cols(zeros if awq else zeros - 1, awq=awq)


def fp8_scale_kind(weight_shape, scale: torch.Tensor, block_size) -> str:
    """'tensor', 'channel' or 'block', or ValueError naming the expected shapes."""
    out_f, in_f = weight_shape
    if block_size is not None:
        bn, bk = _block(block_size)
        want = (-(-out_f // bn), -(-in_f // bk))
        if tuple(scale.shape) != want:
            raise ValueError(
                f"weight_scale must be {list(want)} for block_size {(bn, bk)} and weight "
                f"{[out_f, in_f]}, got {list(scale.shape)}"
            )
        return "block"
    if scale.numel() == 1 and scale.dim() <= 1:
        return "tensor"
    if tuple(scale.shape) in ((out_f,), (out_f, 1)):
        return "channel"
    raise ValueError(
        f"weight_scale must be 0-d or [1] (per tensor) or [{out_f}] / [{out_f}, 1] (per "
        f"channel), or pass block_size for a block scale; got {list(scale.shape)}"
    )


def _block(block_size) -> tuple[int, int]:
    try:
        bn, bk = (int(b) for b in block_size)
    except (TypeError, ValueError):
        raise ValueError(f"block_size must be (bn, bk), got {block_size!r}") from None
    if bn < 1 or bk < 1:
        raise ValueError(f"block_size must be positive, got {block_size!r}")
    return bn, bk


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def fp8_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token FP8 activations: (xq float8_e4m3fn [M, K], scale fp32 [M]) with
    scale = max|x_row| / 448 and xq = x / scale rounded to nearest; x ~= xq * scale."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    xq = (xf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return xq, scale


def fp8_dequantize(weight: torch.Tensor, scale: torch.Tensor, block_size=None) -> torch.Tensor:
    """The fp32 W [out, in] = weight * scale of an FP8 linear (see the module doc)."""
    kind = fp8_scale_kind(tuple(weight.shape), scale, block_size)
    w = weight.float()
    s = scale.float().to(w.device)
    if kind == "tensor":
        return w * s.reshape(())
    if kind == "channel":
        return w * s.reshape(-1, 1)
    bn, bk = _block(block_size)
    full = s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    return w * full[: w.shape[0], : w.shape[1]]
