"""GGUFFile: one .gguf file, memory-mapped: its metadata, its tensors (raw or dequantized), checks.

The header is parsed here (GGUF v2/v3, little-endian: magic, version, tensor and key
counts, typed key/values, tensor infos, aligned data), because the gguf package's reader
builds a numpy view per array element and needs ~20 s for a 262k-token vocabulary; this
takes well under a second. Dequantizing is the gguf package's (`gguf.quants.dequantize`).
Metadata keys are llama.cpp's (`general.architecture`, `{arch}.block_count`, ...);
`arch_get` reads the `{arch}.`-prefixed ones. Every refusal is an `UnsupportedGGUF` (a
ValueError) whose message names the file, what is unsupported and what is supported, so
the launcher can print it as one line.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


class UnsupportedGGUF(ValueError):
    """A GGUF file sglite cannot convert; the message says what and why."""


_MISSING = object()
# GGUF value type id -> struct code (8 is a string, 9 an array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # fmt: skip
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """A tensor of the file: `shape` in numpy order (rows first; GGUF stores it reversed),
    `type_id` the ggml type, `start`/`nbytes` its bytes in the file."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    start: int
    nbytes: int

    @property
    def type_name(self) -> str:
        import gguf

        try:
            return gguf.GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"type {self.type_id}"


class _Cursor:
    def __init__(self, buf: Any):
        self.buf, self.pos = buf, 0

    def scalar(self, code: str) -> Any:
        (value,) = struct.unpack_from("<" + code, self.buf, self.pos)
        self.pos += struct.calcsize(code)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="surrogateescape")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, count = self.scalar("I"), self.scalar("Q")
        if item in _SCALARS:  # numbers in one read
            dtype = np.dtype("<" + _SCALARS[item])
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += values.nbytes
            return values.tolist()
        return [self.value(item) for _ in range(count)]


class GGUFFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self.metadata, self.tensors = self._parse()
        except (ValueError, OSError, struct.error, UnicodeDecodeError) as e:
            raise UnsupportedGGUF(f"{self.path.name}: not a readable GGUF file ({e})") from None
        self.arch = str(self.get("general.architecture", ""))
        if self.get("split.count", 1) > 1:
            raise UnsupportedGGUF(
                f"{self.path.name} is one part of a split GGUF ({self.get('split.count')} "
                "files); merge the parts first (llama.cpp: llama-gguf-split --merge)"
            )

    def _parse(self) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
        cur = _Cursor(self._mm)
        if bytes(self._mm[:4]) != b"GGUF":
            raise ValueError("no GGUF magic number")
        cur.pos = 4
        version = cur.scalar("I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (supported: 2, 3, little-endian)")
        num_tensors, num_keys = cur.scalar("Q"), cur.scalar("Q")
        metadata = {}
        for _ in range(num_keys):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar("I"))
        infos = []
        for _ in range(num_tensors):
            name = cur.string()
            dims = [cur.scalar("Q") for _ in range(cur.scalar("I"))]
            infos.append((name, tuple(reversed(dims)), cur.scalar("I"), cur.scalar("Q")))
        align = int(metadata.get("general.alignment", 32))
        data_start = -(-cur.pos // align) * align
        tensors = {}
        for name, shape, type_id, offset in infos:
            start = data_start + offset
            nbytes = _nbytes(shape, type_id)
            if nbytes is not None and start + nbytes > len(self._mm):
                raise ValueError(f"tensor {name} runs past the end of the file (truncated?)")
            tensors[name] = TensorInfo(name, shape, type_id, start, nbytes or 0)
        return metadata, tensors

    # ------------------------------------------------------------------ metadata
    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_get(self, key: str, default: Any = _MISSING) -> Any:
        """`{arch}.key`; without a default, a missing key is a refusal naming it."""
        value = self.metadata.get(f"{self.arch}.{key}")
        if value is None:
            if default is _MISSING:
                raise UnsupportedGGUF(
                    f"{self.path.name}: metadata key {self.arch}.{key} is missing"
                )
            return default
        return value

    def has(self, key: str) -> bool:
        return key in self.metadata

    # ------------------------------------------------------------------ tensors
    def rows(self, name: str) -> int:
        """The first dimension of a tensor in numpy order (its output features)."""
        return int(self.tensors[name].shape[0])

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored, viewed as gguf.quants expects them: float arrays
        of the tensor's shape for F32/F16, else uint8 rows of packed blocks (read-only)."""
        import gguf

        t = self.tensors[name]
        data = np.frombuffer(self._mm, dtype=np.uint8, count=t.nbytes, offset=t.start)
        if t.type_id == gguf.GGMLQuantizationType.F32:
            return data.view("<f4").reshape(t.shape)
        if t.type_id == gguf.GGMLQuantizationType.F16:
            return data.view("<f2").reshape(t.shape)
        return data.reshape(*t.shape[:-1], -1)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in numpy's (rows, cols) order."""
        import gguf

        t = self.tensors[name]
        w = gguf.quants.dequantize(self.raw(name), gguf.GGMLQuantizationType(t.type_id))
        return np.asarray(w, dtype=np.float32)

    def check_tensor_types(self) -> None:
        """Refuse, before converting anything, a tensor type the gguf package cannot dequantize."""
        ok = supported_tensor_types()
        bad = [t for t in self.tensors.values() if t.type_name not in ok]
        if bad:
            more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
            raise UnsupportedGGUF(
                f"{self.path.name}: tensor {bad[0].name} has type {bad[0].type_name}, "
                f"which cannot be dequantized{more}; supported: {', '.join(sorted(ok))}"
            )


def _nbytes(shape: tuple[int, ...], type_id: int) -> int | None:
    import gguf

    try:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        return None  # an unknown type: refused by check_tensor_types
    return int(np.prod(shape, dtype=np.int64)) // block * size


def supported_tensor_types() -> frozenset[str]:
    """Names of the tensor types the installed gguf package dequantizes: F32, F16 and each
    type with a class in gguf.quants (BF16, Q4_0 ... Q8_0, Q2_K ... Q6_K, IQ*, TQ*, MXFP4)."""
    import gguf

    names = {"F32", "F16"}
    for qtype in gguf.GGMLQuantizationType:
        if hasattr(getattr(gguf.quants, qtype.name, None), "dequantize_blocks"):
            names.add(qtype.name)
    return frozenset(names)
