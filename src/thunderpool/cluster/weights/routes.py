"""The agent's weight routes: serve pieces of a local model, fetch shards, list the cache.

Every route sits behind the agent's signature check (`signed`), so weights are served only to
cluster members, and a request without the token is refused before any byte is read.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
import uuid
from pathlib import Path

from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from thunderpool.cluster.weights.pieces import RankLayout
from thunderpool.cluster.weights.shard_files import FetchError
from thunderpool.cluster.weights.shards import CHUNK_BYTES, SHARD_MANIFEST
from thunderpool.cluster.weights.source import CachedPieces, ModelSource, SourceError
from thunderpool.cluster.weights.transfer import (
    ShardFetch,
    SourceClient,
    decode,
    piece_from_key,
    shards_root,
)

_LIVE = ("starting", "fetching")


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Locate(_Wire):
    model: str | None = None
    download: bool = False  # a hub id no member holds: this node downloads it once


class FetchShards(_Wire):
    """Coordinator -> a node without the model: fetch its ranks' shards from these agents."""

    model: str | None = None
    sources: tuple[str, ...]  # host:port of agents holding the model, fastest link first
    # host:port of members whose cached shards hold pieces of the model: each piece is
    # asked of a peer that holds it first, then of a source
    peers: tuple[str, ...] = ()
    ranks: tuple[RankLayout, ...]
    chunk: int = Field(CHUNK_BYTES, ge=1 << 16, le=1 << 28)
    workers: int = Field(4, ge=1, le=32)


class RemoveShards(_Wire):
    model: str = ""  # a model label as `cache ls` shows it; empty: every model
    key: str = ""  # one shard of it; empty: all its shards


class Weights:
    """The agent's weight state: what it serves, what it fetches, what it has cached."""

    def __init__(self, token: str, resolve, cache_dir: Path):
        self.token, self.cache_dir = token, cache_dir
        self.source = ModelSource(resolve, cache_dir)
        self.peers = CachedPieces(shards_root(cache_dir))
        self.fetches: dict[str, ShardFetch] = {}
        self.received_bytes = 0  # weight and file bytes, over every fetch since the start
        self.metadata_bytes = 0  # index and hash lists
        self._lock = threading.Lock()

    def start_fetch(self, req: FetchShards) -> str:
        client = SourceClient(list(req.sources), self.token)
        fetch = ShardFetch(
            self.cache_dir, client, req.model, list(req.ranks), req.chunk, req.workers,
            peers=list(req.peers),
        )  # fmt: skip
        fetch_id = uuid.uuid4().hex[:10]
        with self._lock:
            self.fetches[fetch_id] = fetch
        threading.Thread(target=self._run, args=(fetch,), name="fetch", daemon=True).start()
        return fetch_id

    def _run(self, fetch: ShardFetch) -> None:
        try:
            fetch.run()
        except (FetchError, OSError, ValueError) as e:
            fetch.progress.end("failed", str(e))
        finally:
            with self._lock:
                self.received_bytes += fetch.progress.received_bytes
                self.metadata_bytes += fetch.progress.metadata_bytes

    def cache(self) -> dict:
        shards = []
        for manifest in sorted(shards_root(self.cache_dir).glob(f"*/*/{SHARD_MANIFEST}")):
            d = manifest.parent
            # Blocks, not apparent sizes: in-place vocabulary rows leave holes in the file.
            size = sum(f.stat().st_blocks * 512 for f in d.iterdir() if f.is_file())
            identity = ""
            with contextlib.suppress(OSError, ValueError, KeyError):
                identity = json.loads(manifest.read_text())["identity"]
            shards.append(
                {"model": d.parent.name, "key": d.name, "bytes": size, "path": str(d),
                 "identity": identity}
            )  # fmt: skip
        fetches = {i: f.progress.snapshot() for i, f in list(self.fetches.items())}
        live = [f.progress for f in self.fetches.values() if f.progress.state in _LIVE]
        return {
            "shards": shards,
            "fetches": fetches,
            "received_bytes": self.received_bytes + sum(p.received_bytes for p in live),
            "metadata_bytes": self.metadata_bytes + sum(p.metadata_bytes for p in live),
            "served_bytes": self.source.served_bytes,
            "peer_served_bytes": self.peers.served_bytes,  # from its shards, to peers
        }

    def remove(self, req: RemoveShards) -> list[str]:
        root, removed = shards_root(self.cache_dir), []
        for d in sorted(root.glob("*/*")):
            if d.is_dir() and req.model in ("", d.parent.name) and req.key in ("", d.name):
                shutil.rmtree(d, ignore_errors=True)
                removed.append(f"{d.parent.name}/{d.name}")
        return removed


def add_weight_routes(app: FastAPI, weights: Weights, signed) -> None:
    def piece(p: str):
        try:
            return piece_from_key(decode(p))
        except ValueError:
            raise HTTPException(400, f"bad piece {p!r}") from None

    def model(m: str) -> str | None:
        try:
            return decode(m) or None
        except ValueError:
            raise HTTPException(400, f"bad model {m!r}") from None

    def served(call):
        try:
            return call()
        except SourceError as e:
            raise HTTPException(404, str(e)) from None

    @app.get("/v1/weights/index")
    def index(m: str = "", _: bytes = Depends(signed)):
        return served(lambda: weights.source.model(model(m))[1].model_dump(mode="json"))

    @app.get("/v1/weights/hashes")
    def hashes(m: str, p: str, c: int = CHUNK_BYTES, _: bytes = Depends(signed)):
        return served(lambda: weights.source.hashes(model(m), piece(p), _chunk(c)))

    @app.get("/v1/weights/chunk")
    def chunk(m: str, p: str, k: int, c: int = CHUNK_BYTES, _: bytes = Depends(signed)):
        data = served(lambda: weights.source.chunk(model(m), piece(p), k, _chunk(c)))
        return Response(data, media_type="application/octet-stream")

    @app.get("/v1/weights/held")
    def held(i: str, _: bytes = Depends(signed)):
        return sorted(weights.peers.held(i))

    @app.get("/v1/weights/piece")
    def peer_piece(i: str, p: str, o: int, n: int, _: bytes = Depends(signed)):
        _chunk(max(n, 1 << 16))
        data = served(lambda: weights.peers.read(i, piece(p).key, o, n))
        return Response(data, media_type="application/octet-stream")

    @app.post("/v1/weights/locate")
    def locate(body: bytes = Depends(signed)):
        req = Locate.model_validate_json(body)
        found = weights.source.locate(req.model, req.download)
        return {"has": found is not None, "identity": found[1].identity if found else ""}

    @app.post("/v1/weights/fetch")
    def fetch(body: bytes = Depends(signed)):
        return {"fetch_id": weights.start_fetch(FetchShards.model_validate_json(body))}

    @app.get("/v1/weights/fetch/{fetch_id}")
    def fetch_progress(fetch_id: str, _: bytes = Depends(signed)):
        found = weights.fetches.get(fetch_id)
        if found is None:
            raise HTTPException(404, f"no fetch {fetch_id} on this node (did it restart?)")
        return found.progress.snapshot()

    @app.get("/v1/weights/cache")
    def cache(_: bytes = Depends(signed)):
        return weights.cache()

    @app.post("/v1/weights/cache/rm")
    def remove(body: bytes = Depends(signed)):
        return {"removed": weights.remove(RemoveShards.model_validate_json(body))}


def _chunk(c: int) -> int:
    if not (1 << 16) <= c <= (1 << 28):
        raise HTTPException(400, f"chunk size {c} is outside 64 KiB .. 256 MiB")
    return c
