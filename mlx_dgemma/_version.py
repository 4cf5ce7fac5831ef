"""The package's version, declared once: ``pyproject.toml`` reads it (setuptools' dynamic
version), and so do ``mlx_dgemma.__version__``, ``mlx-dgemma --version`` and a trace's header.
Standard library only (nothing at all): ``--version`` answers without importing MLX."""

__version__ = "0.1.0"
