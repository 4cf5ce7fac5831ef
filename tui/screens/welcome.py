"""No model to chat with: none given and none configured, or the given one failed to load.
Says how to get the real model and offers the built-in demo; fits an 80x24 terminal (the
buttons come first, the text scrolls)."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, Footer, Markdown, Static

WELCOME = """\
DiffusionGemma is published on Hugging Face as a GGUF file (16.8 GB). Download it,
convert it once for this machine and chat with it:

```
hf download unsloth/diffusiongemma-26B-A4B-it-GGUF \\
    diffusiongemma-26B-A4B-it-Q4_K_M.gguf --local-dir .
mlx-dgemma convert diffusiongemma-26B-A4B-it-Q4_K_M.gguf \\
    ~/models/dgemma --precision auto
mlx-dgemma chat --model ~/models/dgemma
```

`--precision auto` writes the most exact form that runs here: the exact one (bit for bit)
where memory allows, a smaller one on smaller Macs (`mlx-dgemma plan FILE.gguf` shows
which, before you convert; `--machine all`: every Mac).

`--model FILE.gguf` also works (converted in memory at every start).
`export MLX_DGEMMA_MODEL=~/models/dgemma` makes it the default.

Or watch it work right now with the **built-in demo model**: a tiny model (9.9M
parameters) trained on the King James Bible, not DiffusionGemma's weights. It continues
any prompt in the style of the KJV, and its canvas denoises as the real model's does.
"""


class WelcomeScreen(Screen):
    BINDINGS = [Binding("d", "demo", "Demo model"),
                Binding("q", "app.quit", "Quit", show=False)]  # the footer already shows ^q Quit

    def __init__(self, error: str | None = None, model: str | None = None, **kw):
        super().__init__(**kw)
        self.error = error
        self.model = model

    def compose(self) -> ComposeResult:
        if self.error is None:
            yield Static("mlx-dgemma: no model yet", id="welcome-title")
        else:
            yield Static(f"Could not load the model: {self.error}\n"
                         "Give a .gguf file or a directory written by mlx-dgemma convert "
                         "(mlx-dgemma chat --model PATH), or try the demo:", id="welcome-error")
        with Horizontal(id="welcome-buttons"):
            yield Button("Try the demo model (d)", variant="primary", id="demo")
            yield Button("Quit (q)", id="quit")
        with VerticalScroll(id="welcome"):
            yield Markdown(WELCOME)
        yield Footer()

    @on(Button.Pressed, "#demo")
    def action_demo(self) -> None:
        self.app.start_demo()

    @on(Button.Pressed, "#quit")
    async def _quit(self) -> None:
        await self.app.action_quit()
