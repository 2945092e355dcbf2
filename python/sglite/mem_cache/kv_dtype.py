"""The KV cache's storage dtype: the `--kv-cache-dtype` names, the cast of writes, row copies.

`--kv-cache-dtype` takes SGLang's values: `auto` (the model's dtype, `--dtype`), `bf16` /
`bfloat16`, `fp8_e4m3` (torch.float8_e4m3fn: 4 exponent bits, 3 mantissa bits, finite max
448, no infinities) and `fp8_e5m2` (torch.float8_e5m2: max 57344). The pool stores that
dtype; attention reads K/V converted to its compute dtype (the model's: float32 on CPU by
default), so the math is the same and only the stored values are rounded.

fp8 writes have no scale (scale 1.0: what SGLang does when no scale file is given) and
saturate: a value beyond the format's finite max is stored as +-max, not as inf (e5m2) or
NaN, so one outlier cannot poison the softmax of every later token. K and V after the
projections and rope stay well inside both ranges for the models served here (the demo
model's largest |K| is ~20); what fp8 costs is mantissa bits: e4m3 keeps ~2 significant
decimal digits, e5m2 ~1.5.

torch has no CPU `index_copy_` for the float8 types (and SGLang stores them as uint8 for
the same reason on CUDA), so every scatter of pool rows goes through `copy_rows`, which
moves 1-byte floats as their bytes. The buffers themselves keep the float8 dtype, so the
file tier's page header (one dtype per buffer) tells e4m3 from e5m2.
"""

from __future__ import annotations

import torch

# --kv-cache-dtype -> the stored dtype (None: the model's)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def resolve_kv_cache_dtype(name: str | torch.dtype | None, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a pool stores for `--kv-cache-dtype name` under a model of `model_dtype`."""
    if isinstance(name, torch.dtype):
        return name
    if name is None:
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype: must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}"
        )
    return KV_CACHE_DTYPES[name] or model_dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def to_store(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as the pool stores it: fp8 saturated to the format's finite max (no scale)."""
    if x.dtype == dtype:
        return x
    if is_fp8(dtype):
        top = torch.finfo(dtype).max
        return x.clamp(-top, top).to(dtype)  # NaN stays NaN
    return x.to(dtype)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def copy_rows(dst: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> None:
    """`dst[idx] = rows` along dim 0 (`index_copy_`), for every pool dtype (fp8 included);
    `rows` must already have `dst`'s dtype."""
    if rows.dtype != dst.dtype:
        raise ValueError(f"copy_rows: rows are {rows.dtype}, the buffer {dst.dtype}")
    _as_bytes(dst).index_copy_(0, idx, _as_bytes(rows))
