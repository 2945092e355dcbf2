"""--quantization: how a checkpoint's weights are held, and the choice for each kind of input.

| value  | input          | weights in memory                                          |
|--------|----------------|------------------------------------------------------------|
| (none given) | .gguf    | on CPU as `gguf`; on CUDA as `none` (dequantized at load)   |
| (none given) | HF folder | the checkpoint's floats in --dtype                        |
| gguf   | .gguf, CPU     | the file's blocks by mmap: linear layers, embedding and LM head packed (sglite.layers.quant_*), native GEMV/GEMM kernels |
| none   | any            | floats in --dtype; a .gguf dequantized from the file at load |

`--dtype` applies to the activations (and the KV cache) in every mode. `--quant-kernel`
(packed mode): `auto` rounds the activations to int8 per 32 values for integer dot
products, as llama.cpp does (the fastest kernels: see sglite.layers.quant_kernels);
`exact` multiplies float32 activations by the dequantized blocks, which gives the dequantized
model's logits within float rounding (same GEMV speed at decode batch 1-4, about 3x slower
tiles for prefill and larger batches). `resolve` is the one
place that turns the flag, the input and the device into the mode the loader uses; a
combination it cannot serve is a ValueError naming the flag.
"""

from __future__ import annotations

QUANTIZATIONS = ("gguf", "none")
QUANT_KERNELS = ("exact", "auto")
KERNEL_HELP = (
    "Kernels of --quantization gguf. exact (default): float32 activations on the "
    "dequantized blocks (the dequantized model's numbers within float rounding, so the same "
    "greedy tokens as transformers on the GGUF); auto: int8 activations (per 32 values, as "
    "llama.cpp), ~3x faster prefill and batched decode, the same decode speed up to 4 rows, "
    "but llama.cpp's rounding error (it changes answers of small models)."
)
HELP = (
    "How the weights are held. gguf: a .gguf model's blocks stay as the file has them (mmap; "
    "native CPU kernels for Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K, Q6_K; default for .gguf on "
    "CPU). none: floats in --dtype (a .gguf dequantized at load; the default for other "
    "checkpoints and for .gguf on CUDA). --dtype sets the activations' dtype either way."
)


def resolve(quantization: str | None, *, is_gguf: bool, device_type: str) -> str:
    """The mode the loader uses: `gguf` (packed) or `none` (float weights)."""
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"--quantization {quantization!r}: one of {', '.join(QUANTIZATIONS)}")
    if quantization is None:
        return "gguf" if is_gguf and device_type == "cpu" else "none"
    if quantization == "gguf":
        if not is_gguf:
            raise ValueError("--quantization gguf needs a .gguf --model-path")
        if device_type != "cpu":
            raise ValueError(
                f"--quantization gguf runs on CPU (packed kernels); on {device_type} use "
                "--quantization none (the GGUF dequantized at load)"
            )
    return quantization


def set_kernel(model, kernel: str) -> int:
    """Point every packed layer of `model` at `kernel` (QUANT_KERNELS); returns how many."""
    if kernel not in QUANT_KERNELS:
        raise ValueError(f"--quant-kernel {kernel!r}: one of {', '.join(QUANT_KERNELS)}")
    layers = [m.packed for m in model.modules() if hasattr(m, "packed")]
    for packed in layers:
        packed.kernel = None if kernel == "auto" else kernel
    return len(layers)
