"""Parity helpers: skip cleanly without torch/transformers, then reuse the package's peers."""

import pytest

torch = pytest.importorskip("torch", reason="parity needs torch (pip install torch==2.13.0)")
transformers = pytest.importorskip("transformers", minversion="5.23",
                                   reason="parity needs transformers >= 5.23 (DiffusionGemma)")

from mlx_dgemma.bench.peers import HFRunner, hf_model_from_gguf  # noqa: E402,F401
