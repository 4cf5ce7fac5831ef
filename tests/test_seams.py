"""One loader and one memory probe behind every front end (CLI, chat app, server): issue 11."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_dgemma import DoneEvent, memory, stream_generate
from mlx_dgemma.errors import ParameterError
from mlx_dgemma.loader import open_model


@pytest.fixture
def no_loading(monkeypatch):
    """Loading anything fails the test: the checks must come first."""
    import mlx_dgemma.loader

    def refuse(*a, **kw):
        raise AssertionError("loaded before the arguments were checked")

    monkeypatch.setattr(mlx_dgemma.loader, "load", refuse)
    monkeypatch.setattr(mlx_dgemma.loader, "load_demo", refuse)


@pytest.mark.parametrize("model, demo, precision, dtype, expected", [
    ("/m", True, "auto", None, "--demo and --model /m: give one of them"),
    (None, False, "auto", None, "--model: not given; pass a converted directory or a .gguf file"),
    ("/m", True, "exact", "bfloat16", "--dtype: exact precision runs in float32"),  # precision first
    (None, True, "quick", None, "--precision: 'quick' is not one of"),
])
def test_open_model_checks_its_arguments_before_loading(no_loading, model, demo, precision, dtype, expected):
    with pytest.raises(ParameterError) as e:
        open_model(model, demo, precision, dtype)
    assert str(e.value).startswith(expected)


@pytest.fixture
def calls(monkeypatch):
    """Every open_model call (the real one runs), with the progress lines it reported."""
    import mlx_dgemma.loader

    seen: list[dict] = []
    real = mlx_dgemma.loader.open_model

    def spy(model, demo, precision="auto", dtype=None, progress=None, memory_limit=None, plan=None):
        seen.append({"args": (model, demo, precision, dtype), "progress": 0})

        def counted(i, n, name):
            seen[-1]["progress"] += 1
            progress(i, n, name)

        return real(model, demo, precision, dtype, progress=counted if progress else None,
                    memory_limit=memory_limit, plan=plan)

    monkeypatch.setattr(mlx_dgemma.loader, "open_model", spy)
    return seen


def test_cli_server_and_chat_app_load_through_open_model(calls, tiny_gguf, capsys):
    from mlx_dgemma.cli import load_for_cli
    from mlx_dgemma.server import load_model
    from mlx_dgemma.tui.engine import ModelBackend

    assert load_for_cli(str(tiny_gguf), False, "float32", "fast").precision.label == "fast (float32)"
    assert "loading" in capsys.readouterr().err  # the CLI's stderr bar
    load_model(str(tiny_gguf), False, None, "exact")
    lines: list[str] = []
    backend = ModelBackend(model=str(tiny_gguf), precision="exact")
    backend.load(lines.append)
    assert [c["args"] for c in calls] == [(str(tiny_gguf), False, "fast", "float32"),
                                         (str(tiny_gguf), False, "exact", None),
                                         (str(tiny_gguf), False, "exact", None)]
    assert all(c["progress"] > 0 for c in calls)  # each front end follows the in-memory conversion
    assert lines and all(line.startswith("loading ") for line in lines)  # the app's progress messages
    assert backend.info.precision == "exact (float32)" and backend.info.canvas_length == 32


def test_memory_probe_prefers_mlx_unless_it_tracks_nothing(monkeypatch):
    monkeypatch.setattr(mx, "get_active_memory", lambda: 3 << 30)
    assert memory.memory_bytes() == 3 << 30
    monkeypatch.setattr(mx, "get_active_memory", lambda: memory.MLX_TRACKED_MIN_BYTES)  # CPU: not tracked
    rss = memory.current_rss_bytes()
    assert rss > 1 << 20 and abs(memory.memory_bytes() - rss) < 64 << 20
    monkeypatch.setattr(mx, "get_peak_memory", lambda: 0)
    assert memory.peak_memory_bytes() == memory.peak_rss_bytes() >= rss


def test_generation_and_the_chat_app_read_the_same_probe(monkeypatch, tiny_model_dir):
    from mlx_dgemma import load
    from mlx_dgemma.tui.engine import ModelBackend

    monkeypatch.setattr(memory, "memory_bytes", lambda: 12_345_678)
    assert ModelBackend(model=str(tiny_model_dir)).memory_bytes() == 12_345_678
    rt = load(tiny_model_dir, precision="exact")
    monkeypatch.setattr(mx, "get_peak_memory", lambda: 5 << 30)  # as a GPU would report it
    events = list(stream_generate(rt, "Hi", max_new_tokens=8, max_denoising_steps=2, seed=0))
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.peak_memory_bytes == 5 << 30


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["chat"], ["serve", "--port", "0"]])
def test_every_front_end_refuses_two_models_with_the_same_line(command, no_loading, capsys):
    from mlx_dgemma.cli import main

    assert main([command[0], "--demo", "--model", "/nope", *command[1:]]) == 2
    assert capsys.readouterr().err == (f"mlx-dgemma {command[0]}: error: --demo and --model /nope: give one of "
                                       "them (--demo runs the built-in demo model; --model runs yours)\n")


@pytest.mark.parametrize("source", ["text", "file"])
def test_an_empty_prompt_is_refused_before_the_model_loads(source, no_loading, tmp_path, capsys):
    # it was refused only by stream_generate, after loading (seconds for the demo, minutes for
    # the real model) and after the demo's notice
    from mlx_dgemma.cli import main

    empty = tmp_path / "empty.txt"
    empty.write_text(" \n")
    flag = ["--prompt", "  "] if source == "text" else ["--prompt-file", str(empty)]
    assert main(["generate", "--demo", *flag]) == 2
    assert capsys.readouterr().err == f"mlx-dgemma generate: error: {flag[0]}: the prompt is empty; give some text\n"
