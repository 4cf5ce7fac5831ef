"""GGUF -> MLX conversion (installed as mlx_dgemma.convert)."""
