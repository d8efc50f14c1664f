"""Read a row range of a weight straight from its safetensors file, never the whole tensor.

Slicing a lazily loaded array does not help: MLX's Load reads the whole tensor, then slices
(a 151,936-row embedding is read whole by every TP rank, then mostly dropped). A row range of
a row-major tensor is one contiguous byte range of the file, so only that range is read here.
"""

from __future__ import annotations

import io
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from thunderpool.errors import ModelError

# safetensors dtype -> (MLX dtype, the dtype its bytes are read as: Python's buffer protocol
# has no bfloat16, so bf16 is read as uint16 and viewed, which shares the buffer).
_DTYPES = {
    "F32": (mx.float32, mx.float32),
    "F16": (mx.float16, mx.float16),
    "BF16": (mx.bfloat16, mx.uint16),
    "U32": (mx.uint32, mx.uint32),
    "I32": (mx.int32, mx.int32),
    "U8": (mx.uint8, mx.uint8),
    "I8": (mx.int8, mx.int8),
}


@dataclass(frozen=True, slots=True)
class Stored:
    path: Path
    dtype: str  # safetensors' name, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # first byte of the tensor in the file


class StoredRows:
    """The tensors of a model's safetensors files, by name, for row-range reads."""

    def __init__(self, files: list[Path]):
        self._index: dict[str, Stored] = {}
        for path in files:
            with path.open("rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            for name, t in header.items():
                if name != "__metadata__":
                    start = 8 + n + t["data_offsets"][0]
                    self._index[name] = Stored(path, t["dtype"], tuple(t["shape"]), start)

    @classmethod
    def of(cls, model_dir: Path) -> StoredRows:
        return cls(sorted(Path(model_dir).glob("model*.safetensors")))

    def rows(self, name: str, lazy: mx.array, a: int, b: int) -> mx.array:
        """Rows [a, b) of the model's parameter `name` (whose lazy array is `lazy`): read from
        the file where `lazy` is that stored tensor untouched, else sliced from `lazy`."""
        stored = self._find(name, lazy)
        if stored is None:
            return mx.contiguous(lazy[a:b])
        dtype, carrier = _DTYPES[stored.dtype]
        shape = (b - a, *stored.shape[1:])
        # Read into MLX's own buffer: no second copy of the rows passes through numpy.
        out = mx.zeros(shape, carrier)
        mx.eval(out)
        try:
            view = memoryview(out).cast("B")
        except (TypeError, ValueError, BufferError):  # a backend without host-visible memory
            return mx.contiguous(lazy[a:b])
        with view as buf, stored.path.open("rb") as f:
            f.seek(stored.offset + a * (buf.nbytes // shape[0]))
            complete = f.readinto(buf) == buf.nbytes
        if not complete:
            raise ModelError(
                f"{stored.path} ends inside {name} (rows {a}..{b}); re-download or re-import it"
            )
        return out.view(dtype) if carrier != dtype else out

    def _find(self, name: str, lazy: mx.array) -> Stored | None:
        """The one stored tensor that `lazy` is: same name (or a prefixed one, as checkpoints
        that wrap the language model store it), shape and dtype, and no op applied on load."""
        matches = [
            s
            for key, s in self._index.items()
            if (key == name or key.endswith("." + name))
            and s.shape == tuple(lazy.shape)
            and s.dtype in _DTYPES
            and _DTYPES[s.dtype][0] == lazy.dtype
        ]
        return matches[0] if len(matches) == 1 and _is_plain_load(lazy) else None


def _is_plain_load(lazy: mx.array) -> bool:
    """True when `lazy` is a file read with nothing applied (a sanitize() may scale or cast a
    weight; those must be read through MLX). MLX exposes the graph only as DOT text."""
    dot = io.StringIO()
    mx.export_to_dot(dot, lazy)
    labels = [line for line in dot.getvalue().splitlines() if "label =" in line]
    return len(labels) == 1 and 'label ="Load"' in labels[0]
