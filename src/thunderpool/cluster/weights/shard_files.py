"""A fetched shard's files on disk: its plan of offsets, the one safetensors file written in place
chunk by verified chunk, the chunk log a cut transfer resumes from, and the manifest written
last; pieces reused from the model's other shards."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from thunderpool.cluster.weights.shards import (
    IN_PLACE,
    SHARD_MANIFEST,
    ModelIndex,
    Piece,
    geometry,
)
from thunderpool.errors import ThunderpoolError

log = logging.getLogger("thunderpool.transfer")


WEIGHTS_FILE = "model.safetensors"


_RESERVED = {WEIGHTS_FILE, "chunks.log", "plan.bin", SHARD_MANIFEST}


class FetchError(ThunderpoolError):
    """A shard that could not be fetched: no source answers, or its bytes keep failing."""


@dataclass
class _Shard:
    directory: Path
    pieces: list[Piece]
    offsets: dict[str, tuple[str, int]]  # piece key -> (file in the shard, byte offset)
    header: bytes
    slices: dict[str, dict]
    size: int  # of the weights file: holes where in-place rows are not this rank's
    fds: dict[str, int] = field(default_factory=dict)
    logged: dict[tuple[str, int], str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _plan(directory: Path, index: ModelIndex, pieces: list[Piece]) -> _Shard:
    """Where each piece goes: tensors into one safetensors file, files as themselves."""
    header: dict = {"__metadata__": {"format": "mlx"}}
    slices: dict[str, dict] = {}
    tensors = [p for p in pieces if not p.is_file]
    offset, at = 0, {}
    for p in tensors:
        g, t = geometry(p, index), index.tensors[p.name]
        if p.axis == 0 and p.name in IN_PLACE:
            # Full shape, only rows [a, b) written (the rest is a hole that reads as zeros).
            size = t.end - t.start
            at[p.key] = offset + p.a * size // t.shape[0]
            span = [offset, offset + size]
            header[p.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": span}
            offset += size
            continue
        span = [offset, offset + g.size]
        header[p.name] = {"dtype": t.dtype, "shape": list(g.shape), "data_offsets": span}
        if p.axis is not None:
            slices[p.name] = {"axis": p.axis, "a": p.a, "b": p.b, "shape": list(t.shape)}
        at[p.key] = offset
        offset += g.size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-aligned
    head = len(text).to_bytes(8, "little") + text
    offsets: dict[str, tuple[str, int]] = {}
    for p in pieces:
        if p.is_file:
            name = p.name.removeprefix("file:")
            if "/" in name or "\\" in name or name.startswith(".") or name in _RESERVED:
                raise FetchError(f"the source named a model file {name!r}; refusing to write it")
            offsets[p.key] = (name, 0)
        else:
            offsets[p.key] = (WEIGHTS_FILE, len(head) + at[p.key])
    return _Shard(directory, pieces, offsets, head, slices, len(head) + offset)


def _open(shard: _Shard) -> None:
    """Open the shard's partial files, keeping what an earlier, cut fetch wrote and logged."""
    shard.directory.mkdir(parents=True, exist_ok=True)
    log_path = shard.directory / "chunks.log"
    plan = shard.directory / "plan.bin"
    if plan.is_file() and plan.read_bytes() == shard.header and log_path.is_file():
        for line in log_path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                key, k, digest = line.split("\t")
                shard.logged[(key, int(k))] = digest
    else:
        log_path.write_text("")
        plan.write_bytes(shard.header)
        for name in {n for n, _ in shard.offsets.values()}:  # a fresh start: no stale bytes
            with contextlib.suppress(FileNotFoundError):
                (shard.directory / f"{name}.part").unlink()
    for name in {n for n, _ in shard.offsets.values()}:
        shard.fds[name] = os.open(shard.directory / f"{name}.part", os.O_RDWR | os.O_CREAT, 0o644)
    if WEIGHTS_FILE in shard.fds:
        _pwrite(shard.fds[WEIGHTS_FILE], shard.header, 0)
        os.ftruncate(shard.fds[WEIGHTS_FILE], shard.size)
    shard.fds["chunks.log"] = os.open(log_path, os.O_WRONLY | os.O_APPEND)


def _write(shard: _Shard, fd: int, at: int, data: bytes, key: str, k: int, digest: str) -> None:
    """Write a verified chunk, then log it; the data is on disk before the log says so."""
    _pwrite(fd, data, at)
    os.fdatasync(fd)
    with shard.lock:
        os.write(shard.fds["chunks.log"], f"{key}\t{k}\t{digest}\n".encode())


def _finish(shard: _Shard, index: ModelIndex) -> None:
    for name, fd in shard.fds.items():
        if name != "chunks.log":
            os.fsync(fd)
    for name in shard.fds:
        if name != "chunks.log":
            (shard.directory / f"{name}.part").replace(shard.directory / name)
    manifest = {
        "identity": index.identity,
        "slices": shard.slices,
        "pieces": {
            p.key: list(shard.offsets[p.key]) + [geometry(p, index).size] for p in shard.pieces
        },
        "bytes": sum(geometry(p, index).size for p in shard.pieces),
    }
    tmp = shard.directory / f"{SHARD_MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest))
    tmp.replace(shard.directory / SHARD_MANIFEST)  # last: only now may a rank load it
    for name in ("chunks.log", "plan.bin"):
        with contextlib.suppress(FileNotFoundError):
            (shard.directory / name).unlink()


def _other_shards(root: Path, skip: set[str]) -> dict[str, tuple[Path, int]]:
    """piece key -> (file, offset) in the complete shards of this model already cached."""
    found: dict[str, tuple[Path, int]] = {}
    for manifest in root.glob(f"*/{SHARD_MANIFEST}"):
        if manifest.parent.name in skip:
            continue
        with contextlib.suppress(OSError, ValueError, KeyError):
            for key, (name, offset, _) in json.loads(manifest.read_text())["pieces"].items():
                found.setdefault(key, (manifest.parent / name, offset))
    return found


def _reuse(reuse: dict, key: str, offset: int, length: int) -> bytes | None:
    if key not in reuse:
        return None
    path, base = reuse[key]
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return _read(fd, length, base + offset)
    finally:
        os.close(fd)


def _read(fd: int, length: int, at: int) -> bytes:
    data = os.pread(fd, length, at)
    return data if len(data) == length else b""


def _pwrite(fd: int, data: bytes, at: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode(text: str) -> str:
    """URL-safe text for a query value (names may hold any character)."""
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")
