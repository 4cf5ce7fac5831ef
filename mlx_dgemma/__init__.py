"""mlx-dgemma: DiffusionGemma on MLX from GGUF files."""

__version__ = "0.1.0"
