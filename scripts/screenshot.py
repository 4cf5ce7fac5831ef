"""README's screenshot: the chat app on the built-in demo model, caught mid-denoising.

    python scripts/screenshot.py [docs/screenshot.svg] [--step 4]

Runs the real app headless (Textual's test driver) at 150x45, sends a prompt, and saves an SVG
as soon as the status line reaches the given step of the first block.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from mlx_dgemma.tui.app import DGemmaApp
from mlx_dgemma.tui.engine import ModelBackend


def screen_text(app) -> str:
    return " ".join(strip.text for strip in app.screen._compositor.render_strips())


async def shoot(path: str, step: int, prompt: str, seed: int) -> None:
    app = DGemmaApp(ModelBackend(demo=True))
    async with app.run_test(size=(150, 45)) as pilot:
        for _ in range(1200):  # the load: up to a minute
            if "ready" in screen_text(app):
                break
            await pilot.pause(0.05)
        app.backend.session.params = app.backend.session.params.with_overrides(seed=seed)
        await pilot.click("#prompt")
        await pilot.press(*prompt, "enter")
        target = f"step {step}/"
        for _ in range(6000):  # up to five minutes of steps on a slow CPU
            if target in screen_text(app):
                break
            await pilot.pause(0.05)
        else:
            raise SystemExit(f"never reached {target!r}")
        app.save_screenshot(path)
        print(f"wrote {path}", file=sys.stderr)
        await pilot.press("escape")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("path", nargs="?", default="docs/screenshot.svg")
    p.add_argument("--step", type=int, default=4)
    p.add_argument("--prompt", default="And God said, Let there be light")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    asyncio.run(shoot(a.path, a.step, a.prompt, a.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
