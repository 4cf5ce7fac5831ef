"""Ctrl+C, SIGTERM and SIGHUP at any moment of a command: the one line and the usual status.

A signal that lands inside mlx.core's nanobind init was swallowed (the command ran to its end),
inside torch's (imported by mlx-lm through transformers) it aborted the process (status -6); a
SIGTERM before main() killed the process without the one line, a Ctrl+C there printed a
traceback; in the chat app's event loop the interrupt landed in a task (a traceback after the
line). These tests are deterministic: they check where the imports happen, or send the signal
from inside the code, at the moment that failed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from mlx_dgemma.errors import Terminated, hold_interrupts, terminate_as_interrupt

# extension modules whose native init mishandled a signal (see above; tokenizers is pyo3 like
# pydantic-core, whose init turned Ctrl+C into a PanicException)
NATIVE = ("mlx", "torch", "tokenizers", "pydantic_core", "numpy")

# Run the CLI with an import hook that records each of NATIVE's extension modules imported by the
# main thread while SIGINT or SIGTERM would raise there (not held), with the import's frames of ours.
SPY = textwrap.dedent("""
    import importlib.machinery as m, json, os, signal, sys, threading, traceback

    found = []

    class Spy:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name.split(".")[0] not in {native} or threading.current_thread() is not threading.main_thread():
                return None
            term = getattr(signal.getsignal(signal.SIGTERM), "__qualname__", "")  # errors.terminate_as_interrupt's
            if signal.getsignal(signal.SIGINT) is not signal.default_int_handler and \\
                    not term.startswith(("_raise_terminated", "terminate_as_interrupt")):
                return None
            spec = m.PathFinder.find_spec(name, path, target)
            if spec is not None and isinstance(spec.loader, m.ExtensionFileLoader):
                found.append([name] + [f"{{os.path.basename(f.filename)}}:{{f.lineno}}"
                                       for f in traceback.extract_stack() if "mlx_dgemma" in f.filename][-4:])
            return None

    sys.meta_path.insert(0, Spy)
    from mlx_dgemma.cli import main
    code = main(sys.argv[1:])
    print(json.dumps(found))
    sys.exit(code)
""").format(native=set(NATIVE))


def _unheld_native_imports(argv: list[str], tmp_path) -> list[list[str]]:
    r = subprocess.run([sys.executable, "-c", SPY, *argv], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path, env={**os.environ, "MLX_DGEMMA_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


@pytest.mark.parametrize("command", ["plan", "verify", "generate"])
def test_native_imports_happen_with_signals_held(command, tmp_path, tiny_gguf, tiny_model_dir):
    """plan and verify imported MLX (and plan, through mlx-lm, torch) with Ctrl+C live: an interrupt
    landing there ran the command to its end or aborted it; generate imported tokenizers so."""
    argv = {"plan": ["plan", str(tiny_model_dir)],
            "verify": ["verify", str(tiny_model_dir), str(tiny_gguf)],
            "generate": ["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--max-tokens", "4",
                         "--steps", "1"]}[command]
    assert _unheld_native_imports(argv, tmp_path) == []


def test_hold_interrupts_holds_sigterm_too():
    """SIGTERM (under terminate_as_interrupt) is held like Ctrl+C, then raised as Terminated."""
    reached = False
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated) as e:
        with terminate_as_interrupt(), hold_interrupts():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)  # the handler runs here: held, not raised
            reached = True
    assert reached and e.value.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before  # restored to what it was before


def test_sigterm_while_the_parser_is_built_is_one_line(tmp_path):
    """SIGTERM as the parser is built (it imports bench's or serve's options) killed the process
    without a word: now it is the one line and status 143, as later."""
    script = textwrap.dedent("""
        import os, signal, sys, time
        from mlx_dgemma import cli
        real = cli.build_parser
        def build_parser(argv):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
            return real(argv)
        cli.build_parser = build_parser
        sys.exit(cli.main(["plan", "/nonexistent/model"]))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 128 + signal.SIGTERM, (r.returncode, r.stderr)
    assert r.stderr.splitlines() == ["mlx-dgemma: interrupted; nothing partial was kept"], r.stderr


class _ChatOnPty:
    """``cmd`` (the chat app) on a pseudo-terminal of 100x30; every wait bounded."""

    def __init__(self, cmd: list[str], tmp_path):
        import fcntl
        import pty
        import struct
        import termios

        self.primary, secondary = pty.openpty()
        fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
        self.proc = subprocess.Popen(cmd, stdin=secondary, stdout=secondary, stderr=secondary, close_fds=True,
                                     cwd=tmp_path, env={**os.environ, "MLX_DGEMMA_CACHE": str(tmp_path / "cache"),
                                                        "TERM": "xterm-256color"})
        os.close(secondary)
        self.out = b""

    def read_until(self, pred, seconds: float) -> bool:
        import select

        deadline = time.monotonic() + seconds
        while not pred() and time.monotonic() < deadline:
            if select.select([self.primary], [], [], 0.2)[0]:
                try:
                    self.out += os.read(self.primary, 65536)
                except OSError:  # the app exited and closed the terminal
                    return pred()
        return pred()

    def wait(self, seconds: float) -> int:
        try:
            self.read_until(lambda: self.proc.poll() is not None, seconds)
            return self.proc.wait(5)
        finally:
            self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        if self.primary is not None:
            os.close(self.primary)
            self.primary = None


def test_kill_int_ends_chat_with_the_one_line(tmp_path):
    """``kill -INT`` to a running chat app ended it with status 0 and no word (asyncio.run turned
    SIGINT into a cancellation that Textual took for a normal exit); now as SIGTERM: the one line,
    130. Run on a pseudo-terminal; every wait is bounded (the outcome does not depend on timing:
    the signal is sent once the app is idle and ready, waiting in the event loop's select)."""
    chat = _ChatOnPty([sys.executable, "-m", "mlx_dgemma", "chat", "--demo"], tmp_path)
    try:
        assert chat.read_until(lambda: b"ready: demo model" in chat.out, 120), chat.out[-2000:]
        chat.proc.send_signal(signal.SIGINT)
        code = chat.wait(60)
    finally:
        chat.close()
    out = chat.out
    assert code == 130 and b"mlx-dgemma chat: interrupted; nothing partial was kept" in out, (code, out[-500:])
    assert b"Traceback" not in out


# The chat app with a signal sent from inside the chat screen's message handler (a task of the
# event loop), as the status line says the model is ready
CHAT_SIGNALLED = textwrap.dedent("""
    import os, signal, sys
    from mlx_dgemma.tui.widgets import status
    real = status.StatusLine.update
    def update(self, content="", **kw):
        real(self, content, **kw)
        if str(content).startswith("ready: "):
            os.kill(os.getpid(), signal.{sig})
            for _ in range(100000):  # the handler runs here, inside the task
                pass
    status.StatusLine.update = update
    from mlx_dgemma.cli import main
    sys.exit(main(["chat", "--demo"]))
""")


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_inside_the_chat_apps_event_loop_is_one_line(sig, tmp_path):
    """The handlers raised the interrupt inside whichever task of the event loop ran: after the
    one line came "Task exception was never retrieved" and a traceback (2 of 10 ``kill -INT``
    to an idle app; every time when it lands in a task, as here). Now the handler asks the app
    to exit, and the interrupt is raised once it has."""
    chat = _ChatOnPty([sys.executable, "-c", CHAT_SIGNALLED.format(sig=sig)], tmp_path)
    try:
        code = chat.wait(180)
    finally:
        chat.close()
    signum = getattr(signal, sig)
    out = chat.out.replace(b"\r\n", b"\n")
    assert code == (130 if signum == signal.SIGINT else 128 + signum), (code, out[-1500:])
    tail = out[out.rindex(b"\x1b") + 1:] if b"\x1b" in out else out  # after the app's last escape code
    assert b"Traceback" not in out and b"never retrieved" not in out, out[-1500:]
    assert tail.rstrip().endswith(b"mlx-dgemma chat: interrupted; nothing partial was kept"), out[-1500:]


# A signal sent from inside the command as the command line's module begins to import: where
# a SIGTERM or Ctrl+C landed in the first ~0.5 s of every command (Python's start-up, then
# mlx_dgemma.cli's imports, before main() installed its handlers). `entry` is how the command is
# started: `python -m mlx_dgemma`, or the console script's entry point as pip's script calls it.
EARLY = textwrap.dedent("""
    import importlib, os, signal, sys, time
    from importlib.metadata import entry_points

    class Hook:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "mlx_dgemma.cli":
                os.kill(os.getpid(), signal.{sig})
                time.sleep(0.2)  # the handler runs here
            return None

    sys.meta_path.insert(0, Hook)
    sys.argv = ["mlx-dgemma", "plan", "/nonexistent/model"]
    if "{entry}" == "module":
        import runpy
        runpy.run_module("mlx_dgemma", run_name="__main__", alter_sys=True)
    else:
        ep = entry_points(group="console_scripts")["mlx-dgemma"]
        sys.exit(getattr(importlib.import_module(ep.module), ep.attr)())
""")


@pytest.mark.parametrize("entry", ["module", "console-script"])
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_signal_before_main_is_one_line(entry, sig, tmp_path):
    """SIGTERM/SIGHUP before main() killed the command without a word (status -15/-1), Ctrl+C
    printed a KeyboardInterrupt traceback: the entry now notes them from its first statement and
    main() raises the first one where it prints the one line (status 128 + signal, 130)."""
    # cwd: not the source tree, whose mlx_dgemma.egg-info (an older build's metadata) would be found first
    r = subprocess.run([sys.executable, "-c", EARLY.format(sig=sig, entry=entry)], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    signum = getattr(signal, sig)
    assert r.returncode == (130 if signum == signal.SIGINT else 128 + signum), (r.returncode, r.stderr[-2000:])
    assert r.stderr.splitlines() == ["mlx-dgemma: interrupted; nothing partial was kept"], r.stderr[-2000:]


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_signal_in_the_interpreters_exit_keeps_the_status(sig):
    """After main() returned, the interpreter's exit (torch's and MLX's teardown: seconds on a
    loaded machine) ended by the signal, without a word: now the status is the command's."""
    script = textwrap.dedent(f"""
        import atexit, os, signal, sys, time
        def late():
            os.kill(os.getpid(), signal.{sig})
            time.sleep(0.2)
        atexit.register(late)
        sys.argv = ["mlx-dgemma", "plan", "/nonexistent/model"]
        import runpy
        runpy.run_module("mlx_dgemma", run_name="__main__", alter_sys=True)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])  # plan's: no such model
    assert len(r.stderr.splitlines()) == 1 and "/nonexistent/model" in r.stderr, r.stderr[-2000:]


def test_an_ignored_sighup_stays_ignored():
    """``nohup mlx-dgemma ...`` ignores SIGHUP so that the command outlives its terminal; the
    command line turned it back into a stop (status 129). Now ignored stays ignored (Ctrl+C
    ignored in a background job too, as before)."""
    script = textwrap.dedent("""
        import os, signal, sys, time
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup starts it
        from mlx_dgemma import cli
        real = cli.build_parser
        def build_parser(argv):
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.2)
            return real(argv)
        cli.build_parser = build_parser
        sys.exit(cli.main(["plan", "/nonexistent/model"]))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "/nonexistent/model" in r.stderr and "interrupted" not in r.stderr, \
        (r.returncode, r.stderr[-2000:])


# generate on a terminal, interrupted while its step line shows (SIGINT sent from the second step)
GENERATE_INTERRUPTED = textwrap.dedent("""
    import os, signal, sys, time
    from mlx_dgemma import cli, cli_generate
    real = cli_generate.StepLine.show
    def show(self, ev):
        real(self, ev)
        if ev.step == 2:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
    cli_generate.StepLine.show = show
    sys.exit(cli.main(["generate", "--demo", "--prompt", "hi", "--seed", "0"]))
""")


def test_ctrl_c_during_generate_erases_the_step_line(tmp_path):
    """The step line (`[block 1 (max 4) step 2/48] ...`, stderr on a terminal) stayed on the terminal
    after Ctrl+C, with the one line written after it; it is erased however the loop ends."""
    run = _ChatOnPty([sys.executable, "-c", GENERATE_INTERRUPTED], tmp_path)
    try:
        code = run.wait(180)
    finally:
        run.close()
    out = run.out
    assert code == 130, (code, out[-800:])
    last_step = out.rfind(b"[block 1 (max")
    assert last_step >= 0, out[-800:]
    assert b"\r\x1b[2K" in out[last_step:], out[last_step:]  # erased after the last step line
    assert out.rstrip().endswith(b"mlx-dgemma generate: interrupted; nothing partial was kept"), out[-300:]
