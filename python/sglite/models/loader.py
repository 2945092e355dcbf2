"""Checkpoint loading: find the HF folder, read its safetensors, build the model on a device.

A model path is an HF folder (config.json, model.safetensors or shards listed in
model.safetensors.index.json, tokenizer files) or a `.gguf` file, which is converted once to
an HF folder in the cache (see sglite.models.gguf). Nothing is downloaded.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from sglite.models.model_config import ModelConfig
from sglite.models.registry import get_model_class

logger = logging.getLogger(__name__)


def resolve_model_path(model_path: str | Path | None) -> Path:
    """The HF folder to load: the given folder, a converted .gguf, or the default SmolLM2."""
    from sglite.models import gguf

    if model_path is None:
        return gguf.default_model_path()
    path = Path(model_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf.convert_gguf_to_hf(path)
    if path.is_dir():
        return path
    raise FileNotFoundError(
        f"model path {str(model_path)!r} is neither a folder nor a .gguf file; sglite does not "
        "download models, pass a local Hugging Face folder (config.json, *.safetensors)"
    )


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / name for name in weight_map.values()})
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{path}: shards listed in the index are missing: {missing}")
    return files


def iter_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def load_model(
    path: Path, config: ModelConfig, *, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """Instantiate the registered class for `config.architecture` and load its weights."""
    start = time.perf_counter()
    model_cls = get_model_class(config.architecture)
    model = model_cls(config, dtype=dtype, device=device)
    model.load_weights(iter_weights(path))
    model.eval()
    logger.info(
        "loaded %s (%s, %s) in %.1fs",
        path.name,
        config.architecture,
        dtype,
        time.perf_counter() - start,
    )
    return model
