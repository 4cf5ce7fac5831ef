"""GGUF -> MLX conversion (installed as mlx_dgemma.convert).

The public names below are what the core may use (docs/architecture.md): a GGUF opened as a
:class:`GGUFSource`, whose tensors come as :class:`Converted` NumPy arrays (bfloat16 ones
tagged :class:`BF16Payload`).
"""

from .source import GGUFSource
from .tensors import BF16Payload, Converted

__all__ = ["BF16Payload", "Converted", "GGUFSource"]
