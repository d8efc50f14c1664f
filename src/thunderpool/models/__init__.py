"""Model sources: an HF/MLX dir, a Hugging Face repo id or a GGUF file -> an MLX model dir."""

from thunderpool.models.gguf import import_gguf
from thunderpool.models.source import DEFAULT_MODEL_NAME, default_model_dir, resolve_model

__all__ = ["DEFAULT_MODEL_NAME", "default_model_dir", "import_gguf", "resolve_model"]
