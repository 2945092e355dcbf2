"""GGUF checkpoints: converted once into an HF folder in the cache, then loaded like any other.

    from sglite.models.gguf import convert_gguf_to_hf
    folder = convert_gguf_to_hf("model.gguf")  # config.json, model.safetensors, tokenizer

The server converts a `--model-path X.gguf` in its main process, before any child starts,
so every process sees the folder. Modules: `reader` (the file, its metadata and checks),
`archs` (GGUF -> HF tensor names and transforms per architecture), `hf_config` (metadata ->
config.json), `tokenizer` (the tokenizer files, through transformers' GGUF support),
`convert` (dequantize, write, cache), `demo` (the bundled SmolLM2 GGUF).
"""

from sglite.models.gguf.archs import ARCHS
from sglite.models.gguf.convert import (
    CONVERTER_VERSION,
    convert_gguf_to_hf,
    converted_folder,
    is_gguf_file,
)
from sglite.models.gguf.demo import (
    INSTALL_HINT,
    SMOLLM2_FILE,
    default_model_path,
    smollm2_gguf_path,
)
from sglite.models.gguf.reader import GGUFFile, UnsupportedGGUF, supported_tensor_types

__all__ = [
    "ARCHS",
    "CONVERTER_VERSION",
    "INSTALL_HINT",
    "SMOLLM2_FILE",
    "GGUFFile",
    "UnsupportedGGUF",
    "convert_gguf_to_hf",
    "converted_folder",
    "default_model_path",
    "is_gguf_file",
    "smollm2_gguf_path",
    "supported_tensor_types",
]
