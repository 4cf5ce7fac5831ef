"""What the chat TUI's tests share: the terminal size, waiting on the app, sending a message,
reading the screen (tests/test_tui_*.py, one file per screen)."""

from __future__ import annotations

from mlx_dgemma.tui.screens.chat import ChatScreen

from .tui_fakes import ScriptedBackend


SIZE = (140, 40)


async def wait_for(pilot, cond, timeout=20.0):
    waited = 0.0
    while not cond():
        await pilot.pause(0.05)
        waited += 0.05
        if waited > timeout:
            raise AssertionError("timed out waiting for the app")


async def send(pilot, text):
    await pilot.click("#prompt")
    for ch in text:
        await pilot.press(ch if ch != " " else "space")
    await pilot.press("enter")


def screen(app) -> ChatScreen:
    assert isinstance(app.screen, ChatScreen)
    return app.screen


def done(app):
    s = app.screen
    return isinstance(s, ChatScreen) and s._last_done is not None and not s.busy


async def ask(pilot, backend, text="q"):
    """Wait for the model, send ``text`` and wait until the answer is done."""
    await wait_for(pilot, lambda: backend.loaded)
    await send(pilot, text)
    await wait_for(pilot, lambda: done(pilot.app))


def screen_text(app) -> str:
    """What the terminal shows, as text, with whitespace runs collapsed (wrapped lines join)."""
    lines = [strip.text for strip in app.screen._compositor.render_strips()]
    text = " ".join(lines).translate({ord(c): " " for c in "█▊▎│▔▁▄▀"})  # borders, not text
    return " ".join(text.split())


def failing_backend(error: Exception) -> ScriptedBackend:
    """A scripted backend whose every answer raises ``error`` (the UI must show it, not crash)."""

    class Failing(ScriptedBackend):
        def stream(self, prompt, cancel, **params):
            raise error
            yield  # pragma: no cover

    return Failing()


class FailingLoad(ScriptedBackend):
    label = "/models/not-a-gguf"

    def load(self, progress):
        from mlx_dgemma.errors import ModelFilesError

        raise ModelFilesError("/models/not-a-gguf: not a GGUF file")


# --------------------------------------------------------------------------- the status line fits


def status_row(app) -> str:
    """The status line as the terminal shows it."""
    row = screen(app).query_one("#status").region.y
    return app.screen._compositor.render_strips()[row].text
