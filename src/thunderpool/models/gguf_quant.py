"""GGUF tensor data -> MLX arrays: dequantize any ggml type, or repack Q4_1 / Q8_0 losslessly.

`--dtype q4|q8` stores every quantizable weight as MLX affine (group 32) whatever the source
type, so config.json's `quantization` block always describes the stored tensors.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from thunderpool.errors import ModelError

GROUP_SIZE = 32
QUANT_BITS = {"q4": 4, "q8": 8}


def dequantize(raw: np.ndarray, qtype: int, name: str) -> np.ndarray:
    """float32 values of a (rows..., bytes per row) GGUF tensor, in numpy (row-major) shape."""
    import gguf.quants
    from gguf import GGMLQuantizationType

    kind = GGMLQuantizationType(qtype)
    try:
        # Looked up at call time so that a test can stand in an older gguf package.
        values = gguf.quants.dequantize(raw, kind)
    except NotImplementedError as e:
        raise ModelError(unsupported_type(name, kind.name)) from e
    return np.asarray(values, dtype=np.float32)


def unsupported_type(name: str, type_name: str) -> str:
    return (
        f"tensor {name!r} uses quantization {type_name}, which cannot be dequantized by the "
        "installed gguf package; upgrade it (pip install -U gguf) or use another quantization "
        "of the model (F16, BF16, Q8_0, Q4_0/Q4_1, Q5_0/Q5_1 or a K-quant)"
    )


def check_dequantizable(qtype: int, name: str) -> None:
    """Fail before writing anything if `qtype` cannot be dequantized by the gguf package."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    kind = GGMLQuantizationType(qtype)
    _, type_size = GGML_QUANT_SIZES[kind]
    dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype, name)


def _fp16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_0/Q4_1 keep value i in the low nibble and value i+16 in the high nibble of byte i."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """(rows..., blocks, 32) values -> MLX's (rows..., in * bits / 32) uint32, value j of each
    word in bits j*bits and up."""
    per = 32 // bits
    q = q.astype(np.uint32).reshape(*q.shape[:-2], -1, per)
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    return np.bitwise_or.reduce(q << shifts, axis=-1).astype(np.uint32)


def _unpack_blocks(raw: np.ndarray, type_name: str):
    """(unsigned values (rows, nb, 32), scale, bias, bits) with w = scale * q + bias exactly."""
    lead = raw.shape[:-1]
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[type_name]
    blocks = np.ascontiguousarray(raw).reshape(*lead, -1, size)
    d = _fp16(blocks, 0)
    if type_name == "Q4_0":  # w = d * (q - 8)
        return _nibbles(blocks[..., 2:]), d, -8.0 * d, 4
    if type_name == "Q4_1":  # w = d * q + m
        return _nibbles(blocks[..., 4:]), d, _fp16(blocks, 2), 4
    q = blocks[..., 2:].copy().view(np.int8).astype(np.int16) + 128  # w = d * (q + 128) - 128 d
    return q.astype(np.uint8), d, -128.0 * d, 8


def q4_1_to_mlx(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Repack Q4_1 rows (rows..., n_blocks * 20 bytes) as MLX affine 4-bit (w, scales, biases)."""
    q, d, m, _ = _unpack_blocks(raw, "Q4_1")
    return _pack(q, 4), d, m


def q8_0_to_mlx(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Repack Q8_0 rows as MLX affine 8-bit: q + 128 unsigned, scale d, bias -128 d (exact)."""
    q, d, b, _ = _unpack_blocks(raw, "Q8_0")
    return _pack(q, 8), d, b


# Under q4 these keep a Q8_0 source at 8 bits, as llama.cpp's own 4-bit recipes do: the
# vocabulary matrices (a tied one is also the output head) are the most sensitive to 4 bits.
VOCAB_MATRICES = ("model.embed_tokens", "lm_head")


def lossless(raw: np.ndarray, qtype: int, dtype: str, module: str):
    """(w, scales, biases, bits) when the source maps onto MLX affine exactly, else None.

    Q4_0/Q4_1 become 4-bit (8-bit for q8: the values fit); Q8_0 becomes 8-bit for q8, and for
    q4 only in VOCAB_MATRICES (config.json records the override).
    """
    from gguf import GGMLQuantizationType

    name = GGMLQuantizationType(qtype).name
    if dtype not in QUANT_BITS or name not in ("Q4_0", "Q4_1", "Q8_0"):
        return None
    if name == "Q8_0" and dtype == "q4" and module not in VOCAB_MATRICES:
        return None
    q, scales, biases, bits = _unpack_blocks(raw, name)
    bits = max(bits, QUANT_BITS[dtype])
    return _pack(q, bits), scales, biases, bits


def quantize(values: np.ndarray, dtype: str) -> tuple[mx.array, mx.array, mx.array]:
    """MLX affine quantization (mx.quantize) of float values for --dtype q4 / q8."""
    w, scales, biases = mx.quantize(mx.array(values), group_size=GROUP_SIZE, bits=QUANT_BITS[dtype])
    return w, scales, biases


def quantizable(shape: tuple[int, ...]) -> bool:
    """Whether MLX can quantize a weight of this shape along its last axis."""
    return len(shape) >= 2 and shape[-1] % GROUP_SIZE == 0
