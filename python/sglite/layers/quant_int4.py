"""AWQ and GPTQ int4 tensors: unpacking to levels, the reference dequantization, and the
repack into GGUF Q4_0 / Q4_1 blocks that the native CPU kernels run.

Both formats hold `w[o, i] = scale[g, o] * (q[o, i] - zero[g, o])`, 4-bit levels q and
zeros, `g` the group of input column i, and pack eight 4-bit values into each int32 (the
value at nibble k sits at bits 4k..4k+3):

- AWQ (AutoAWQ's GEMM layout): `qweight` int32 `[in, out/8]` and `qzeros` int32
  `[in/group, out/8]`, both packed along the output features in AWQ's interleaved order (the
  eight outputs `8c + (0, 2, 4, 6, 1, 3, 5, 7)` at nibbles 0..7 of word c), `scales`
  `[in/group, out]`; the zeros are stored as they are.
- GPTQ: `qweight` int32 `[in/8, out]` packed along the input features in order (input
  `8r + k` at nibble k of row r), `qzeros` int32 `[groups, out/8]` packed along the outputs
  in order, `scales` `[groups, out]`, `g_idx` int32 `[in]` (each input column's group;
  absent: `i // group`). The v1 format (`checkpoint_format` "gptq") stores `zero - 1`;
  gptq_v2 stores the zero itself.

The repack: a group of >= 32 consecutive input columns holding one (scale, zero) per output is,
per run of 32 columns, a Q4_1 block with `d = scale` and `m = -scale * zero` (f16 both), or a
Q4_0 block `d * (q - 8)` when every zero of the tensor is 8 (symmetric checkpoints). Rounding
added: none for Q4_0 when the scales are f16 (the usual case; other scale dtypes round once to
f16); Q4_1 rounds `m` to f16, at most 2^-11 * |scale * zero| <= 16 * 2^-11 * |scale| (under 1%
of one quantization step) per weight. A permuted `g_idx` (GPTQ act-order, `desc_act`) is not
contiguous groups, so it has no block form: refused by name here (the CUDA kernel takes it).
"""

from __future__ import annotations

import torch

from sglite.layers.quant_linear import PackedRows

LAYOUTS = ("awq", "gptq")
# nibble k of an AWQ word holds output 8c + AWQ_ORDER[k]; output 8c + j is at nibble _AWQ_NIBBLE[j]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_int32(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 `[r, c]` -> int32 levels `[r, 8c]` (nibble k of word j at column 8j + k, or at
    8j + order[k] with `order`)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    levels = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF  # [r, c, 8] by nibble
    if order is not None:
        levels = levels[..., list(_AWQ_NIBBLE if order == AWQ_ORDER else order)]
    return levels.flatten(-2)


def pack_int32(levels: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The inverse of `unpack_int32`: levels `[r, 8c]` (0..15) -> int32 `[r, c]` (tests write
    checkpoints with it)."""
    v = levels.to(torch.int64).unflatten(-1, (-1, 8))
    if order is not None:
        v = v[..., list(order)]  # nibble k takes column order[k]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=levels.device)
    word = (v << shifts).sum(-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def default_g_idx(in_features: int, group_size: int, device=None) -> torch.Tensor:
    return torch.arange(in_features, dtype=torch.int32, device=device) // group_size


def unpack(
    layout: str,
    qweight: torch.Tensor,
    qzeros: torch.Tensor | None,
    scales: torch.Tensor,
    *,
    zero_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(levels `[out, in]`, zeros `[groups, out]`, scales float32 `[groups, out]`) of a
    checkpoint's tensors; `qzeros` None is the symmetric zero 8; `zero_offset` is added to
    the stored zeros (1 for GPTQ v1)."""
    if layout not in LAYOUTS:
        raise ValueError(f"int4 layout {layout!r}: one of {', '.join(LAYOUTS)}")
    if qweight.dtype != torch.int32:
        raise ValueError(f"{layout} qweight must be int32, got {qweight.dtype}")
    order = AWQ_ORDER if layout == "awq" else None
    if layout == "awq":
        levels = unpack_int32(qweight, order).T  # [in, out] -> [out, in]
    else:
        levels = unpack_int32(qweight.T).reshape(qweight.shape[1], -1)  # [out, in]
    groups, out = scales.shape
    if levels.shape[0] != out:
        raise ValueError(
            f"{layout} qweight {tuple(qweight.shape)} holds {levels.shape[0]} outputs, scales "
            f"{tuple(scales.shape)} {out}"
        )
    if qzeros is None:
        zeros = torch.full((groups, out), 8, dtype=torch.int32, device=qweight.device)
    else:
        zeros = unpack_int32(qzeros, order) + zero_offset
        if zeros.shape != (groups, out):
            raise ValueError(
                f"{layout} qzeros {tuple(qzeros.shape)} do not match scales {tuple(scales.shape)}"
            )
    return levels.contiguous(), zeros, scales.to(torch.float32)


def dequantize(
    levels: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor
) -> torch.Tensor:
    """float32 `[out, in]`: `scale[g_idx[i], o] * (q[o, i] - zero[g_idx[i], o])`."""
    g = g_idx.long()
    return scales.T[:, g] * (levels - zeros.T[:, g]).to(torch.float32)


def check_g_idx(g_idx: torch.Tensor, group_size: int, what: str) -> None:
    """ValueError unless `g_idx` is the contiguous groups `i // group_size`."""
    if not torch.equal(g_idx.to(torch.int64), default_g_idx(len(g_idx), group_size).long()):
        raise ValueError(
            f"{what}: g_idx is permuted (GPTQ act-order, desc_act=True): its groups are not "
            "contiguous runs of input columns, which the packed CPU blocks need; serve it on "
            "CUDA, or use a checkpoint quantized with desc_act=False"
        )


def repack(
    levels: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int, what: str
) -> PackedRows:
    """The weight as Q4_0 (every zero 8) or Q4_1 rows of 32-column blocks; `group_size` (a
    multiple of 32, or the whole row) is the run of input columns sharing a group."""
    out, in_features = levels.shape
    if group_size % 32 or in_features % group_size:
        raise ValueError(
            f"{what}: group_size {group_size} with {in_features} input features has no Q4 block "
            "form (the packed CPU kernels need groups of a multiple of 32 columns)"
        )
    if not torch.isfinite(scales).all() or scales.abs().max() > 65504:
        raise ValueError(f"{what}: scales are not finite f16 values")
    per = group_size // 32  # blocks per group
    d = scales.T.repeat_interleave(per, dim=1)  # [out, blocks]
    q = levels.to(torch.uint8).reshape(out, -1, 32)
    qs = q[..., :16] | (q[..., 16:] << 4)  # low nibbles: weights 0..15 of the block
    half = d.to(torch.float16).unsqueeze(-1).view(torch.uint8)  # [out, blocks, 2]
    if bool((zeros == 8).all()):
        blocks = torch.cat([half, qs], dim=-1)
        qtype = "Q4_0"
    else:
        z = zeros.T.repeat_interleave(per, dim=1).to(torch.float32)
        m = (-d * z).to(torch.float16).unsqueeze(-1).view(torch.uint8)
        blocks = torch.cat([half, m, qs], dim=-1)
        qtype = "Q4_1"
    return PackedRows(qtype, blocks.reshape(out, -1).contiguous(), in_features)
