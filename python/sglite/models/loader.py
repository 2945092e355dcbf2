"""Checkpoint loading: find the HF folder, read its safetensors, build the model on a device.

A model path is an HF folder (config.json, model.safetensors or shards listed in
model.safetensors.index.json, tokenizer files), a `.gguf` file, which is converted once to
an HF folder in the cache (see sglite.models.gguf), or a Hugging Face repo id, resolved to
its snapshot in the local Hub cache (downloaded when missing; see sglite.models.hub). The
server resolves repo ids and converts .gguf files once, in its main process
(launcher.resolve_model), so its children only see folders.
A converted .gguf folder holds no weights: they are read from the .gguf by mmap, kept packed
or dequantized as `--quantization` says (sglite.quantization, sglite.models.gguf.weights).
Weights load with a progress bar over the checkpoint's tensors, then the load time is logged.
Under tensor parallelism each rank reads the checkpoint itself and its layers' weight
loaders narrow every tensor to the rank's shard: one full tensor at a time is in memory
beside the rank's shard of the model, never a full copy of the model. Under expert
parallelism a rank does not read the per-expert tensors of other ranks' experts at all
(`skips_tensor`; a fused `[E, ...]` expert tensor is read whole, then narrowed).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from sglite.distributed import NULL_TP_GROUP, TPGroup
from sglite.models.model_config import ModelConfig
from sglite.models.registry import get_model_class

logger = logging.getLogger(__name__)


def resolve_model_path(
    model_path: str | Path | None, *, revision: str | None = None, trust_remote_code: bool = False
) -> Path:
    """The HF folder to load: the given folder, a converted .gguf, the snapshot of a Hub
    repo id, or the default SmolLM2."""
    from sglite.models import gguf, hub

    if model_path is None:
        return gguf.default_model_path()
    path = Path(model_path).expanduser()
    if gguf.is_gguf_file(path):
        return gguf.convert_gguf_to_hf(path)
    if path.is_dir():
        return path
    if not path.exists() and hub.looks_like_repo_id(str(model_path)):
        return hub.resolve_repo(
            str(model_path), revision=revision, trust_remote_code=trust_remote_code
        )
    raise FileNotFoundError(
        f"model path {str(model_path)!r} is neither a folder, a .gguf file nor a Hugging Face "
        "repo id (org/name); pass a local HF folder (config.json, *.safetensors)"
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


def iter_weights(
    path: Path, progress: bool = False, skip: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of the checkpoint but those `skip(name)` is true of (never read:
    another expert-parallel rank's experts); with `progress`, a progress bar over the
    tensors (on stderr) that names the shard being read."""
    from safetensors import safe_open
    from tqdm import tqdm

    files = safetensors_files(path)
    size = sum(f.stat().st_size for f in files)
    logger.info(
        "loading weights: %d safetensors shard(s), %.2f GiB, from %s",
        len(files),
        size / 2**30,
        path,
    )
    total = 0
    for file in files:  # headers only: the bar knows its total from the start
        with safe_open(str(file), framework="pt", device="cpu") as f:
            total += len(f.keys())
    # a process-local lock: tqdm's default is a multiprocessing semaphore, which the resource
    # tracker reports as leaked when the server stops the scheduler process with a signal
    tqdm.set_lock(threading.RLock())
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for i, file in enumerate(files):
            bar.set_postfix_str(f"shard {i + 1}/{len(files)}", refresh=False)
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if skip is None or not skip(name):
                        yield name, f.get_tensor(name)
                    bar.update(1)


def load_model(
    path: Path,
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    tp_group: TPGroup = NULL_TP_GROUP,
    ep_size: int = 1,
    quantization: str | None = None,
    quant_kernel: str = "int16",
) -> nn.Module:
    """Instantiate the registered class for `config.architecture` and load its weights
    (this rank's shard of them when `tp_group` has more than one rank; with `ep_size` > 1,
    only this rank's experts are read); `quantization` as
    `--quantization` (sglite.quantization.resolve), `quant_kernel` as `--quant-kernel`."""
    from sglite import quantization as quant
    from sglite.models.gguf.weights import gguf_source, iter_gguf_weights
    from sglite.models.quant_checkpoint import checkpoint_method

    start = time.perf_counter()
    model_cls = get_model_class(config.architecture)
    source = gguf_source(path)
    method = None if source is not None else checkpoint_method(config.hf_config)
    mode = quant.resolve(
        quantization, is_gguf=source is not None, device_type=device.type, checkpoint_method=method
    )
    if mode in quant.CHECKPOINT_METHODS:
        model = _load_quantized(path, config, mode, model_cls, dtype, device, tp_group, ep_size)
        quant.set_kernel(model, quant_kernel)
        model.eval()
        logger.info(
            "loaded the weights (%s, %s, %s checkpoint) in %.1f s",
            config.architecture,
            dtype,
            mode,
            time.perf_counter() - start,
        )
        return model
    progress = tp_group.rank == 0
    if mode == "gguf":
        from sglite.models.causal_lm import DecoderForCausalLM

        why = "it has no packed form"
        if issubclass(model_cls, DecoderForCausalLM):
            why = model_cls.packed_unsupported(config)
        if why is not None and quantization == "gguf":
            raise ValueError(
                f"--quantization gguf: {config.architecture}: {why}; use --quantization none"
            )
        if why is not None:
            logger.info("%s: %s; dequantizing the GGUF at load", config.architecture, why)
            mode = "none"
    if mode == "gguf":
        model = model_cls(
            config, dtype=dtype, device=device, tp_group=tp_group, ep_size=ep_size, packed=True
        )
        quant.set_kernel(model, quant_kernel)
        weights = iter_gguf_weights(source, packed=True, progress=progress)
    else:
        model = model_cls(config, dtype=dtype, device=device, tp_group=tp_group, ep_size=ep_size)
        if source is not None:
            weights = iter_gguf_weights(source, packed=False, progress=progress)
        else:
            weights = iter_weights(path, progress=progress, skip=model.skips_tensor)
    model.load_weights(weights)
    model.eval()
    logger.info(
        "loaded the weights (%s, %s%s) in %.1f s",
        config.architecture,
        dtype,
        ", GGUF blocks kept packed" if mode == "gguf" else "",
        time.perf_counter() - start,
    )
    return model


def checkpoint_names(path: Path) -> list[str]:
    """Every tensor name of the checkpoint (headers only)."""
    from safetensors import safe_open

    names: list[str] = []
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names += list(f.keys())
    return names


def _load_quantized(path, config, method, model_cls, dtype, device, tp_group, ep_size):
    """A safetensors checkpoint quantized by `method` (sglite.models.quant_checkpoint): the
    linear layers packed (fp8 on CPU, or where the model has no packed form: dequantized at
    load), embeddings and head float."""
    from sglite.models import quant_checkpoint as qc
    from sglite.models.causal_lm import DecoderForCausalLM

    scheme = qc.read_scheme(config.hf_config)
    packed = method != "fp8" or qc.kernel_forms(device)
    why = "it has no packed form"
    if issubclass(model_cls, DecoderForCausalLM):
        why = model_cls.packed_unsupported(config)
    if packed and why is not None:
        if method != "fp8":
            raise ValueError(f"--quantization {method}: {config.architecture}: {why}")
        logger.info("%s: %s; dequantizing the fp8 weights at load", config.architecture, why)
        packed = False
    kw = dict(dtype=dtype, device=device, tp_group=tp_group, ep_size=ep_size)
    if packed:
        model = model_cls(config, **kw, packed=True, packed_embedding=False)
    else:
        model = model_cls(config, **kw)
    progress = tp_group.rank == 0
    weights = iter_weights(path, progress=progress, skip=model.skips_tensor)
    names = checkpoint_names(path)
    model.load_weights(
        qc.convert_weights(weights, names, scheme, device=device, dtype=dtype, packed=packed)
    )
    return model
