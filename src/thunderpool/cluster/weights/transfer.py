"""The receiving side of weights over the fabric: fetch a rank's pieces into a local shard.

A shard is a directory in the cache (`shards/<model>/<key>/`) holding one safetensors file of
exactly the pieces a rank loads, the model's small files, and a manifest written last, so a
directory without it is never loaded. Every chunk is checked against the source's hash before
it is written; a cut transfer resumes from the chunks logged (and re-verified) on disk, and a
piece already present in another shard of the same model is copied locally, not fetched.
A piece a peer already holds (a verified copy in its cache) is asked of that peer first, then
of the source; its bytes pass the same hash check.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from thunderpool.cluster.control.auth import sign
from thunderpool.cluster.weights.pieces import RankLayout, rank_pieces
from thunderpool.cluster.weights.shard_files import (
    FetchError,
    _digest,
    _finish,
    _open,
    _other_shards,
    _plan,
    _read,
    _reuse,
    _Shard,
    _write,
    encode,
)
from thunderpool.cluster.weights.shards import (
    CHUNK_BYTES,
    SHARD_MANIFEST,
    ModelIndex,
    Piece,
    geometry,
    model_label,
    shard_key,
)

log = logging.getLogger("thunderpool.transfer")
STALL_S = 120.0  # no verified chunk for this long: the source or the link is gone
# Seconds a GET to a source may wait (connect, each read) before it is retried; the
# environment can shorten it (the testbed's cut-link test waits it out).
TIMEOUT_ENV, TIMEOUT_S = "THUNDERPOOL_FETCH_TIMEOUT_S", 15.0
MAX_CORRUPT = 5  # the same chunk failing its hash this often: the source itself is bad


def decode(text: str) -> str:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()


def piece_from_key(key: str) -> Piece:
    name, axis, a, b = key.rsplit("|", 3)
    return Piece(name=name, axis=None if axis == "None" else int(axis), a=int(a), b=int(b))


def shards_root(cache_dir: Path) -> Path:
    return cache_dir / "shards"


@dataclass
class Progress:
    """One fetch's counters, updated by its workers; `snapshot()` is what /v1 shows."""

    total_bytes: int = 0
    done_bytes: int = 0  # verified: fetched, copied from another shard, or already on disk
    received_bytes: int = 0  # payload bytes that crossed the network in this fetch
    peer_bytes: int = 0  # of which from peers' caches, not from a source
    metadata_bytes: int = 0  # the index and hash lists (JSON) it asked for
    reused_bytes: int = 0  # copied from another local shard of the same model
    corrupt_chunks: int = 0
    retries: int = 0
    state: str = "starting"  # starting | fetching | done | failed
    error: str = ""
    shards: dict[int, str] = field(default_factory=dict)  # rank -> shard directory
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    last_progress: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, done: int = 0, received: int = 0, reused: int = 0, peer: int = 0) -> None:
        with self.lock:
            self.done_bytes += done
            self.received_bytes += received
            self.reused_bytes += reused
            self.peer_bytes += peer
            self.last_progress = time.monotonic()

    def end(self, state: str, error: str = "") -> None:
        with self.lock:
            self.state, self.error, self.finished = state, error, time.monotonic()

    def snapshot(self) -> dict:
        with self.lock:
            elapsed = max((self.finished or time.monotonic()) - self.started, 1e-6)
            rate = self.received_bytes / elapsed
            left = self.total_bytes - self.done_bytes
            return {
                "state": self.state,
                "error": self.error,
                "total_bytes": self.total_bytes,
                "done_bytes": self.done_bytes,
                "received_bytes": self.received_bytes,
                "peer_bytes": self.peer_bytes,
                "metadata_bytes": self.metadata_bytes,
                "reused_bytes": self.reused_bytes,
                "corrupt_chunks": self.corrupt_chunks,
                "retries": self.retries,
                "rate_Bps": rate,
                "eta_s": left / rate if rate > 0 and self.state == "fetching" else None,
                "seconds": elapsed,
                "shards": {str(r): d for r, d in self.shards.items()},
            }


class SourceClient:
    """Signed GETs to the agents that serve the model, moving to the next one on failure."""

    def __init__(self, sources: list[str], token: str, timeout: float | None = None):
        if not sources:
            raise FetchError("no source to fetch the model from")
        timeout = timeout or float(os.environ.get(TIMEOUT_ENV, TIMEOUT_S))
        self.sources, self.token, self.timeout = list(sources), token, timeout
        self._local = threading.local()
        self._turn = 0

    def _client(self) -> httpx.Client:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = httpx.Client(timeout=self.timeout)
        return client

    def get(self, path: str, source: int = 0) -> bytes:
        address = self.sources[(self._turn + source) % len(self.sources)]
        r = self._client().get(f"http://{address}{path}", headers=sign(self.token, "GET", path))
        if r.status_code >= 400:
            raise FetchError(f"{address} refused {path.split('?')[0]}: {r.text[:200]}")
        return r.content

    def rotate(self) -> None:
        self._turn += 1

    def get_from(self, address: str, path: str) -> bytes:
        """One signed GET to one agent (a peer), no retry: the caller falls back."""
        r = self._client().get(f"http://{address}{path}", headers=sign(self.token, "GET", path))
        if r.status_code >= 400:
            raise FetchError(f"{address} refused {path.split('?')[0]}: {r.text[:200]}")
        return r.content


class ShardFetch:
    """Fetch the shards of this node's ranks for one launch; `run()` returns rank -> dir."""

    def __init__(
        self,
        cache_dir: Path,
        client: SourceClient,
        model: str | None,
        layouts: list[RankLayout],
        chunk: int = CHUNK_BYTES,
        workers: int = 4,
        peers: list[str] | None = None,
    ):
        self.cache_dir, self.client, self.model = cache_dir, client, model
        self.layouts, self.chunk, self.workers = layouts, chunk, workers
        self.peers = list(peers or [])
        self.progress = Progress()
        self._m = encode(model or "")
        self._holders: dict[str, list[str]] = {}  # piece key -> peers holding it, in order
        self._bad_peers: set[str] = set()
        self._identity = ""

    def run(self) -> dict[int, Path]:
        try:
            out = self._run()
        except Exception as e:
            self.progress.end("failed", str(e))
            raise
        self.progress.end("done")
        return out

    def _run(self) -> dict[int, Path]:
        index = ModelIndex.model_validate_json(self._meta(f"/v1/weights/index?m={self._m}"))
        root = shards_root(self.cache_dir) / model_label(index)
        self._identity = index.identity
        dirs: dict[int, Path] = {}
        todo: dict[str, _Shard] = {}
        for layout in self.layouts:
            pieces = rank_pieces(index, layout)
            key = shard_key(index.identity, pieces)
            directory = root / key
            dirs[layout.rank] = directory
            if not (directory / SHARD_MANIFEST).is_file() and key not in todo:
                todo[key] = _plan(directory, index, pieces)
        self.progress.shards = {r: str(d) for r, d in dirs.items()}
        sizes = [geometry(p, index).size for s in todo.values() for p in s.pieces]
        with self.progress.lock:
            self.progress.total_bytes, self.progress.state = sum(sizes), "fetching"
        reuse = _other_shards(root, set(todo))
        if todo:
            self._holders = self._peer_pieces(index.identity)
        for shard in todo.values():
            _open(shard)
        try:
            tasks = [(s, p) for s in todo.values() for p in s.pieces]
            tasks.sort(key=lambda sp: -geometry(sp[1], index).size)
            with ThreadPoolExecutor(self.workers, thread_name_prefix="fetch") as pool:
                for f in [pool.submit(self._piece, s, p, index, reuse) for s, p in tasks]:
                    f.result()
            for shard in todo.values():
                _finish(shard, index)
        finally:
            for shard in todo.values():
                for fd in shard.fds.values():
                    os.close(fd)
        return dirs

    def _peer_pieces(self, identity: str) -> dict[str, list[str]]:
        """piece key -> the peers that hold a verified copy of it (asked once each)."""
        holders: dict[str, list[str]] = {}
        for peer in self.peers:
            try:
                keys = json.loads(self._get_meta_from(peer, f"/v1/weights/held?i={identity}"))
            except (httpx.HTTPError, FetchError, ValueError) as e:
                log.warning("peer %s cannot list its pieces (%s); not asking it", peer, e)
                continue
            for key in keys:
                holders.setdefault(key, []).append(peer)
        return holders

    def _get_meta_from(self, peer: str, path: str) -> bytes:
        data = self.client.get_from(peer, path)
        with self.progress.lock:
            self.progress.metadata_bytes += len(data)
        return data

    def _from_peer(self, key: str, offset: int, length: int, want: str) -> bytes | None:
        """The chunk from the first peer holding it whose bytes pass the hash, else None."""
        for peer in self._holders.get(key, ()):
            if peer in self._bad_peers:
                continue
            path = f"/v1/weights/piece?p={encode(key)}&o={offset}&n={length}"
            try:
                data = self.client.get_from(peer, f"{path}&i={self._identity}")
            except (httpx.HTTPError, FetchError) as e:
                log.warning("peer %s did not serve %s (%s); trying elsewhere", peer, key, e)
                self._bad_peers.add(peer)
                continue
            if len(data) == length and _digest(data) == want:
                return data
            with self.progress.lock:
                self.progress.corrupt_chunks += 1
            log.warning("a chunk of %s from peer %s failed its hash; not asking it", key, peer)
            self._bad_peers.add(peer)
        return None

    def _meta(self, path: str) -> bytes:
        data = self._get(path)
        with self.progress.lock:
            self.progress.metadata_bytes += len(data)
        return data

    def _get(self, path: str) -> bytes:
        """GET with retries across sources until the stall limit."""
        delay = 0.5
        while True:
            try:
                return self.client.get(path)
            except (httpx.HTTPError, FetchError) as e:
                with self.progress.lock:
                    self.progress.retries += 1
                    stalled = time.monotonic() - self.progress.last_progress > STALL_S
                if stalled:
                    raise FetchError(f"no source answered for {STALL_S:.0f} s: {e}") from None
                log.warning("fetch %s failed (%s); retrying", path.split("?")[0], e)
                self.client.rotate()
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _piece(self, shard: _Shard, piece: Piece, index: ModelIndex, reuse: dict) -> None:
        if geometry(piece, index).size == 0:
            return  # an empty slice (another EP rank's expert): nothing to ask for
        q = f"m={self._m}&p={encode(piece.key)}&c={self.chunk}"
        hashes = json.loads(self._meta(f"/v1/weights/hashes?{q}"))
        name, base = shard.offsets[piece.key]
        fd = shard.fds[name]
        chunks = geometry(piece, index).chunks(self.chunk)
        if len(hashes) != len(chunks):
            raise FetchError(f"source sent {len(hashes)} hashes for {len(chunks)} chunks")
        for k, ((offset, length), want) in enumerate(zip(chunks, hashes, strict=True)):
            at = base + offset
            if shard.logged.get((piece.key, k)) == want and _digest(_read(fd, length, at)) == want:
                self.progress.add(done=length)  # verified on disk by an earlier, cut fetch
                continue
            data = _reuse(reuse, piece.key, offset, length)
            if data is not None and _digest(data) == want:
                _write(shard, fd, at, data, piece.key, k, want)
                self.progress.add(done=length, reused=length)
                continue
            data = self._from_peer(piece.key, offset, length, want)
            if data is not None:
                _write(shard, fd, at, data, piece.key, k, want)
                self.progress.add(done=length, received=length, peer=length)
                continue
            corrupt = 0
            while True:
                data = self._get(f"/v1/weights/chunk?{q}&k={k}")
                if len(data) == length and _digest(data) == want:
                    break
                corrupt += 1
                with self.progress.lock:
                    self.progress.corrupt_chunks += 1
                log.warning("chunk %d of %s failed its hash; fetching it again", k, piece.key)
                if corrupt >= MAX_CORRUPT:
                    raise FetchError(
                        f"chunk {k} of {piece.key} failed its hash {corrupt} times; the source's "
                        "copy may be damaged: check its disk or re-download the model there"
                    )
            _write(shard, fd, at, data, piece.key, k, want)
            self.progress.add(done=length, received=length)
