"""thunderpool: several machines, one inference machine (MLX distributed TP + PP)."""

import sys

__version__ = "0.1.0"


def hide_torch() -> None:
    """For a process that runs on MLX alone (a rank, the CLI): transformers, which mlx-lm's
    tokenizer imports, imports torch wherever it is installed, ~3 s of every start. Marked
    absent (None in sys.modules: find_spec says missing), transformers leaves it out."""
    sys.modules.setdefault("torch", None)
