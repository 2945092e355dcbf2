"""GGUFFile: one .gguf file opened with the `gguf` package: its metadata, tensors and checks.

Metadata keys are llama.cpp's (`general.architecture`, `{arch}.block_count`, ...); `arch_get`
reads the `{arch}.`-prefixed ones. Every refusal is an `UnsupportedGGUF` (a ValueError) whose
message names the file, what is unsupported and what is supported, so the launcher can print
it as one line.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np


class UnsupportedGGUF(ValueError):
    """A GGUF file sglite cannot convert; the message says what and why."""


_MISSING = object()


class GGUFFile:
    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except (ValueError, OSError) as e:
            raise UnsupportedGGUF(f"{self.path.name}: not a readable GGUF file ({e})") from None
        self.arch = str(self.get("general.architecture", ""))
        if self.get("split.count", 1) > 1:
            raise UnsupportedGGUF(
                f"{self.path.name} is one part of a split GGUF ({self.get('split.count')} "
                "files); merge the parts first (llama.cpp: llama-gguf-split --merge)"
            )

    # ------------------------------------------------------------------ metadata
    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        value = field.contents()
        return value.tolist() if isinstance(value, np.ndarray) else value

    def arch_get(self, key: str, default: Any = _MISSING) -> Any:
        """`{arch}.key`; without a default, a missing key is a refusal naming it."""
        value = self.get(f"{self.arch}.{key}", None)
        if value is None:
            if default is _MISSING:
                raise UnsupportedGGUF(
                    f"{self.path.name}: metadata key {self.arch}.{key} is missing"
                )
            return default
        return value

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    # ------------------------------------------------------------------ tensors
    @cached_property
    def tensors(self) -> dict[str, Any]:
        """GGUF tensor name -> the reader's tensor (name, tensor_type, shape, data)."""
        return {t.name: t for t in self.reader.tensors}

    def rows(self, name: str) -> int:
        """The first dimension of a tensor as numpy sees it (its output features)."""
        return int(self.tensors[name].shape[-1])

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in numpy's (rows, cols) order."""
        import gguf

        t = self.tensors[name]
        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)

    def check_tensor_types(self) -> None:
        """Refuse, before converting anything, a tensor type the gguf package cannot dequantize."""
        ok = supported_tensor_types()
        bad = [t for t in self.reader.tensors if t.tensor_type.name not in ok]
        if bad:
            more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
            raise UnsupportedGGUF(
                f"{self.path.name}: tensor {bad[0].name} has type {bad[0].tensor_type.name}, "
                f"which cannot be dequantized{more}; supported: {', '.join(sorted(ok))}"
            )


def supported_tensor_types() -> frozenset[str]:
    """Names of the tensor types the installed gguf package dequantizes: F32, F16 and each
    type with a class in gguf.quants (BF16, Q4_0 ... Q8_0, Q2_K ... Q6_K, IQ*, TQ*, MXFP4)."""
    import gguf

    names = {"F32", "F16"}
    for qtype in gguf.GGMLQuantizationType:
        if hasattr(getattr(gguf.quants, qtype.name, None), "dequantize_blocks"):
            names.add(qtype.name)
    return frozenset(names)
