"""Issue 34, item 6: plan once, load what the plan opened. A front end's memory plan (made before
the app or the server starts, to refuse early) carries the model it opened and checked
(``loader.ModelSource``) and the precision it chose; the load reads that source and takes that
choice: the GGUF is opened once, a directory checked once, one plan (one agreement across ranks)
per start."""

from __future__ import annotations

import os
from collections import Counter

import pytest

import mlx_dgemma.plan as plan_module
from mlx_dgemma import loader
from mlx_dgemma.cli import main
from mlx_dgemma.convert import GGUFSource
from mlx_dgemma.errors import ParameterError


@pytest.fixture
def counted(monkeypatch) -> Counter:
    """How often a command opens a GGUF, checks a directory, prices a plan and chooses (agrees)
    a precision."""
    seen: Counter = Counter()

    def counting(key, real):
        def call(*a, **k):
            seen[key] += 1
            return real(*a, **k)
        return call

    monkeypatch.setattr(GGUFSource, "__init__", counting("opened", GGUFSource.__init__))
    monkeypatch.setattr(loader, "check_model_dir", counting("checked", loader.check_model_dir))
    monkeypatch.setattr(plan_module, "make_plan", counting("planned", plan_module.make_plan))
    monkeypatch.setattr(plan_module, "choose_across_ranks", counting("chosen", plan_module.choose_across_ranks))
    return seen


def _chat_loads(monkeypatch) -> dict:
    """``chat``'s app, reduced to its load: the backend the app builds, loaded on this thread."""
    import mlx_dgemma.tui.app as tui_app
    from mlx_dgemma.tui.engine import ModelBackend

    loaded = {}

    def run_app(**kw):
        kw.pop("quality")
        backend = ModelBackend(**kw)
        backend.load(lambda text: None)
        loaded["precision"] = backend.info.precision
        return 0

    monkeypatch.setattr(tui_app, "run_app", run_app)
    monkeypatch.setattr("mlx_dgemma.launch.need_terminal", lambda command="chat": None)  # as in a terminal
    return loaded


@pytest.mark.parametrize("model", ["tiny_gguf", "tiny_model_dir"])
def test_chat_plans_once_and_opens_the_model_once(model, tiny_gguf, tiny_model_dir, request, counted, monkeypatch):
    # before: the command line planned (GGUF opened), then the app's load planned again (opened
    # again) and read it (a third time): 3 opens, 2 plans; a directory was checked 3 times
    path = str(request.getfixturevalue(model))
    loaded = _chat_loads(monkeypatch)
    assert main(["chat", "--model", path]) == 0
    assert loaded["precision"].startswith("fast")  # auto, as before
    opened = {"opened": 1} if model == "tiny_gguf" else {"checked": 1}
    assert dict(counted) == {**opened, "planned": 1, "chosen": 1}


def test_chat_refusal_is_the_plans_one_line(tiny_gguf, counted, monkeypatch, capsys):
    _chat_loads(monkeypatch)
    assert main(["chat", "--model", str(tiny_gguf), "--memory-limit", "1MB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs about" in err[0] and "(--memory-limit)" in err[0], err
    assert dict(counted) == {"opened": 1, "planned": 1, "chosen": 1}


def test_serve_plans_once_and_opens_the_gguf_once(tiny_gguf, counted, monkeypatch, tmp_path, capsys):
    # the real `serve` start, up to uvicorn's loop: its plan, then the engine's load on the worker
    import uvicorn

    class Exited(Exception):
        pass

    def stop_at_once(self, sockets=None):
        raise KeyboardInterrupt  # as Ctrl+C once serving

    def exit_(code):
        raise Exited(code)

    monkeypatch.setenv("MLX_DGEMMA_CACHE", str(tmp_path))
    monkeypatch.setattr(uvicorn.Server, "run", stop_at_once)
    monkeypatch.setattr(os, "_exit", exit_)  # serve leaves through os._exit: here, back to the test
    with pytest.raises(Exited) as e:
        main(["serve", "--model", str(tiny_gguf), "--port", "0"])
    err = capsys.readouterr().err
    assert e.value.args == (0,) and "(fast" in err and "on http://127.0.0.1:" in err, err
    # before: 3 opens, 2 plans, 2 agreements (under mlx.launch: two collectives that had to match)
    assert dict(counted) == {"opened": 1, "planned": 1, "chosen": 1}


def test_generate_opens_the_model_once(tiny_gguf, tiny_model_dir, counted, capsys):
    for model, opened in ((tiny_gguf, {"opened": 1}), (tiny_model_dir, {"checked": 1})):
        counted.clear()
        assert main(["generate", "--model", str(model), "--prompt", "hi", "--steps", "1", "--max-tokens", "4",
                     "--seed", "0"]) == 0
        assert dict(counted) == {**opened, "planned": 1, "chosen": 1}, model  # before: opened or checked twice
    capsys.readouterr()


def test_plan_for_several_ranks_opens_the_gguf_once(tiny_gguf, counted, capsys):
    assert main(["plan", str(tiny_gguf), "--ranks", "2"]) in (0, 1)
    assert "share of 2 ranks" in capsys.readouterr().out
    assert counted["opened"] == 1 and counted["planned"] == 2  # before: opened once per rank


def test_a_plan_carries_its_source_and_loads_once(tiny_gguf, tiny_model_dir, counted):
    plan = loader.plan_load(tiny_gguf, "auto", 1 << 40)
    assert plan.chosen == plan.choose("auto") and plan.source.path == tiny_gguf and plan.source.stored == "gguf"
    assert plan.to_dict() == loader.plan_model(tiny_gguf, 1 << 40).to_dict()  # the figures of a plan that only prices
    runtime = loader.load(tiny_gguf, plan=plan)
    assert runtime.precision.name == plan.chosen
    assert plan.source.gguf is None  # the file is closed and its map let go once read
    assert counted["opened"] == 2 and counted["planned"] == 2  # plan_load's, and plan_model's above
    with pytest.raises(ParameterError, match=r"already loaded from this plan \(a plan loads once\); plan again"):
        loader.load(tiny_gguf, plan=plan)
    other = loader.plan_load(tiny_model_dir, "exact")
    with pytest.raises(ParameterError, match="it is the plan of .*tiny, not of .*tiny-q4_k_m.gguf"):
        loader.load(tiny_gguf, plan=other)
    with pytest.raises(ParameterError, match="it chose --precision exact, not q4; load that, or plan again"):
        loader.load(tiny_model_dir, "q4", plan=other)
    with pytest.raises(ParameterError, match=r"expected the plan of loader.plan_load"):
        loader.load(tiny_model_dir, plan=loader.plan_model(tiny_model_dir))
    other.source.close()
