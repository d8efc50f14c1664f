"""thunderpool: several machines, one inference machine (MLX distributed TP + PP)."""

__version__ = "0.1.0"
