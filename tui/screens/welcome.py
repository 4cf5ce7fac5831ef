"""First run: no model given and none configured."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.containers import Center, Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Button, Markdown

WELCOME = """\
# mlx-dgemma

No model yet. DiffusionGemma is published as a GGUF file
(`diffusiongemma-26B-A4B-it-Q4_K_M.gguf`, 16.8 GB). Convert it once, losslessly:

```
mlx-dgemma convert diffusiongemma-26B-A4B-it-Q4_K_M.gguf ~/models/dgemma
mlx-dgemma chat --model ~/models/dgemma
```

(`mlx-dgemma chat --model FILE.gguf` also works; it converts in memory at every start.)
Set `MLX_DGEMMA_MODEL=~/models/dgemma` to make it the default.

Or watch it work right now with the **built-in demo model**: a tiny model (9.9M
parameters) trained on the King James Bible, not DiffusionGemma's weights. It continues
any prompt in the style of the KJV, and its canvas denoises as the real model's does.
"""


class WelcomeScreen(Screen):
    BINDINGS = [("d", "demo", "Demo"), ("q", "app.quit", "Quit")]

    def compose(self) -> ComposeResult:
        with Vertical(id="welcome"):
            yield Markdown(WELCOME)
            with Center():
                with Horizontal(id="welcome-buttons"):
                    yield Button("Try the demo model (d)", variant="primary", id="demo")
                    yield Button("Quit (q)", id="quit")

    @on(Button.Pressed, "#demo")
    def action_demo(self) -> None:
        self.app.start_demo()

    @on(Button.Pressed, "#quit")
    def _quit(self) -> None:
        self.app.exit()
