"""README's screenshot: the chat app on the built-in demo model, caught mid-denoising.

    python scripts/screenshot.py [OUT.svg] [--step 4]     # default ./screenshot.svg
    python scripts/screenshot.py --update-docs            # replaces the tracked docs/screenshot.svg

Runs the real app headless (Textual's test driver) at 150x45, sends a prompt, and saves an SVG
as soon as the status line reaches the given step of the first block. The tracked picture in
docs/ is written only with --update-docs, never by a plain run.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

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


DOCS_SVG = Path(__file__).resolve().parent.parent / "docs" / "screenshot.svg"  # README's picture


def output_path(path: str | None, update_docs: bool) -> Path:
    """Where to write: ``path`` (default ./screenshot.svg), or README's picture with
    ``update_docs``; README's picture by any other route is refused."""
    if update_docs:
        if path is not None and Path(path).resolve() != DOCS_SVG:
            raise SystemExit("screenshot.py: give either a path or --update-docs, not both")
        return DOCS_SVG
    out = Path(path or "screenshot.svg")
    if out.resolve() == DOCS_SVG:
        raise SystemExit(f"screenshot.py: {path} is README's tracked picture; pass --update-docs to replace it")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("path", nargs="?", help="the SVG to write (default: ./screenshot.svg)")
    p.add_argument("--update-docs", action="store_true", help=f"replace README's picture, {DOCS_SVG.name} in docs/")
    p.add_argument("--step", type=int, default=4)
    p.add_argument("--prompt", default="And God said, Let there be light")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    out = output_path(a.path, a.update_docs)
    asyncio.run(shoot(str(out), a.step, a.prompt, a.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
