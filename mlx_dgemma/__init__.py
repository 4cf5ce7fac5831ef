"""mlx-dgemma: DiffusionGemma (block text diffusion, Gemma 4 MoE) on MLX, from GGUF files.

    from mlx_dgemma import load, generate
    runtime = load("path/to/converted-dir-or-model.gguf")  # model, tokenizer, defaults, precision
    print(generate(runtime, "Why is the sky blue?"))
"""

from __future__ import annotations

from ._version import __version__

_EVENTS = ("StepEvent", "BlockEvent", "DoneEvent", "PrefillEvent", "PrefillProgressEvent", "Event", "Stats")

__all__ = ["load", "load_demo", "generate", "stream_generate", "ChatSession", "Runtime", "GenerationRequest",
           *_EVENTS, "__version__"]


def __getattr__(name: str):
    # Lazy: `import mlx_dgemma` stays cheap (the CLI's --help, the TUI's first paint).
    if name in ("load", "load_demo"):
        from . import loader

        return getattr(loader, name)
    if name == "Runtime":
        from .runtime import Runtime

        return Runtime
    if name == "GenerationRequest":  # standard library only
        from .request import GenerationRequest

        return GenerationRequest
    if name in ("generate", "stream_generate", "ChatSession"):
        from . import generation as g

        return getattr(g, name)
    if name in _EVENTS:
        # Plain data (numpy only): no MLX import.
        from . import events

        return getattr(events, name)
    raise AttributeError(name)
