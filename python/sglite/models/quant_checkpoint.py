"""Safetensors checkpoints quantized by their producer: the scheme in config.json's
`quantization_config`, and the checkpoint's tensors turned into what the layers load.

`read_scheme(hf_config)` validates the fields (a field that changes the math is implemented or
refused by name; fields sglite does not know are logged). `convert_weights` regroups the
stream of checkpoint tensors by layer and yields `<layer>.weight` once a layer's parts have
all arrived (the parts present are known from the checkpoint's names, read from the headers
first), one layer at a time:

| method    | a quantized layer's tensors                          | CPU                          | CUDA |
|-----------|------------------------------------------------------|------------------------------|------|
| w8a8_int8 | `weight` int8 `[out, in]`, `weight_scale` `[out, 1]` | `Int8Rows` (int8 GEMM)       | `Int8Rows` |
| fp8       | `weight` float8_e4m3fn, `weight_scale` (tensor / channel) or `weight_scale_inv` `[out/bn, in/bk]` (`weight_block_size`) | dequantized to --dtype | `Fp8Rows` (fp8_linear) |
| awq       | `qweight`, `qzeros`, `scales` (sglite.layers.quant_int4) | repacked to Q4_0 / Q4_1 `PackedRows` | `Int4Rows` (int4_linear) |
| gptq      | `qweight`, `qzeros`, `scales`, `g_idx`                | same (a permuted g_idx refused) | `Int4Rows` |

A layer without those parts (the LM head, `modules_to_not_convert`, `ignored_layers`) is
float in the checkpoint and stays float. fp8 `input_scale` tensors (`activation_scheme:
static`) are skipped: activations stay in --dtype in both modes (the dequantized-weight math).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from sglite.layers import quant_int4
from sglite.layers.quant_rows import Fp8Rows, Int4Rows, Int8Rows, fp8_dequantize

logger = logging.getLogger(__name__)

METHODS = ("w8a8_int8", "fp8", "awq", "gptq")
FAMILY_METHODS = ("mxfp4",)  # decoded by the model family itself (sglite.models.mxfp4)
# the parts of one quantized layer, and the one that marks a layer as quantized
_PARTS = {
    "w8a8_int8": (("weight", "weight_scale"), "weight_scale"),
    "fp8": (("weight", "weight_scale", "weight_scale_inv"), "weight"),
    "awq": (("qweight", "qzeros", "scales"), "qweight"),
    "gptq": (("qweight", "qzeros", "scales", "g_idx"), "qweight"),
}
# fields that do not change the math (runtime knobs of other engines, calibration records)
_INERT = {
    "quant_method", "modules_to_not_convert", "ignored_layers", "ignore", "do_fuse",
    "fuse_max_seq_len", "backend", "exllama_config", "use_exllama", "use_cuda_fp16",
    "damp_percent", "damp_auto_increment", "true_sequential", "static_groups", "sym",
    "model_name_or_path", "model_file_base_name", "tokenizer", "dataset", "batch_size",
    "pad_token_id", "max_input_length", "cache_block_outputs", "modules_in_block_to_quantize",
    "module_name_preceding_first_block", "meta", "quantizer", "activation_scheme", "fmt",
    "is_marlin_format", "desc_act", "bits", "w_bit", "group_size", "q_group_size",
    "zero_point", "version", "checkpoint_format", "weight_block_size", "lm_head", "dynamic",
    "pack_dtype", "format",
}  # fmt: skip


@dataclass(frozen=True)
class QuantScheme:
    """What the math of a checkpoint's quantized layers needs from quantization_config."""

    method: str
    group_size: int = -1  # awq / gptq: input columns per (scale, zero); -1: the whole row
    zero_offset: int = 0  # gptq v1 stores zero - 1
    block_size: tuple[int, int] | None = None  # fp8 weight_block_size


def _get(q: Any, name: str, default: Any = None) -> Any:
    value = q.get(name, default) if isinstance(q, dict) else getattr(q, name, default)
    return getattr(value, "value", value)  # transformers' enums


def quantization_config(hf_config: Any) -> Any:
    return getattr(hf_config, "quantization_config", None) if hf_config is not None else None


def checkpoint_method(hf_config: Any) -> str | None:
    """config.json's `quantization_config.quant_method` (lower case), or None."""
    q = quantization_config(hf_config)
    if q is None:
        return None
    method = _get(q, "quant_method")
    if not isinstance(method, str):
        raise ValueError(f"config.json quantization_config has no quant_method ({q!r})")
    return method.lower()


def _refuse(method: str, field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{method} checkpoint: quantization_config.{field}={value!r} {why}")


def _int4_scheme(method: str, q: Any) -> QuantScheme:
    bits = _get(q, "bits", _get(q, "w_bit", 4))
    if bits != 4:
        raise _refuse(method, "bits", bits, "is not supported (sglite reads 4-bit weights only)")
    group = int(_get(q, "group_size", _get(q, "q_group_size", -1)))
    if group != -1 and (group <= 0 or group % 8):
        raise _refuse(method, "group_size", group, "is not supported (a multiple of 8, or -1)")
    if method == "awq":
        version = str(_get(q, "version", "gemm")).lower()
        if version != "gemm":
            raise _refuse(
                method, "version", version, "is not supported (sglite reads AWQ's GEMM layout)"
            )
        if _get(q, "zero_point", True) is not True:
            raise _refuse(
                method,
                "zero_point",
                _get(q, "zero_point"),
                "is not supported (asymmetric AWQ with qzeros only)",
            )
        return QuantScheme(method, group)
    fmt = str(_get(q, "checkpoint_format", _get(q, "format", "gptq"))).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(method, "checkpoint_format", fmt, "is not supported (gptq or gptq_v2)")
    if _get(q, "lm_head", False):
        raise _refuse(method, "lm_head", True, "is not supported (a quantized LM head)")
    if _get(q, "dynamic", None):
        raise _refuse(
            method, "dynamic", _get(q, "dynamic"), "is not supported (per-module overrides)"
        )
    if str(_get(q, "pack_dtype", "int32")).removeprefix("torch.") != "int32":
        raise _refuse(
            method, "pack_dtype", _get(q, "pack_dtype"), "is not supported (int32 words only)"
        )
    if _get(q, "is_marlin_format", False):
        raise _refuse(
            method, "is_marlin_format", True, "is not supported (Marlin's repacked layout)"
        )
    return QuantScheme(method, group, zero_offset=1 if fmt == "gptq" else 0)


def read_scheme(hf_config: Any) -> QuantScheme:
    """The checkpoint's scheme; ValueError naming the field sglite cannot serve."""
    method = checkpoint_method(hf_config)
    if method not in METHODS:
        raise ValueError(
            f"quantization_config.quant_method {method!r}: one of {', '.join(METHODS)}"
        )
    q = quantization_config(hf_config)
    keys = set(q) if isinstance(q, dict) else set(vars(q))
    unknown = sorted(keys - _INERT)
    if unknown:
        logger.warning("%s checkpoint: quantization_config fields %s are not read", method, unknown)
    if method in ("awq", "gptq"):
        return _int4_scheme(method, q)
    if method == "fp8":
        fmt = str(_get(q, "fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise _refuse(method, "fmt", fmt, "is not supported (float8_e4m3fn weights only)")
        block = _get(q, "weight_block_size")
        if block is not None:
            if len(block) != 2 or min(block) <= 0:
                raise _refuse(method, "weight_block_size", block, "must be two positive sizes")
            block = (int(block[0]), int(block[1]))
        return QuantScheme(method, block_size=block)
    return QuantScheme(method)


def kernel_forms(device: torch.device) -> bool:
    """Whether the layers hold the checkpoint's tensors for the CUDA kernels (`Fp8Rows`,
    `Int4Rows`), else the CPU forms (fp8 dequantized, int4 repacked into GGUF blocks)."""
    return device.type != "cpu"


def _layer_parts(method: str, names: Iterable[str]) -> dict[str, set[str]]:
    """prefix -> the parts the checkpoint has, for every quantized layer."""
    parts, marker = _PARTS[method]
    found: dict[str, set[str]] = {}
    for name in names:
        prefix, _, part = name.rpartition(".")
        if part in parts:
            found.setdefault(prefix, set()).add(part)
    need_scale = method == "fp8"
    return {
        p: got
        for p, got in found.items()
        if marker in got and (not need_scale or got & {"weight_scale", "weight_scale_inv"})
    }


def convert_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
    names: Iterable[str],
    scheme: QuantScheme,
    *,
    device: torch.device,
    dtype: torch.dtype,
    packed: bool,
) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with each quantized layer's parts replaced by one
    `<layer>.weight`: rows for a packed model (`packed`), a float tensor in `dtype` otherwise
    (fp8 only). Everything else passes through as it is."""
    layers = _layer_parts(scheme.method, names)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if scheme.method == "fp8" and part == "input_scale":
            continue  # static activation scales: activations are not rounded to fp8 here
        if prefix not in layers or part not in layers[prefix]:
            yield name, tensor
            continue
        got = pending.setdefault(prefix, {})
        got[part] = tensor
        if set(got) == layers[prefix]:
            del pending[prefix]
            yield f"{prefix}.weight", _convert(scheme, prefix, got, device, dtype, packed)
    if pending:
        prefix, got = next(iter(pending.items()))
        missing = sorted(layers[prefix] - set(got))
        raise ValueError(f"{scheme.method} checkpoint: {prefix} lacks {missing}")


def _convert(scheme, prefix, t, device, dtype, packed):
    method, what = scheme.method, f"{scheme.method} layer {prefix}"
    if method == "w8a8_int8":
        w, s = t["weight"], t["weight_scale"].to(torch.float32).reshape(-1)
        if w.dtype != torch.int8:
            raise ValueError(f"{what}: weight is {w.dtype}, w8a8_int8 needs int8")
        return Int8Rows(w.to(device), s.to(device))
    if method == "fp8":
        return _fp8(scheme, what, t, device, dtype, packed)
    return _int4(scheme, what, t, device)


def _fp8(scheme, what, t, device, dtype, packed):
    w = t["weight"]
    if w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{what}: weight is {w.dtype}, fp8 needs float8_e4m3fn")
    block = scheme.block_size
    if "weight_scale_inv" in t:
        if block is None:
            raise ValueError(
                f"{what}: weight_scale_inv needs quantization_config.weight_block_size"
            )
        s = t["weight_scale_inv"].to(torch.float32)
        want = (-(-w.shape[0] // block[0]), -(-w.shape[1] // block[1]))
        if tuple(s.shape) != want:
            raise ValueError(
                f"{what}: weight_scale_inv {tuple(s.shape)}, blocks {block} of {tuple(w.shape)} need {want}"
            )
    else:
        s, block = t["weight_scale"].to(torch.float32), None
        if s.numel() not in (1, w.shape[0]):
            raise ValueError(
                f"{what}: weight_scale {tuple(s.shape)} is neither per tensor nor per row of {tuple(w.shape)}"
            )
        s = s.reshape(()) if s.numel() == 1 else s.reshape(-1)
    if not packed:  # one tensor at a time, in float32 only for this tensor
        return fp8_dequantize(w, s, block).to(dtype)
    return Fp8Rows(w.to(device), s.to(device), block)


def _int4(scheme, what, t, device):
    layout, qweight, scales = scheme.method, t["qweight"], t["scales"]
    qzeros = t.get("qzeros")
    in_features = qweight.shape[0] * (1 if layout == "awq" else 8)
    group = in_features if scheme.group_size == -1 else scheme.group_size
    if scales.dim() != 2 or scales.shape[0] * group != in_features:
        raise ValueError(
            f"{what}: scales {tuple(scales.shape)} do not hold groups of {group} of "
            f"{in_features} input features"
        )
    g_idx = t.get("g_idx")
    if g_idx is not None and len(g_idx) != in_features:
        raise ValueError(f"{what}: g_idx has {len(g_idx)} entries for {in_features} inputs")
    trivial = g_idx is None or torch.equal(
        g_idx.to(torch.int64), quant_int4.default_g_idx(in_features, group).long()
    )
    if not kernel_forms(device):
        levels, zeros, s = quant_int4.unpack(
            layout, qweight, qzeros, scales, zero_offset=scheme.zero_offset
        )
        if not trivial:
            quant_int4.check_g_idx(g_idx, group, what)
        return quant_int4.repack(levels, zeros, s, group, what)
    if layout == "gptq" and qzeros is not None and scheme.zero_offset == 0:
        zeros = quant_int4.unpack_int32(qzeros)  # gptq_v2 -> the v1 storage int4_linear reads
        if bool((zeros == 0).any()):
            raise ValueError(f"{what}: a gptq_v2 zero of 0 has no v1 form for the CUDA kernel")
        qzeros = quant_int4.pack_int32(zeros - 1)
    return Int4Rows(
        layout, qweight.to(device), scales.to(device),
        None if qzeros is None else qzeros.to(device), group,
        None if trivial else g_idx.to(device=device, dtype=torch.int32),
    )  # fmt: skip
