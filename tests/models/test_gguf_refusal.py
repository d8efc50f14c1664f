"""An unsupported GGUF architecture is refused from the header alone: one line, the supported
list, an offline fix, exit status 2, no traceback; no tensor table or data is read."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from thunderpool.errors import ModelError
from thunderpool.models import gguf_file
from thunderpool.models.gguf import import_gguf

BIG = 4 << 30  # a 4 GiB tensor section, sparse on disk


def write_big_header(path: Path, arch: str, n_tokens: int = 150_000) -> None:
    """A GGUF header as a real model's (a large vocabulary, a multi-GiB tensor) whose tensor
    section is a sparse hole: nothing in it is a valid tensor."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_token_list([f"tok{i}" for i in range(n_tokens)])
    w.add_token_types([1] * n_tokens)
    w.add_tensor_info("token_embd.weight", (BIG // 4 // 4096, 4096), np.dtype(np.float32), BIG)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    os.truncate(path, path.stat().st_size + BIG)


@pytest.fixture
def falcon(tmp_path) -> Path:
    path = tmp_path / "falcon.gguf"
    write_big_header(path, "falcon")
    return path


def test_refused_from_the_header_alone(falcon, tmp_path, monkeypatch):
    def no_tensors(self):
        raise AssertionError("the tensor table was read before the architecture was checked")

    monkeypatch.setattr(gguf_file.GGUFFile, "_read_tensor_table", no_tensors)
    monkeypatch.setattr(gguf_file.GGUFFile, "raw", no_tensors)
    with pytest.raises(ModelError) as err:
        import_gguf(falcon, tmp_path / "out", progress=False)
    msg = str(err.value)
    assert "\n" not in msg
    assert "'falcon'" in msg
    assert "supported: llama, qwen2, qwen3, qwen3moe, gemma3, phi3, deepseek2" in msg
    assert "Hugging Face safetensors directory" in msg and "save_pretrained" in msg
    assert not (tmp_path / "out").exists()


def test_cli_refusal_is_one_line_without_traceback(falcon, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    cmd = [sys.executable, "-m", "thunderpool", "import-gguf", str(falcon)]
    out = subprocess.run(
        cmd + ["--out", str(tmp_path / "o")], capture_output=True, text=True, env=env
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: GGUF architecture 'falcon'")


def test_truncated_tensor_data_is_named(tmp_path):
    """A supported file cut short fails on the first missing tensor with the fix, not a crash."""
    import gguf

    path = tmp_path / "cut.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.ones((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.truncate(path, path.stat().st_size - 64)
    reader = gguf_file.GGUFFile(path)
    with pytest.raises(ModelError, match=r"token_embd\.weight.*truncated"):
        reader.raw(reader.tensors[0])


def test_metadata_matches_the_gguf_package(tmp_path):
    """Our header reader returns what the gguf package's reader does."""
    import gguf
    from gguf_export import make_hf, write_gguf

    path = tmp_path / "q.gguf"
    write_gguf("qwen3_moe", make_hf("qwen3_moe", tmp_path / "hf"), path)
    ours = gguf_file.GGUFFile(path)
    ref = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.read_metadata() == fields
    assert [(t.name, t.shape) for t in ours.tensors] == [
        (t.name, tuple(int(d) for d in reversed(t.shape.tolist()))) for t in ref.tensors
    ]
    for t, r in zip(ours.tensors, ref.tensors, strict=True):
        np.testing.assert_array_equal(
            ours.raw(t).reshape(-1), np.asarray(r.data).view(np.uint8).reshape(-1)
        )
