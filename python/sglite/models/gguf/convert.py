"""convert_gguf_to_hf: a .gguf file -> a cached HF folder (configs, tokenizer), built once.

The folder serves the file: its weights stay in the .gguf, which the scheduler's loader maps
and reads (packed or dequantized, sglite.models.gguf.weights; the folder names the file in
`weights.SOURCE_FILE`). `weights=True` builds the other kind, a self-contained HF folder
with the weights dequantized to float32 safetensors (the reference model of the tests, and a
way to hand the dequantized model to transformers).

The folder is `sglite.env.cache_dir()/gguf/<stem>-<size>-<mtime_ns>-v<CONVERTER_VERSION>`
(`-f32` appended with weights): a changed file or converter gets a new folder. It is built
under a temporary name and renamed into place, so processes starting at the same time never
see half a folder (the loser of the rename race uses the winner's). Everything that can
refuse the file (architecture, tensor names and types, metadata, tokenizer) is checked
before the first tensor is read. Float weights are dequantized one tensor at a time and
written in shards of at most SHARD_BYTES, so memory holds one shard, not the model.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from sglite import env
from sglite.models.gguf.archs import TensorPlan, mapping_for, plan_tensors, unpermute_rows
from sglite.models.gguf.hf_config import generation_config, hf_config
from sglite.models.gguf.reader import GGUFFile
from sglite.models.gguf.tokenizer import check_tokenizer, write_tokenizer
from sglite.models.gguf.weights import write_source

logger = logging.getLogger(__name__)

# bump when the folder's content changes for the same file (cached folders are then rebuilt)
CONVERTER_VERSION = 3
SHARD_BYTES = 2 << 30
_COMPLETE = ".sglite-complete"


def is_gguf_file(path: str | Path) -> bool:
    p = Path(path).expanduser()
    return p.suffix == ".gguf" and p.is_file()


def converted_folder(
    gguf_path: str | Path, cache_root: Path | None = None, *, weights: bool = False
) -> Path:
    """Where `gguf_path`'s converted folder is (or will be) cached."""
    path = Path(gguf_path)
    stat = path.stat()
    stamp = f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}-v{CONVERTER_VERSION}"
    return (cache_root or env.cache_dir()) / "gguf" / (stamp + ("-f32" if weights else ""))


def convert_gguf_to_hf(
    gguf_path: str | Path, cache_root: Path | None = None, *, weights: bool = False
) -> Path:
    """The HF folder of a .gguf file, converted on first use: config and tokenizer, the
    weights read from the file at load; with `weights`, float32 safetensors of them too.
    Raises UnsupportedGGUF (a ValueError naming what is unsupported) for a file it cannot
    convert."""
    gguf_path = Path(gguf_path)
    out = converted_folder(gguf_path, cache_root, weights=weights)
    if (out / _COMPLETE).is_file():
        logger.info("using %s converted from %s", out, gguf_path.name)
        return out
    if out.exists():  # left by a crashed or foreign writer: rebuild it
        shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    start = time.perf_counter()
    try:
        _convert(gguf_path, tmp, weights)
        (tmp / _COMPLETE).write_text(str(gguf_path))
        try:
            os.rename(tmp, out)
        except OSError:  # another process finished first
            if not (out / _COMPLETE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = sum(f.stat().st_size for f in out.iterdir())
    logger.info(
        "converted %s in %.1f s: %s (%.2f GiB)",
        gguf_path.name, time.perf_counter() - start, out, size / 2**30,
    )  # fmt: skip
    return out


def _convert(gguf_path: Path, out: Path, weights: bool) -> None:
    gguf = GGUFFile(gguf_path)
    mapping = mapping_for(gguf)
    gguf.check_tensor_types()
    check_tokenizer(gguf)
    config = hf_config(gguf, mapping)
    plans = plan_tensors(gguf, mapping)
    logger.info(
        "converting %s (GGUF %s -> %s, %d tensors) to an HF folder%s, once",
        gguf_path.name, gguf.arch, mapping.hf_architecture, len(plans),
        " with float32 weights" if weights else "",
    )  # fmt: skip
    logger.info(
        "converting %s: the tokenizer (%d tokens)",
        gguf_path.name, len(gguf.get("tokenizer.ggml.tokens")),
    )  # fmt: skip
    template = write_tokenizer(gguf, out, config["max_position_embeddings"])
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config(gguf, template))
    if weights:
        write_weights(gguf, plans, out)
    else:
        write_source(out, gguf_path)


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def load_tensor(gguf: GGUFFile, plan: TensorPlan) -> Any:
    """One HF tensor (float32 torch) from its plan: dequantize, un-permute, offset."""
    import numpy as np
    import torch

    w = gguf.dequantize(plan.gguf_name)
    if plan.permute_heads is not None:
        w = unpermute_rows(w, plan.permute_heads)
    if plan.offset:
        w = w + np.float32(plan.offset)
    if plan.as_row:
        w = w.reshape(1, -1)
    return torch.from_numpy(np.require(w, requirements=["C", "W"]))


def hf_tensors(gguf: GGUFFile, plan: TensorPlan) -> list[tuple[str, Any]]:
    """(HF name, tensor) of a plan: one, or one per expert of a stacked expert tensor."""
    t = load_tensor(gguf, plan)
    if not plan.per_expert:
        return [(plan.hf_name, t)]
    return [(name, t[e].clone()) for e, name in enumerate(plan.hf_names(t.shape[0]))]


def write_weights(gguf: GGUFFile, plans: list[TensorPlan], out: Path) -> None:
    """Dequantize every planned tensor into safetensors shards of at most SHARD_BYTES
    (`model.safetensors` when one shard holds them all, else numbered shards and an index)."""
    from safetensors.torch import save_file

    shard_names: list[list[str]] = []
    shard: dict[str, Any] = {}
    shard_bytes = total_bytes = 0

    def flush() -> None:
        save_file(shard, str(out / f".shard-{len(shard_names)}"), metadata={"format": "pt"})
        shard_names.append(list(shard))
        shard.clear()

    for i, plan in enumerate(plans, 1):
        for name, t in hf_tensors(gguf, plan):
            nbytes = t.numel() * t.element_size()
            if shard and shard_bytes + nbytes > SHARD_BYTES:
                flush()
                shard_bytes = 0
            shard[name] = t
            shard_bytes += nbytes
            total_bytes += nbytes
        if i == len(plans) or i % max(1, len(plans) // 4) == 0:
            logger.info("converting %s: %d/%d tensors", gguf.path.name, i, len(plans))
    flush()
    if len(shard_names) == 1:
        (out / ".shard-0").rename(out / "model.safetensors")
        return
    weight_map = {}
    for i, names in enumerate(shard_names):
        file = f"model-{i + 1:05d}-of-{len(shard_names):05d}.safetensors"
        (out / f".shard-{i}").rename(out / file)
        weight_map.update(dict.fromkeys(names, file))
    _write_json(
        out / "model.safetensors.index.json",
        {"metadata": {"total_size": total_bytes}, "weight_map": weight_map},
    )
