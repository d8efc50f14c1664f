"""The serving side of weights over the fabric: pieces of a local model, by byte range.

Reads only the bytes asked for (safetensors headers give the offsets; a column slice reads its
rows' block and keeps its columns), never a whole file. Each piece's chunk hashes are computed
once and kept in the cache directory, so every later receiver is checked against the same ones.
A node without the model serves, to its peers, the pieces its complete shards already hold.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from thunderpool.cluster.weights.shards import (
    CHUNK_BYTES,
    SHARD_MANIFEST,
    ModelIndex,
    Piece,
    geometry,
    index_model,
)
from thunderpool.errors import ModelError, ThunderpoolError


class SourceError(ThunderpoolError):
    """A piece that this node cannot serve (unknown model, tensor or chunk)."""


class ModelSource:
    """The models this node can serve, by the name the user gave them (None: the default)."""

    def __init__(self, resolve: Callable[[str | None], Path] | None, cache_dir: Path):
        self.resolve, self.cache_dir = resolve, cache_dir
        self._models: dict[str, tuple[Path, ModelIndex]] = {}
        self._lock = threading.Lock()
        self.served_bytes = 0

    def locate(self, name: str | None, download: bool = False) -> tuple[Path, ModelIndex] | None:
        """The local copy of `name` and its index, or None when this node has none. A hub id
        is looked up in the local hub cache only, unless `download`: one node downloads,
        the others fetch their shards from it."""
        name = name or None
        key = name or ""
        with self._lock:
            if key in self._models:
                return self._models[key]
        if self.resolve is None:
            return None
        try:
            path = self.resolve(name) if download or not _hub_id(name) else _hub_cached(name)
            found = (path, index_model(path))
        except (ModelError, OSError):
            return None
        with self._lock:
            self._models[key] = found
        return found

    def model(self, name: str | None) -> tuple[Path, ModelIndex]:
        found = self.locate(name)
        if found is None:
            raise SourceError(f"this node has no copy of model {name or '(default)'}")
        return found

    def _check(self, index: ModelIndex, piece: Piece) -> None:
        if piece.is_file:
            if piece.name.removeprefix("file:") not in index.files:
                raise SourceError(f"no file {piece.name} in the model")
            return
        t = index.tensors.get(piece.name)
        if t is None:
            raise SourceError(f"no tensor {piece.name!r} in the model")
        if piece.axis is not None and not (
            0 <= piece.axis < len(t.shape) and 0 <= piece.a < piece.b <= t.shape[piece.axis]
        ):
            raise SourceError(f"slice {piece.key} is outside {piece.name} of shape {t.shape}")

    def hashes(self, name: str | None, piece: Piece, chunk: int = CHUNK_BYTES) -> list[str]:
        """sha256 of each chunk of `piece`, computed once and then read from the cache."""
        path, index = self.model(name)
        self._check(index, piece)
        key = hashlib.sha256(f"{piece.key}|{chunk}".encode()).hexdigest()[:32]
        cached = self.cache_dir / "hashes" / index.identity[:16] / f"{key}.json"
        with contextlib.suppress(OSError, ValueError):
            return json.loads(cached.read_text())
        n = len(geometry(piece, index).chunks(chunk))
        digests = [
            hashlib.sha256(self._read(path, index, piece, k, chunk)).hexdigest() for k in range(n)
        ]
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(digests))
        tmp.replace(cached)
        return digests

    def chunk(self, name: str | None, piece: Piece, k: int, chunk: int = CHUNK_BYTES) -> bytes:
        path, index = self.model(name)
        self._check(index, piece)
        data = self._read(path, index, piece, k, chunk)
        with self._lock:
            self.served_bytes += len(data)
        return data

    def _read(self, path: Path, index: ModelIndex, piece: Piece, k: int, chunk: int) -> bytes:
        g = geometry(piece, index)
        chunks = g.chunks(chunk)
        if not 0 <= k < len(chunks):
            raise SourceError(f"chunk {k} of {piece.key} does not exist (it has {len(chunks)})")
        offset, length = chunks[k]
        if piece.is_file:
            file = path / piece.name.removeprefix("file:")
        else:
            file = path / index.tensors[piece.name].file
        fd = os.open(file, os.O_RDONLY)
        try:
            if g.contiguous:
                return _pread(fd, length, g.base + offset)
            # Whole lines: read the rows' block once, keep each row's [col0, col1) bytes.
            first, n = offset // g.line, length // g.line
            block = _pread(fd, (n - 1) * g.stride + g.line, g.base + first * g.stride)
            rows = np.lib.stride_tricks.as_strided(
                np.frombuffer(block, np.uint8), shape=(n, g.line), strides=(g.stride, 1)
            )
            return rows.tobytes()
        finally:
            os.close(fd)


def _hub_id(name: str | None) -> bool:
    from thunderpool.models.source import _REPO_ID

    return bool(name) and not Path(name).expanduser().exists() and bool(_REPO_ID.match(name))


def _hub_cached(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    from thunderpool.models.source import _HUB_PATTERNS

    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, local_files_only=True))
    except Exception as e:  # the hub raises many types; here all mean "not cached here"
        raise ModelError(f"{repo_id} is not in this node's hub cache: {e}") from e


def _pread(fd: int, length: int, offset: int) -> bytes:
    parts, got = [], 0
    while got < length:
        part = os.pread(fd, length - got, offset + got)
        if not part:
            raise SourceError(f"file ended {length - got} bytes early at offset {offset + got}")
        parts.append(part)
        got += len(part)
    return b"".join(parts)


class CachedPieces:
    """Pieces this node already holds, verified, in its complete shards: what it serves to a
    peer fetching the same model (a peer checks every chunk against the source's hashes)."""

    def __init__(self, shards_root: Path):
        self.root = shards_root
        self._held: dict[str, dict[str, tuple[Path, int, int]]] = {}
        self._lock = threading.Lock()
        self.served_bytes = 0

    def held(self, identity: str) -> dict[str, tuple[Path, int, int]]:
        """piece key -> (file, offset, size) of its byte stream, over this model's shards."""
        found: dict[str, tuple[Path, int, int]] = {}
        for manifest in sorted(self.root.glob(f"*/*/{SHARD_MANIFEST}")):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                m = json.loads(manifest.read_text())
                if m["identity"] != identity:
                    continue
                for key, (name, offset, size) in m["pieces"].items():
                    found.setdefault(key, (manifest.parent / name, int(offset), int(size)))
        with self._lock:
            self._held[identity] = found
        return found

    def read(self, identity: str, key: str, offset: int, length: int) -> bytes:
        with self._lock:
            where = self._held.get(identity, {}).get(key)
        if where is None:
            where = self.held(identity).get(key)
        if where is None:
            raise SourceError(f"this node holds no verified copy of {key}")
        path, base, size = where
        if not (0 <= offset and 0 <= length and offset + length <= size):
            raise SourceError(f"bytes {offset}+{length} are outside {key} ({size} bytes)")
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:  # removed since (`cache rm`): the peer falls back to the source
            with self._lock:
                self._held.pop(identity, None)
            raise SourceError(f"{key} is no longer cached here: {e}") from None
        try:
            data = _pread(fd, length, base + offset)
        finally:
            os.close(fd)
        with self._lock:
            self.served_bytes += len(data)
        return data
