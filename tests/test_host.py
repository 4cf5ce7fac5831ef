"""The model host both front ends hold (mlx_dgemma/host.py): one declaration per fact, shown by
the server and the chat app alike; the memory they show sampled on the worker's thread."""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields

import pytest

from mlx_dgemma.host import ModelHost, ModelInfo, fact
from mlx_dgemma.tui.app import DGemmaApp

from .tui_fakes import ScriptedBackend
from .tui_helpers import SIZE, ask, screen


@dataclass(frozen=True)
class WithQuantization(ModelInfo):
    """A new fact, declared the one way a fact is: its source in the Runtime, and shown."""

    quantization: str = fact(lambda rt: "Q9_X", shown="{} (scratch)")


class Quantized(ScriptedBackend):
    """The scripted model, reporting the new fact."""

    @property
    def info(self) -> WithQuantization:
        base = super().info
        return WithQuantization(**{f.name: getattr(base, f.name) for f in fields(base)},
                                quantization="Q9_X")


class Recorded(ScriptedBackend):
    """Records the thread each memory sample is taken on."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.sampled_on: set[str] = set()

    def memory_bytes(self) -> int:
        self.sampled_on.add(threading.current_thread().name)
        return 4_560_000_000


def test_model_info_reads_every_fact_from_the_runtime_and_marks_what_is_shown():
    from mlx_dgemma.loader import load_demo

    runtime = load_demo()
    info = ModelInfo.of(runtime, "the demo")
    assert info.name == "the demo" and info.precision == runtime.precision.label
    assert info.canvas_length == runtime.model.args.canvas_length and info.demo == runtime.demo_kind
    assert dict(info.generation_config) == runtime.generation_config
    with pytest.raises(TypeError):  # read-only: a front end copies it to change it
        info.generation_config["t_min"] = 0.1  # type: ignore[index]
    assert info.shown() == {"precision": runtime.precision.label} and info.shown_words() == [runtime.precision.label]
    assert WithQuantization.of(runtime, "x").shown() == {"precision": runtime.precision.label, "quantization": "Q9_X"}
    assert WithQuantization.of(runtime, "x").shown_words() == [runtime.precision.label, "Q9_X (scratch)"]


def test_the_host_samples_memory_on_its_worker_after_the_load_and_each_turn():
    seen: list[str] = []

    def memory() -> int:
        seen.append(threading.current_thread().name)
        return len(seen)

    host = ModelHost(lambda: ModelInfo(name="m", precision="p", demo=None, canvas_length=1, context_length=2,
                                       vocab_size=3, generation_config={}), name="host-test", memory=memory)
    assert host.shown() == {"precision": None}  # before the load
    assert host.start().name == "m" and host.info.name == "m" and host.memory_bytes == 1
    assert host.shown() == {"precision": "p"}
    out: list[str] = []
    assert host.submit(lambda t: out.extend(host.sampled(iter("ab")))).done.wait(10)
    # the load, the first event (the next within MEMORY_SAMPLE_S of it may share its sample), the turn's end
    assert out == ["a", "b"] and host.memory_bytes == len(seen) >= 3
    assert host.stop(10)
    assert set(seen) == {"host-test"}


async def test_the_chat_app_never_samples_memory_on_the_ui_thread():
    # the status line shows the memory the worker sampled (today's main read it on the UI thread
    # at every redraw, 15 times a second, against the one-thread rule)
    backend = Recorded(steps=3, blocks=1)
    app = DGemmaApp(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, backend)
        await pilot.press("ctrl+b")  # a replayed step: the step line, drawn again
        await pilot.pause(0.1)
        assert "mem 4.56 GB" in str(screen(app).query_one("#status").render())
    assert backend.sampled_on == {"mlx-dgemma-engine"}


async def test_a_fact_declared_once_is_shown_by_the_chat_app_and_the_server(monkeypatch, tmp_path):
    # the chat app: the live (here replayed) step's status line
    backend = Quantized(steps=2, blocks=1)
    app = DGemmaApp(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, backend)
        await pilot.press("ctrl+b")
        await pilot.pause(0.1)
        assert "Q9_X (scratch)" in str(screen(app).query_one("#status").render())
    # the server: /health, from the Runtime it loaded
    from fastapi.testclient import TestClient

    import mlx_dgemma.server.engine as engine_module
    from mlx_dgemma.server import Engine, create_app

    monkeypatch.setenv("MLX_DGEMMA_CACHE", str(tmp_path))
    monkeypatch.setattr(engine_module, "ModelInfo", WithQuantization)
    engine = Engine(demo=True).start(warm_up=False)
    with TestClient(create_app(engine)) as client:
        body = client.get("/health").json()
    assert body["quantization"] == "Q9_X" and body["precision"] == engine.precision != ""
