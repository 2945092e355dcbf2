"""--quantization: how a checkpoint's weights are held, and the choice for each kind of input.

| value  | input          | weights in memory                                          |
|--------|----------------|------------------------------------------------------------|
| (none given) | .gguf    | on CPU as `gguf`; on CUDA as `none` (dequantized at load)   |
| (none given) | HF folder | the checkpoint's `quantization_config.quant_method` (below) when config.json has one, else its floats in --dtype |
| gguf   | .gguf, CPU     | the file's blocks by mmap: linear layers, embedding and LM head packed (sglite.layers.quant_*), native GEMV/GEMM kernels |
| none   | any unquantized | floats in --dtype; a .gguf dequantized from the file at load |
| w8a8_int8 | HF folder, `quant_method: w8a8_int8` | int8 weights per output channel, activations rounded to int8 per token, int8 x int8 -> int32 GEMM (`torch._int_mm`) |
| fp8    | HF folder, `quant_method: fp8` | CPU: dequantized to --dtype at load, one tensor at a time; CUDA: float8_e4m3fn kept, `fp8_linear` (per-tensor, per-channel or [128, 128]-block scales) |
| awq    | HF folder, `quant_method: awq` | CPU: int4 groups repacked at load into GGUF Q4_1 (Q4_0 when symmetric) blocks, the native kernels; CUDA: the checkpoint's tensors, `int4_linear` |
| gptq   | HF folder, `quant_method: gptq` | the same as awq (a permuted g_idx, desc_act, CUDA only) |

For the safetensors methods (sglite.models.quant_checkpoint) only the linear layers are
quantized; embeddings, LM head and norms are floats, as in the checkpoint. An explicit
`--quantization` that disagrees with the checkpoint's `quant_method` is an error naming both;
sglite does not quantize a float checkpoint at load. `--dtype` applies to the activations
(and the KV cache) in every mode. `--quant-kernel` (packed GGUF blocks, so also awq / gptq on
CPU): `int16` (default) repacks each weight once into panels of 16 rows and rounds the
activations to 16-bit integer levels per 32 values for integer dot products (within ~3e-5 of
the exact product: the dequantized model's greedy tokens); `int8` rounds them to int8 as
llama.cpp does (faster prefill, llama.cpp's rounding error); `auto` is int8's former name;
`exact` multiplies float32 activations by the file's blocks dequantized in registers (the
reference: the dequantized model's logits within float rounding, 2-5x slower). `resolve` is the one place that turns the flag, the input, the
checkpoint's method and the device into the mode the loader uses; a combination it cannot
serve is a ValueError naming the flag.
"""

from __future__ import annotations

QUANTIZATIONS = ("gguf", "none", "w8a8_int8", "fp8", "awq", "gptq")
CHECKPOINT_METHODS = ("w8a8_int8", "fp8", "awq", "gptq")  # sglite.models.quant_checkpoint
FAMILY_METHODS = ("mxfp4",)  # a model family decodes these itself (gpt-oss's experts)
QUANT_KERNELS = ("int16", "int8", "exact", "auto")
KERNEL_HELP = (
    "Kernels of --quantization gguf (and awq / gptq on CPU, repacked into GGUF blocks). int16 "
    "(default): the weights repacked at load into panels of 16 rows, activations rounded to "
    "16-bit levels per 32 values (within ~3e-5 of the exact product, so the dequantized "
    "model's greedy tokens); int8: the same panels with int8 activations as llama.cpp (faster "
    "prefill, but llama.cpp's rounding error, which changes answers of small models); auto: "
    "int8's former name; exact: float32 activations on the file's blocks (the reference; "
    "2-5x slower)."
)
HELP = (
    "How the weights are held. gguf: a .gguf model's blocks stay as the file has them (mmap; "
    "native CPU kernels for Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K, Q6_K; default for .gguf on "
    "CPU). none: floats in --dtype (a .gguf dequantized at load; the default for other "
    "checkpoints and for .gguf on CUDA). w8a8_int8, fp8, awq, gptq: a safetensors checkpoint "
    "quantized that way (the default when its config.json's quantization_config names it; a "
    "flag that disagrees is an error): w8a8_int8 int8 weights and per-token int8 activations; "
    "fp8 e4m3 weights (dequantized at load on CPU); awq / gptq 4-bit groups (repacked into "
    "Q4_0/Q4_1 blocks on CPU). --dtype sets the activations' dtype either way."
)


def resolve(
    quantization: str | None,
    *,
    is_gguf: bool,
    device_type: str,
    checkpoint_method: str | None = None,
) -> str:
    """The mode the loader uses: `gguf` (packed), `none` (float weights) or one of
    CHECKPOINT_METHODS; `checkpoint_method` is config.json's quant_method (None: unquantized)."""
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"--quantization {quantization!r}: one of {', '.join(QUANTIZATIONS)}")
    if checkpoint_method is not None and not is_gguf:
        return _checkpoint_mode(quantization, checkpoint_method)
    if quantization in CHECKPOINT_METHODS:
        where = "a .gguf file" if is_gguf else "this checkpoint (its config.json has none)"
        raise ValueError(
            f"--quantization {quantization} serves a safetensors checkpoint whose config.json "
            f"has quantization_config.quant_method {quantization!r}; {where} is not one "
            "(sglite does not quantize weights at load)"
        )
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


def _checkpoint_mode(quantization: str | None, method: str) -> str:
    if method in FAMILY_METHODS:  # the family decodes it at load: float weights
        if quantization not in (None, "none"):
            raise ValueError(
                f"--quantization {quantization} disagrees with the checkpoint's "
                f"quantization_config.quant_method {method!r} (decoded by its model family; "
                "leave --quantization out)"
            )
        return "none"
    if method not in CHECKPOINT_METHODS:
        raise ValueError(
            f"the checkpoint's quantization_config.quant_method {method!r} is not supported; "
            f"sglite serves {', '.join(CHECKPOINT_METHODS)} checkpoints"
        )
    if quantization not in (None, method):
        raise ValueError(
            f"--quantization {quantization} disagrees with the checkpoint's "
            f"quantization_config.quant_method {method!r}; leave --quantization out or pass "
            f"{method}"
        )
    return method


def set_kernel(model, kernel: str) -> int:
    """Point every packed layer of `model` at `kernel` (QUANT_KERNELS); returns how many."""
    if kernel not in QUANT_KERNELS:
        raise ValueError(f"--quant-kernel {kernel!r}: one of {', '.join(QUANT_KERNELS)}")
    layers = [m.packed for m in model.modules() if hasattr(m, "packed")]
    for packed in layers:
        packed.kernel = "int8" if kernel == "auto" else kernel
    return len(layers)
