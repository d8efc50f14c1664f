"""The coordinator's view of a model that only another node holds: config, tokenizer and chat
template files, and the safetensors headers (no weights), fetched from that node's agent.

That is all the coordinator needs: the planner sizes layers from the headers, `serve` reads the
tokenizer and context length; the ranks receive their shards over the fabric as usual. Every
file is checked against the source's chunk hashes, like any piece.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from thunderpool.cluster.control.client import AgentError
from thunderpool.cluster.weights.routes import Locate
from thunderpool.cluster.weights.shard_files import FetchError, encode
from thunderpool.cluster.weights.shards import CHUNK_BYTES, ModelIndex, Piece, model_label
from thunderpool.cluster.weights.transfer import SourceClient
from thunderpool.errors import ModelError

MARKER = "thunderpool-remote.json"  # written last: a directory without it is incomplete


def model_here_or_remote(
    model: str | None, coordinator: Callable[[], object], cache_dir: Path | None = None
) -> Path:
    """This machine's copy of `model`, else the description of it fetched from a member
    (`coordinator()` builds the Coordinator that asks them, only then)."""
    from thunderpool.models.source import resolve_model

    try:
        return resolve_model(model, progress=False)
    except ModelError as here:
        try:
            return remote_model_dir(coordinator(), model, cache_dir)
        except ModelError as there:
            raise ModelError(f"{here}; and {there}") from None


def remote_model_dir(coordinator, model: str | None, cache_dir: Path | None = None) -> Path:
    """A directory holding `model`'s small files and headers-only safetensors, from the first
    member that has the model (cached under the model's identity)."""
    from thunderpool.models.source import default_cache_dir

    state = coordinator.discover()

    def has(node: str) -> bool:
        try:
            req = Locate(model=model)
            return bool(
                coordinator.client(node, state).call("POST", "/v1/weights/locate", req)["has"]
            )
        except AgentError:
            return False

    nodes = sorted(state.nodes)
    with ThreadPoolExecutor(max(len(nodes), 1)) as pool:
        holders = [n for n, ok in zip(nodes, pool.map(has, nodes), strict=True) if ok]
    if not holders:
        raise ModelError(
            f"no node of the cluster has model {model or '(default)'} either; put it on one node"
        )
    client = SourceClient([state.contacts[n] for n in holders], coordinator.token)
    m = encode(model or "")
    try:
        index = ModelIndex.model_validate_json(client.get(f"/v1/weights/index?m={m}"))
    except FetchError as e:
        raise ModelError(f"cannot read the index of {model or '(default)'}: {e}") from None
    out = (cache_dir or default_cache_dir()) / "remote" / model_label(index)
    if (out / MARKER).is_file():
        return out
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for name in index.files:
            if "/" in name or "\\" in name or name.startswith(".") or name == MARKER:
                raise ModelError(f"the source named a model file {name!r}; refusing to write it")
            (tmp / name).write_bytes(_file(client, m, name))
        _write_headers(tmp, index)
        (tmp / MARKER).write_text(json.dumps({"identity": index.identity, "weights": False}))
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(out)
        tmp.replace(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _file(client: SourceClient, m: str, name: str) -> bytes:
    """One small file of the model, every chunk checked against the source's hash."""
    p = encode(Piece(name=f"file:{name}").key)
    q = f"m={m}&p={p}&c={CHUNK_BYTES}"
    try:
        hashes = json.loads(client.get(f"/v1/weights/hashes?{q}"))
        parts = [client.get(f"/v1/weights/chunk?{q}&k={k}") for k in range(len(hashes))]
    except FetchError as e:
        raise ModelError(f"cannot fetch {name} of the model: {e}") from None
    for k, (part, want) in enumerate(zip(parts, hashes, strict=True)):
        if hashlib.sha256(part).hexdigest() != want:
            raise ModelError(f"chunk {k} of {name} failed its hash; run the command again")
    return b"".join(parts)


def _write_headers(directory: Path, index: ModelIndex) -> None:
    """Each weight file as its header alone (offsets as in the source, no data)."""
    by_file: dict[str, dict] = {}
    for name, t in index.tensors.items():
        by_file.setdefault(t.file, {})[name] = t
    for file, tensors in by_file.items():
        base = min(t.start for t in tensors.values())
        header: dict = {"__metadata__": {"thunderpool": "headers only"}}
        for name, t in tensors.items():
            header[name] = {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "data_offsets": [t.start - base, t.end - base],
            }
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        (directory / file).write_bytes(len(text).to_bytes(8, "little") + text)
