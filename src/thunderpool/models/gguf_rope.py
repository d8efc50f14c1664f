"""Llama 3 RoPE scaling back from llama.cpp's `rope_freqs.weight`.

llama.cpp's converter turns HF's `rope_scaling: {rope_type: llama3, factor, low_freq_factor,
high_freq_factor, original_max_position_embeddings}` into one divisor per frequency; mlx-lm wants
the parameters. Only the divisors at the model's own frequencies matter, so any parameters that
reproduce them are exact: fit them, recompute the divisors as llama.cpp does, and refuse the
file if they differ.
"""

from __future__ import annotations

import math

import numpy as np

from thunderpool.errors import ModelError


def llama3_divisors(scaling: dict, base: float, dims: int) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for these parameters (its formula, vectorized)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi * base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    smooth = (old / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, mid))


def llama3_scaling(divisors: np.ndarray, base: float, dims: int) -> dict | None:
    """mlx-lm's llama3 rope_scaling reproducing `divisors`, None when they are all 1."""
    divisors = np.asarray(divisors, dtype=np.float64)
    factor = float(divisors.max())
    if len(divisors) != dims // 2:
        raise ModelError(f"rope_freqs.weight has {len(divisors)} values for {dims} rope dims")
    if factor <= 1.0 + 1e-6:
        return None
    wavelen = 2 * math.pi * base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    # Llama 3.1 - 3.3's published values first; then a fit on the smooth band, where
    # smooth = (old / wavelen - low) / (high - low) is linear in 1 / wavelen.
    candidates = [_scaling(factor, 1.0, 4.0, 8192.0)]
    middle = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
    if middle.sum() >= 2:
        smooth = (1 / divisors[middle] - 1 / factor) / (1 - 1 / factor)
        slope, icpt = np.polyfit(1 / wavelen[middle], smooth, 1)
        if icpt < 0:
            # low = 1 by choice: scaling old, low and high together changes nothing.
            high = 1 - 1 / icpt
            candidates.append(_scaling(factor, 1.0, high, slope * (high - 1)))
    for scaling in candidates:
        if np.allclose(llama3_divisors(scaling, base, dims), divisors, rtol=1e-4, atol=1e-6):
            return scaling
    raise ModelError(
        "rope_freqs.weight does not follow Llama 3's rope scaling, which is all mlx-lm's llama "
        "model can express; pass the model's Hugging Face safetensors directory instead"
    )


def _scaling(factor: float, low: float, high: float, old: float) -> dict:
    old = round(old) if abs(old - round(old)) < 1e-3 * old else old
    return {
        "rope_type": "llama3",
        "factor": float(f"{factor:.7g}"),
        "low_freq_factor": float(f"{low:.7g}"),
        "high_freq_factor": float(f"{high:.7g}"),
        "original_max_position_embeddings": old,
    }
