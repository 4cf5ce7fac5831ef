"""The chat TUI's engine and backend seam (every state shown, errors told apart by class),
the status line's fit, and the chat command."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mlx_dgemma.tui.app import DGemmaApp
from mlx_dgemma.request import GenerationRequest
from mlx_dgemma.tui.engine import Backend, ChatEngine, ModelBackend
from mlx_dgemma.tui.messages import STATES, EngineStatus
from mlx_dgemma.tui.screens.welcome import WelcomeScreen

from .tui_fakes import ScriptedBackend
from .tui_helpers import FailingLoad, SIZE, ask, done, failing_backend, screen, send, status_row, wait_for


def test_core_never_imports_textual():
    code = ("import sys, mlx_dgemma, mlx_dgemma.loader, mlx_dgemma.model, mlx_dgemma.generation, mlx_dgemma.trace, "
            "mlx_dgemma.cli, mlx_dgemma.server, mlx_dgemma.convert.converter, mlx_dgemma.convert.verify; "
            "from mlx_dgemma import load, generate, stream_generate; "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'textual'], 'textual imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- the backend seam


def protocol_problems(backend) -> list[str]:
    """How ``backend`` differs from the Backend protocol: missing members, attributes of the
    wrong type, methods whose parameters differ (names and kinds, as the engine calls them)."""
    import inspect
    import types
    import typing

    problems = [] if isinstance(backend, Backend) else ["not a Backend (runtime check)"]
    for name, kind in typing.get_type_hints(Backend).items():
        value = getattr(backend, name, problems)
        origin = typing.get_origin(kind)
        allowed = typing.get_args(kind) if origin in (typing.Union, types.UnionType) else (origin or kind)
        if value is problems:
            problems.append(f"{name}: missing")
        elif not isinstance(value, allowed):
            problems.append(f"{name}: {type(value).__name__}, expected {kind}")
    for name, member in vars(Backend).items():
        if name.startswith("_") or not callable(member):
            continue
        if not callable(getattr(backend, name, None)):
            problems.append(f"{name}(): missing")
            continue
        want = [(p.name, p.kind) for p in inspect.signature(member).parameters.values()][1:]
        have = [(p.name, p.kind) for p in inspect.signature(getattr(backend, name)).parameters.values()]
        if have != want:
            problems.append(f"{name}{inspect.signature(getattr(backend, name))}: expected {inspect.signature(member)}")
    return problems


def test_the_model_backend_and_the_scripted_one_satisfy_the_backend_protocol(tiny_model_dir):
    assert protocol_problems(ScriptedBackend()) == []
    assert protocol_problems(ModelBackend(demo=True)) == []
    loaded = ModelBackend(model=str(tiny_model_dir))
    loaded.load(lambda line: None)
    assert protocol_problems(loaded) == []

    class Drifted(ScriptedBackend):  # the check itself: a backend that drifted from the protocol
        is_demo = "no"

        def piece(self, token: int) -> str:
            return ""

    problems = protocol_problems(Drifted())
    assert [p.split(":")[0].split("(")[0] for p in problems] == ["is_demo", "piece"], problems


# --------------------------------------------------------------------------- every status shows


def status_text(app) -> str:
    return str(screen(app).query_one("#status").render())


def placeholder(app) -> str:
    return screen(app).query_one("#prompt").placeholder


# What each engine state shows; a state the chat screen dropped would time out here.
STATUS_SHOWN = {
    "loading": lambda app: status_text(app) == "loading: DETAIL" and placeholder(app).startswith("Loading the model"),
    "ready": lambda app: (status_text(app) == "ready: DETAIL" and not screen(app).busy
                          and placeholder(app) == "Message (Enter to send)"),
    "busy": lambda app: (screen(app).busy and status_text(app).startswith("answering")
                         and placeholder(app).startswith("Answering")),
    "failed": lambda app: (isinstance(app.screen, WelcomeScreen) and app.load_error == "DETAIL"
                           and "DETAIL" in str(app.screen.query_one("#welcome-error").render())),
}


def test_every_engine_state_has_a_visible_check():
    assert sorted(STATUS_SHOWN) == sorted(STATES)
    with pytest.raises(ValueError, match="'done'"):
        EngineStatus("done")  # a state no screen handles cannot be posted


def test_the_engine_posts_every_state_and_only_those():
    posted: list[str] = []
    record = lambda m: posted.append(m.state) if isinstance(m, EngineStatus) else None  # noqa: E731
    engine = ChatEngine(ScriptedBackend(steps=1, blocks=1), record)
    engine.start()
    engine.generate("q", GenerationRequest(), 1)
    assert engine.worker.submit(lambda t: None).done.wait(10)  # after the answer, in order
    engine.stop()
    assert engine.join(10)
    engine = ChatEngine(FailingLoad(), record)
    engine.start()
    assert engine.join(10)  # a failed load ends the worker
    assert posted == ["loading", "loading", "ready", "busy", "ready", "loading", "failed"]
    assert set(posted) == set(STATES)


@pytest.mark.parametrize("state", STATES)
async def test_each_engine_state_is_shown(state):
    backend = ScriptedBackend()
    app = DGemmaApp(backend)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine.loaded and status_text(app).startswith("ready"))
        s = screen(app)
        s.busy = state == "ready"  # the opposite of what the state should leave
        s.query_one("#status").update("before")
        s.query_one("#prompt").placeholder = "before"
        s.post_message(EngineStatus(state, "DETAIL"))
        await wait_for(pilot, lambda: STATUS_SHOWN[state](app))


# --------------------------------------------------------------------------- errors by class


class BudgetTooSmall(Exception):
    """Not one of ours: shown with its type name."""


@pytest.mark.parametrize("error, shown", [
    ("MemoryBudgetError", "error: prompt: 9 tokens need about 2 GB more memory"),  # a DGemmaError subclass
    ("BudgetTooSmall", "error: BudgetTooSmall: prompt: 9 tokens need about 2 GB more memory"),
])
async def test_errors_are_told_apart_by_class_not_by_message(error, shown):
    from mlx_dgemma.errors import MemoryBudgetError

    cls = {"MemoryBudgetError": MemoryBudgetError, "BudgetTooSmall": BudgetTooSmall}[error]

    app = DGemmaApp(failing_backend(cls("prompt: 9 tokens need about 2 GB more memory")))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine.loaded)
        await send(pilot, "q")
        await wait_for(pilot, lambda: bool(screen(app).query(".error")))
        assert str(screen(app).query_one(".error").render()) == shown
        assert status_text(app) == shown  # the status line says it too, brackets and all


@pytest.mark.parametrize("width", [80, 100])
async def test_the_status_line_fits_80_and_100_columns(width):
    backend = ScriptedBackend(steps=4, blocks=2)
    app = DGemmaApp(backend)
    async with app.run_test(size=(width, 24)) as pilot:
        await ask(pilot, backend)
        await pilot.pause(0.1)
        done = status_row(app)
        for part in ("finished: end of turn", "8 steps", "0.25 s/step", "peak 0.20 GB", "fast (bfloat16)"):
            assert part in done, done
        await pilot.press("ctrl+b")
        await pilot.pause(0.1)
        step = status_row(app)
        for part in ("block 2/≤2", "step 3/48", "0.25 s/step", "mem 0.12 GB", "fast (bfloat16)", "replay ^b/^f"):
            assert part in step, step
        assert step.rstrip().endswith("replay ^b/^f")  # nothing cut at the edge
    if width == 100:
        assert "ctrl+b/f replay" in done and "T=0." in step  # room for more at 100 columns


def test_status_parts_are_left_out_whole_least_important_first():
    from mlx_dgemma.tui.widgets.status import fit

    parts = [("a", 0), ("bb", 2), ("cc", 1), ("dd", 2), ("e", 0)]
    assert fit(parts, 20) == "a  bb  cc  dd  e"
    assert fit(parts, 12) == "a  bb  cc  e"  # the rightmost of the highest rank goes first
    assert fit(parts, 9) == "a  cc  e"
    assert fit(parts, 1) == "a  e"  # rank 0 stays, even when too wide


def test_the_model_backend_passes_thinking_and_the_system_prompt_to_the_session(tiny_model_dir):
    backend = ModelBackend(model=str(tiny_model_dir), think=True, system="S1")
    backend.load(lambda line: None)
    assert backend.session.enable_thinking is True
    assert backend.session.messages == [{"role": "system", "content": "S1"}]
    request = GenerationRequest.of({"max_new_tokens": 1, "max_denoising_steps": 1, "seed": 0})
    events = list(backend.stream("hi", lambda: False, think=False, request=request))
    assert backend.session.enable_thinking is False and events
    assert [m["role"] for m in backend.session.messages] == ["system", "user", "assistant"]
    backend.reset("S2")
    assert backend.session.messages == [{"role": "system", "content": "S2"}] and not backend.session.history
    backend.reset(None)
    assert backend.session.messages == []


def test_chat_command_takes_think_and_system(monkeypatch):
    from mlx_dgemma import cli
    from mlx_dgemma.tui import app as app_module

    seen = {}
    monkeypatch.setattr(app_module, "run_app", lambda **kw: seen.update(kw) or 0)
    monkeypatch.setattr("mlx_dgemma.launch.need_terminal", lambda command="chat": None)  # as in a terminal
    assert cli.main(["chat", "--demo", "--think", "--system", "Be brief."]) == 0
    assert seen["think"] is True and seen["system"] == "Be brief."
    assert cli.main(["chat", "--demo"]) == 0
    assert seen["think"] is False and seen["system"] is None
    seen.clear()
    assert cli.main(["chat", "--demo", "--system", "a\udcff"]) == 2  # undecodable argv bytes: refused first
    assert seen == {}


def test_the_screenshot_script_writes_the_tracked_picture_only_when_asked(tmp_path, monkeypatch):
    from pathlib import Path

    from tests.scripts import ROOT, load_script

    mod = load_script("scripts/screenshot.py")
    docs = ROOT / "docs" / "screenshot.svg"
    monkeypatch.chdir(tmp_path)
    assert mod.output_path(None, False) == Path("screenshot.svg")  # untracked, in the current directory
    assert mod.output_path(str(tmp_path / "x.svg"), False) == tmp_path / "x.svg"
    assert mod.output_path(None, True) == docs.resolve()
    with pytest.raises(SystemExit, match="--update-docs"):
        mod.output_path(str(docs), False)
    shots = []

    async def shoot(path, *args):  # the app itself is not run here
        shots.append(path)

    monkeypatch.setattr(mod, "shoot", shoot)
    assert mod.main([]) == 0 and shots == ["screenshot.svg"]
    with pytest.raises(SystemExit):
        mod.main([str(docs)])
    assert shots == ["screenshot.svg"]


def test_chat_without_a_terminal_is_refused_in_one_line():
    """Textual reads keys from stdin and draws on stderr: with stdin not a terminal (a script,
    cron, `< /dev/null`) the app used to start anyway, draw escape codes and wait forever."""
    r = subprocess.run([sys.executable, "-m", "mlx_dgemma", "chat", "--demo"], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=60)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1, (r.returncode, r.stderr[-500:])
    assert err[0].startswith("mlx-dgemma chat: error: ") and "terminal" in err[0] and "generate" in err[0]
    assert "\x1b[" not in r.stdout + r.stderr  # nothing drawn
