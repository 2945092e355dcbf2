"""A converted GGUF folder's weights, read from the .gguf by mmap at load: packed or dequantized.

`convert_gguf_to_hf` writes config and tokenizer only, plus `SOURCE_FILE` naming the .gguf
(`gguf_source(folder)` reads it back). The model loader then takes each tensor from the file
through `iter_gguf_weights`, by the transformers name `archs.plan_tensors` gives it:

- `packed=True`: a 2-D tensor in a block type the native kernels know (Q8_0, Q4_0/1,
  Q5_0/1, Q4_K, Q5_K, Q6_K) is `PackedRows`, a zero-copy view of the mapped file (llama's Q
  and K rows un-permuted into a copy of just those rows, read with a plain read so that
  their file pages are not mapped besides); other 2-D tensors (F32, F16, BF16,
  other block types) are `DenseRows`, dequantized once; 1-D tensors (norms, biases) are
  float32 tensors. The packed layers (sglite.layers.quant_linear, quant_embedding) take the
  rows; nothing else of the model is materialised, so the load's peak RSS is about the
  file's size.
- `packed=False`: every tensor dequantized to float32, one at a time (the float model, as
  the fp32 safetensors folder of `convert_gguf_to_hf(..., weights=True)` holds it). Stacked
  expert tensors (qwen2moe, qwen3moe) are always float, one per expert (MoE models load
  with `packed=False`: sglite.models.causal_lm `packed_unsupported`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from sglite.models.gguf.archs import TensorPlan, mapping_for, plan_tensors, unpermute_rows
from sglite.models.gguf.reader import GGUFFile

logger = logging.getLogger(__name__)

SOURCE_FILE = "sglite_gguf.json"


def gguf_source(folder: Path) -> Path | None:
    """The .gguf a converted folder reads its weights from, or None for a folder with its own."""
    link = Path(folder) / SOURCE_FILE
    if not link.is_file():
        return None
    path = Path(json.loads(link.read_text())["gguf_path"])
    if not path.is_file():
        raise FileNotFoundError(
            f"{folder} was converted from {path}, which is gone; pass the .gguf again"
        )
    return path


def write_source(folder: Path, gguf_path: Path) -> None:
    (folder / SOURCE_FILE).write_text(json.dumps({"gguf_path": str(gguf_path.resolve())}) + "\n")


def hf_tensors(gguf: GGUFFile, plan: TensorPlan) -> list[tuple[str, Any]]:
    from sglite.models.gguf.convert import hf_tensors as split

    return split(gguf, plan)


def _float_tensor(gguf: GGUFFile, plan: TensorPlan) -> Any:
    """float32, as `convert.load_tensor` (gguf-py) makes it; the block types the native
    kernels know are dequantized by them (the same values, bit for bit, many times faster)."""
    from sglite.layers import quant_kernels
    from sglite.layers.quant_formats import QUANT_TYPES
    from sglite.models.gguf.convert import load_tensor

    info = gguf.tensors[plan.gguf_name]
    native = quant_kernels.unavailable_reason() is None
    if len(info.shape) != 2 or info.type_name not in QUANT_TYPES or not native:
        return load_tensor(gguf, plan)
    rows = _packed_tensor(gguf, plan)
    w = quant_kernels.dequantize(rows.qtype, rows.data, rows.in_features)
    return w + plan.offset if plan.offset else w


def _packed_tensor(gguf: GGUFFile, plan: TensorPlan) -> Any:
    import torch

    from sglite.layers.quant_formats import QUANT_TYPES
    from sglite.layers.quant_linear import DenseRows, PackedRows

    info = gguf.tensors[plan.gguf_name]
    if len(info.shape) != 2:  # norms and biases
        return _float_tensor(gguf, plan)
    if info.type_name not in QUANT_TYPES:
        return DenseRows(_float_tensor(gguf, plan), info.type_name)
    if plan.permute_heads is None:
        return PackedRows.from_buffer(info.type_name, gguf.raw(plan.gguf_name), info.shape)
    # Read past the mapping (np.fromfile), so the file's pages of these rows do not count in
    # this process's RSS next to the un-permuted copy (7B: 0.6 GiB of Q and K).
    raw = np.fromfile(gguf.path, dtype=np.uint8, count=info.nbytes, offset=info.start)
    rows = PackedRows.from_buffer(info.type_name, raw, info.shape)
    index = unpermute_rows(torch.arange(rows.num_rows), plan.permute_heads)
    return rows.take_rows(index)


def iter_gguf_weights(
    gguf_path: Path, *, packed: bool, progress: bool = False
) -> Iterator[tuple[str, Any]]:
    """(transformers name, tensor or rows) for every weight of the file."""
    from tqdm import tqdm

    gguf = GGUFFile(gguf_path)
    plans = plan_tensors(gguf, mapping_for(gguf))
    size = gguf.path.stat().st_size
    logger.info(
        "loading weights from %s (%.2f GiB, %d tensors), %s",
        gguf.path.name, size / 2**30, len(plans),
        "kept packed" if packed else "dequantized to float32",
    )  # fmt: skip
    tqdm.set_lock(threading.RLock())  # see models.loader.iter_weights
    read = _packed_tensor if packed else _float_tensor
    with tqdm(total=len(plans), desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for plan in plans:
            if plan.per_expert:  # a stacked expert tensor: one float tensor per expert
                yield from hf_tensors(gguf, plan)
            else:
                yield plan.hf_name, read(gguf, plan)
            bar.update(1)
