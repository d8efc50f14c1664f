"""Read a GGUF file's header: metadata first, tensor table second, tensor data only on demand.

The `gguf` package's reader builds numpy views for every metadata element and tensor before
anything can be checked (tens of seconds on a large file); this reader parses the key/value
section with `struct` over a memory map, so the architecture is known after a few kilobytes.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from thunderpool.errors import ModelError

# GGUF value types (gguf GGUFValueType) -> struct format; 8 is string, 9 is array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q"}
_SCALARS |= {12: "d"}
_NUMPY = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8"}
_NUMPY |= {11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One entry of the tensor table; `shape` is in numpy (row-major) order."""

    name: str
    shape: tuple[int, ...]
    qtype: int  # gguf.GGMLQuantizationType value
    offset: int  # from the start of the file
    nbytes: int


class GGUFFile:
    """A GGUF file opened read-only; parses lazily so that a refusal costs almost nothing."""

    def __init__(self, path: Path):
        self.path = path
        if not path.is_file():
            raise ModelError(f"GGUF file {path} does not exist; pass the path of a .gguf file")
        with path.open("rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ModelError(
                f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF'); "
                "pass a llama.cpp .gguf model file"
            )
        with path.open("rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 4
        (version,) = self._unpack("<I")
        if version not in (2, 3):
            raise ModelError(
                f"{path} is GGUF version {version}; only versions 2 and 3 (little-endian) are "
                "supported: re-create it with a current llama.cpp"
            )
        self._n_tensors, self._n_kv = self._unpack("<QQ")
        self._kv_iter = self._iter_kv()
        self.metadata: dict[str, Any] = {}
        self._tensors: list[TensorInfo] | None = None

    def get(self, key: str) -> Any:
        """One metadata value, parsing only as far as needed to find it (None if absent)."""
        if key in self.metadata:
            return self.metadata[key]
        for k, v in self._kv_iter:
            self.metadata[k] = v
            if k == key:
                return v
        return None

    def read_metadata(self) -> dict[str, Any]:
        """All key/value fields as plain Python values (strings, numbers, lists)."""
        for k, v in self._kv_iter:
            self.metadata[k] = v
        return self.metadata

    @property
    def tensors(self) -> list[TensorInfo]:
        """The tensor table (names, shapes, types, offsets); reads no tensor data."""
        if self._tensors is None:
            self._tensors = self._read_tensor_table()
        return self._tensors

    def raw(self, t: TensorInfo) -> np.ndarray:
        """The tensor's bytes as a (rows..., bytes per row) uint8 view of the mapped file."""
        if t.offset + t.nbytes > len(self._map):
            raise ModelError(
                f"tensor {t.name!r} ends at byte {t.offset + t.nbytes} but {self.path} has "
                f"{len(self._map)} bytes; the file is truncated: download it again"
            )
        data = np.frombuffer(self._map, np.uint8, count=t.nbytes, offset=t.offset)
        return data.reshape(*t.shape[:-1], -1)

    # --- parsing ---------------------------------------------------------------------------

    def _unpack(self, fmt: str) -> tuple:
        try:
            values = struct.unpack_from(fmt, self._map, self._pos)
        except struct.error as e:
            raise ModelError(f"cannot read GGUF file {self.path}: it is truncated ({e})") from e
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        raw = self._map[self._pos : self._pos + n]
        if len(raw) != n:
            raise ModelError(f"cannot read GGUF file {self.path}: it is truncated")
        self._pos += n
        return raw.decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._unpack("<IQ")
            if etype == _STRING:
                return [self._string() for _ in range(count)]
            if etype in _NUMPY:
                dtype = np.dtype(_NUMPY[etype])
                values = np.frombuffer(self._map, dtype, count=count, offset=self._pos)
                self._pos += dtype.itemsize * count
                return values.tolist()
            return [self._value(etype) for _ in range(count)]
        if vtype in _SCALARS:
            return self._unpack("<" + _SCALARS[vtype])[0]
        raise ModelError(f"cannot read GGUF file {self.path}: unknown value type {vtype}")

    def _iter_kv(self) -> Iterator[tuple[str, Any]]:
        for _ in range(self._n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            yield key, self._value(vtype)

    def _read_tensor_table(self) -> list[TensorInfo]:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.read_metadata()
        entries = []
        for _ in range(self._n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            qtype, offset = self._unpack("<IQ")
            entries.append((name, tuple(int(d) for d in reversed(dims)), qtype, offset))
        align = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-self._pos // align) * align
        tensors = []
        for name, shape, qtype, offset in entries:
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
            except (ValueError, KeyError) as e:
                raise ModelError(
                    f"tensor {name!r} in {self.path} has ggml type {qtype}, which the installed "
                    "gguf package does not know; upgrade it (pip install -U gguf)"
                ) from e
            n = int(np.prod(shape)) if shape else 1
            tensors.append(TensorInfo(name, shape, qtype, start + offset, n // block * type_size))
        return tensors
