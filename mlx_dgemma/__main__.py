"""The ``mlx-dgemma`` command: ``python -m mlx_dgemma``, and ``run``, the console script's entry."""

# Signals first, before the command line's imports (~0.5 s on a loaded machine): a SIGTERM or
# SIGHUP there killed the command without a word and a Ctrl+C printed a traceback; now they are
# noted and main() raises the first one where it prints the one line (hold_signals_at_start).
from mlx_dgemma.errors import end_signal_hold, hold_signals_at_start

hold_signals_at_start()

import sys  # noqa: E402


def run() -> int:
    """Run the command named by ``sys.argv``; its exit status (see ``mlx_dgemma.cli.main``)."""
    from mlx_dgemma.cli import main
    from mlx_dgemma.launch import launched

    try:
        return main()
    finally:
        # the work is done: a signal in the interpreter's exit changes nothing (but mlx.launch
        # stops a rank whose exit hangs with SIGTERM alone)
        end_signal_hold(ignore=not launched())


if __name__ == "__main__":
    code = run()
    # CPython quirk (3.11, 3.12): a KeyboardInterrupt raised inside string-exec'd code (dataclasses
    # and typing build functions that way while a module imports) flags the interpreter as
    # interrupted even though main() caught it, and under `python -m` the process then dies by
    # SIGINT instead of exiting with `code` (the console script is not affected). Any string exec
    # clears the flag.
    exec("")
    sys.exit(code)
