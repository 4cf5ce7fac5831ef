"""One measurement per process: a fresh ``spawn``ed child runs one function and sends back its
result, so every peak memory figure is that measurement's alone and a crash, an out-of-memory
kill or a hang costs one row of the table, not the run.

A target is the name of a function of ``mlx_dgemma.bench`` (``"measure_ours"``) or
``"module:function"`` (e.g. ``"mlx_dgemma.bench.studies:quality"``, or from tests).
"""

from __future__ import annotations

import time
from typing import Any

CHILD_TIMEOUT = 3600.0
# The optional packages the peers need: a measurement that cannot import one is a peer not installed.
PEER_PACKAGES = frozenset({"mlx_vlm", "torch", "transformers"})


def _target(fn_name: str) -> Any:
    import importlib

    mod, _, name = fn_name.rpartition(":")
    return getattr(importlib.import_module(mod or "mlx_dgemma.bench"), name)


def _child(conn: Any, fn_name: str, kwargs: dict, timeout: float) -> None:
    import faulthandler
    import signal

    # Ctrl+C reaches the whole process group: the parent stops this child and keeps what had
    # finished; the child printing its own KeyboardInterrupt traceback would only be noise.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    # where a measurement that is about to be killed for its time is stuck (stderr)
    faulthandler.dump_traceback_later(max(1.0, timeout - 5), exit=False)
    # a peer's warnings (deprecations, "torch not found") printed as they happen landed between
    # the rows logged as they finish: kept with the result, the table lists them after itself
    import warnings

    caught = warnings.catch_warnings(record=True)
    seen = caught.__enter__()
    warnings.simplefilter("default")
    try:
        res = _target(fn_name)(**kwargs)
        if isinstance(res, dict) and seen:
            res["warnings"] = list(dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in seen))
        import mlx.core as mx

        from mlx_dgemma.memory import peak_rss_bytes

        mlx_peak = int(mx.get_peak_memory()) if hasattr(mx, "get_peak_memory") else 0
        if isinstance(res, dict) and "impl" in res:
            res["peak_rss_bytes"] = peak_rss_bytes()
            res["mlx_peak_bytes"] = mlx_peak
        conn.send(("ok", res))
    except ImportError as e:
        if (e.name or "").split(".")[0] in PEER_PACKAGES:
            conn.send(("missing", e.name))
        else:  # our own code failing to import is a bug, not a peer to install
            conn.send(("error", f"{type(e).__name__}: {e}"))
    except MemoryError:
        conn.send(("skip", "out of memory"))
    except Exception as e:  # reported in the table, the run goes on
        conn.send(("error", f"{type(e).__name__}: {e}"))


def _available_bytes() -> int | None:
    """The machine's available memory (Linux MemAvailable, macOS vm_stat), or None where unknown."""
    from mlx_dgemma.memory import system_available_bytes  # no MLX: the parent stays light

    return system_available_bytes()


def isolated(fn_name: str, timeout: float | None = None, min_available_bytes: int | None = None,
             **kwargs: Any) -> dict:
    """Run one measurement in a fresh process: clean peak memory, no interference.

    Polls the child: one that dies without reporting (a segfault, the OOM killer, a CUDA
    abort) is reported as such at once, and one that outlives ``timeout`` is killed, instead
    of the parent waiting for a message that never comes. With ``min_available_bytes``, a child
    is also killed when the machine's available memory falls below it (a measurement of a
    large model on a shared machine then costs its row, not the other processes' memory).
    A failure comes back as a row
    ``{"impl": ..., "skipped": why}`` (plus ``"missing": module`` for a peer not installed).
    """
    import multiprocessing as mp

    timeout = timeout or CHILD_TIMEOUT
    if not 0 < timeout < float("inf"):  # NaN too: a deadline that is never reached or always passed
        raise ValueError(f"timeout {timeout!r}: must be a finite number of seconds > 0")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child, fn_name, kwargs, timeout))
    proc.start()
    child.close()  # the parent's copy: EOF on the pipe once the child is gone
    deadline = time.monotonic() + timeout
    status, res = "error", f"timed out after {timeout:g} s (--child-timeout)"
    poll = 1.0 if min_available_bytes is None else 0.2
    try:
        while time.monotonic() < deadline:
            if min_available_bytes is not None:
                avail = _available_bytes()
                if avail is not None and avail < min_available_bytes:
                    proc.kill()
                    status, res = "error", (f"stopped: the machine's available memory fell to "
                                            f"{avail / 1e9:.1f} GB (floor {min_available_bytes / 1e9:.1f} GB)")
                    break
            if parent.poll(poll):
                try:
                    status, res = parent.recv()
                except EOFError:
                    proc.join(5)
                    status, res = "error", f"the measuring process died (exit code {proc.exitcode})"
                break
            if not proc.is_alive():
                proc.join()
                status, res = "error", f"the measuring process died (exit code {proc.exitcode})"
                break
    finally:  # also on Ctrl+C: no measuring process outlives the run
        if proc.is_alive():
            proc.kill()
        proc.join()
    if status == "ok":
        return res
    if status == "missing":  # `missing` lets the caller report a missing peer once
        return {"impl": kwargs.get("label", fn_name), "missing": res,
                "skipped": f"not installed ({res}); install the peers with: pip install -e '.[parity,bench]'"}
    return {"impl": kwargs.get("label", fn_name), "skipped": res}
