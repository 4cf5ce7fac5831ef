"""Metal specifics (issue 30, item 5), with Metal simulated on this CPU machine: ``exact`` keeps
float32 matmuls IEEE on an M5-class GPU (``MLX_ENABLE_TF32=0`` before the model's first
matmul), generation runs under MLX's wired limit on the generating thread (as mlx-lm's), with a
warning near the limit, and a GPU out of memory reaches the user as the one-line budget error."""

from __future__ import annotations

import logging
import os
import threading

import mlx.core as mx
import pytest

from mlx_dgemma import gpu
from mlx_dgemma.cli import main
from mlx_dgemma.errors import MemoryBudgetError
from mlx_dgemma.model import DiffusionGemma

# what MLX 0.32 raises (mlx/backend/metal/allocator.cpp, device.cpp)
METAL_OOM = ("[METAL] Command buffer execution failed: Insufficient Memory "
             "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory).")
MALLOC_OOM = "[malloc] Unable to allocate 21474836480 bytes."


class SimulatedMetal:
    """``mx.metal.is_available`` true, ``mx.device_info`` a Mac's, and every call of
    ``mx.set_wired_limit``/``mx.synchronize`` recorded with its thread."""

    def __init__(self, monkeypatch, working_set: int, architecture: str = "applegpu_g17s"):
        self.working_set, self.calls, self.wired = working_set, [], 0
        real_sync = mx.synchronize
        monkeypatch.setattr(mx.metal, "is_available", lambda: True)
        monkeypatch.setattr(mx, "device_info", lambda: {
            "architecture": architecture, "device_name": "Apple M5", "memory_size": 24 << 30,
            "max_recommended_working_set_size": working_set})

        def set_wired_limit(n: int) -> int:
            self.calls.append(("set_wired_limit", n, threading.get_ident()))
            old, self.wired = self.wired, n
            return old

        def synchronize(*a):
            self.calls.append(("synchronize", None, threading.get_ident()))
            return real_sync(*a)

        monkeypatch.setattr(mx, "set_wired_limit", set_wired_limit)
        monkeypatch.setattr(mx, "synchronize", synchronize)


@pytest.fixture
def tf32_env(monkeypatch):
    monkeypatch.setenv(gpu.TF32_ENV, "1")  # restored after the test, whatever the code sets
    monkeypatch.delenv(gpu.TF32_ENV)


# --------------------------------------------------------------------------------------------
# exact: float32 stays IEEE on an M5-class GPU


@pytest.mark.parametrize("arch, macos, mlx, nax", [
    ("applegpu_g17s", "26.2", "0.32.4", True),  # M5-class, the first macOS and MLX with NAX
    ("applegpu_g17g", "26.3.1", "0.30.1", True),
    ("applegpu_g18d", "27.0", "0.33.0.dev1", True),
    ("applegpu_g16s", "26.2", "0.32.4", False),  # M4-class: no NAX
    ("applegpu_g17s", "26.1", "0.32.4", False),  # macOS before 26.2
    ("applegpu_g17s", "15.6", "0.32.4", False),
    ("applegpu_g17s", "26.2", "0.30.0", False),  # MLX 0.30.0: NAX only behind a build flag
    ("applegpu_g17s", "26.2", "0.29.3", False),
    ("applegpu_g17p", "26.2", "0.32.4", False),  # phone-class parts need generation 18
    ("applegpu_g18p", "26.2", "0.32.4", True),
    ("x86_64", "", "0.32.4", False),
])
def test_which_devices_take_float32_matmuls_to_nax(arch, macos, mlx, nax):
    assert gpu.nax_capable(arch, macos, mlx) is nax


def test_exact_turns_tf32_off_before_the_models_first_matmul(monkeypatch, tf32_env):
    SimulatedMetal(monkeypatch, working_set=64 << 30)
    seen = []
    real = DiffusionGemma.prefill_chunks

    def prefill_chunks(self, *a, **kw):  # the model's first computation in an answer
        seen.append(os.environ.get(gpu.TF32_ENV))
        yield from real(self, *a, **kw)

    monkeypatch.setattr(DiffusionGemma, "prefill_chunks", prefill_chunks)
    assert main(["generate", "--demo", "--precision", "exact", "--prompt", "Hi", "--seed", "0", "--steps", "2",
                 "--max-tokens", "64", "--json"]) == 0
    assert seen and seen[0] == "0"


def test_a_users_tf32_setting_is_overridden_by_exact(monkeypatch):
    monkeypatch.setenv(gpu.TF32_ENV, "1")
    SimulatedMetal(monkeypatch, working_set=64 << 30)
    gpu.keep_float32_exact()
    assert os.environ[gpu.TF32_ENV] == "0"


def test_fast_and_a_machine_without_metal_leave_tf32_alone(monkeypatch, tf32_env):
    from mlx_dgemma import load_demo

    load_demo(precision="exact")  # no Metal here: nothing to turn off
    assert gpu.TF32_ENV not in os.environ
    SimulatedMetal(monkeypatch, working_set=64 << 30)
    load_demo(precision="fast")  # bfloat16 matmuls take NAX either way; fast asks nothing of TF32
    assert gpu.TF32_ENV not in os.environ


# --------------------------------------------------------------------------------------------
# the wired limit


def _answer_on_a_worker(runtime, prompt: str = "In the beginning") -> int:
    """Generate one short answer on a ModelWorker's thread (as the server and the chat app do);
    the worker thread's id."""
    from mlx_dgemma import stream_generate
    from mlx_dgemma.worker import ModelWorker

    w = ModelWorker(lambda: runtime)
    w.start()
    ident = []
    t = w.submit(lambda ticket: (ident.append(threading.get_ident()),
                                 list(stream_generate(runtime, prompt, seed=0, max_denoising_steps=2,
                                                      max_new_tokens=64))))
    assert t.done.wait(120)
    w.stop()
    return ident[0]


def test_generation_runs_under_the_wired_limit_on_the_generating_thread(monkeypatch):
    from mlx_dgemma import load_demo

    runtime = load_demo(precision="fast")
    metal = SimulatedMetal(monkeypatch, working_set=17 << 30)
    worker = _answer_on_a_worker(runtime)
    assert worker != threading.get_ident()
    sets = [c for c in metal.calls if c[0] == "set_wired_limit"]
    # raised to the working set for the answer, then set back to what it was, on the worker thread
    assert [(n, t) for _, n, t in sets] == [(17 << 30, worker), (0, worker)]
    # the answer's work is synchronized before the limit changes back
    last_set = max(i for i, c in enumerate(metal.calls) if c[0] == "set_wired_limit")
    assert ("synchronize", None, worker) in metal.calls[:last_set]
    assert metal.wired == 0


def test_a_model_near_the_limit_is_warned_about_once(monkeypatch, caplog):
    from mlx_dgemma import load_demo

    runtime = load_demo(precision="fast")
    weights = gpu._weights_bytes(runtime.model)
    SimulatedMetal(monkeypatch, working_set=int(weights / 0.95))  # weights at 95 % of the working set
    monkeypatch.setattr(gpu, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="mlx_dgemma.gpu"):
        _answer_on_a_worker(runtime)
        _answer_on_a_worker(runtime, "And God said")
    warnings = [r.getMessage() for r in caplog.records if r.name == "mlx_dgemma.gpu"]
    assert len(warnings) == 1, warnings
    assert "working set" in warnings[0] and "mlx-dgemma plan" in warnings[0]


def test_a_model_well_within_the_limit_is_not_warned_about(monkeypatch, caplog):
    from mlx_dgemma import load_demo

    runtime = load_demo(precision="fast")
    SimulatedMetal(monkeypatch, working_set=int(gpu._weights_bytes(runtime.model) / 0.5))
    monkeypatch.setattr(gpu, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="mlx_dgemma.gpu"):
        _answer_on_a_worker(runtime)
    assert not [r for r in caplog.records if r.name == "mlx_dgemma.gpu"]


def test_no_wired_limit_without_metal(monkeypatch):
    from mlx_dgemma import load_demo

    calls = []
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: calls.append(n) or 0)
    _answer_on_a_worker(load_demo(precision="fast"))
    assert calls == []


# --------------------------------------------------------------------------------------------
# a GPU out of memory


@pytest.mark.parametrize("said", [METAL_OOM, MALLOC_OOM,
                                  "[metal::malloc] Attempting to allocate 40000000000 bytes which is greater than "
                                  "the maximum allowed buffer size of 17179869184 bytes.",
                                  "[metal::malloc] Resource limit (499000) exceeded.",
                                  "cudaMallocAsync(&data, size, stream) failed: out of memory"])
def test_mlx_out_of_memory_becomes_the_budget_error(said):
    with pytest.raises(MemoryBudgetError) as e:
        with gpu.memory_errors("generation"):
            raise RuntimeError(said)
    text = str(e.value)
    assert text.startswith("generation: the GPU ran out of memory") and "\n" not in text
    assert "mlx-dgemma plan" in text


def test_other_runtime_errors_pass():
    with pytest.raises(RuntimeError, match="Shapes"):
        with gpu.memory_errors("generation"):
            raise RuntimeError("[matmul] Shapes (2,3) and (4,5) are incompatible")


def test_out_of_memory_while_generating_is_one_line(monkeypatch, capsys):
    from mlx_dgemma.step import StepFunction

    def oom(self, *a, **kw):
        raise RuntimeError(METAL_OOM)

    monkeypatch.setattr(StepFunction, "__call__", oom)
    assert main(["generate", "--demo", "--prompt", "Hi", "--seed", "0", "--steps", "2"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("mlx-dgemma")]
    assert len(err) == 1 and err[0].startswith("mlx-dgemma generate: error: generation: the GPU ran out of memory")
    assert "Insufficient Memory" in err[0]


def test_out_of_memory_while_loading_is_one_line(monkeypatch, capsys):
    import mlx_dgemma.loader as loader

    def oom(*a, **kw):
        raise RuntimeError(MALLOC_OOM)

    monkeypatch.setattr(loader, "load_gguf", oom)  # the demo is a .gguf, converted in memory
    assert main(["generate", "--demo", "--prompt", "Hi"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("mlx-dgemma")]
    assert len(err) == 1 and err[0].startswith("mlx-dgemma generate: error: loading the model: the GPU ran out")
