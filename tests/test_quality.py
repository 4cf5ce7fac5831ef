"""The speed/quality dial (issue 33 item 2): ``--quality max|balanced|fast`` declared once in
the registry (``mlx_dgemma.params.QUALITIES``) and read alike by the command line, the
server's ``quality`` field and the chat settings' quality row; parameters given besides it win."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mlx_dgemma import params
from mlx_dgemma.cli import build_parser, sampler_overrides
from mlx_dgemma.errors import ParameterError
from mlx_dgemma.request import GenerationRequest
from mlx_dgemma.server.schemas import ChatRequest
from mlx_dgemma.tui.app import DGemmaApp
from mlx_dgemma.tui.screens.chat import ChatScreen
from mlx_dgemma.tui.screens.settings import SettingsScreen

from .test_server_limits import _engine
from .tui_fakes import ScriptedBackend
from .tui_helpers import SIZE, done, screen, send, wait_for


def test_each_setting_sets_every_dial_parameter_to_a_value_its_rule_takes():
    assert [q.name for q in params.QUALITIES] == ["max", "balanced", "fast"]
    for q in params.QUALITIES:
        assert tuple(name for name, _ in q.settings) == params.QUALITY_PARAMS, q.name
        for name, value in q.settings:
            if value is not None:  # None: the model's default
                params.check_generation_field(name, value)
        assert params.quality_of(GenerationRequest.of(quality=q.name).params) == q.name
    assert GenerationRequest.of(quality="max").params == {}  # max is the model's own sampler
    assert params.quality_of({"seed": 3}) == "max"  # other parameters do not move the dial
    assert params.quality_of({"stability_threshold": 0}) is None  # set by hand: no setting of the dial


def test_a_setting_lies_under_the_parameters_given():
    r = GenerationRequest.of({"stability_threshold": 2, "seed": 1}, quality="balanced")
    assert r.params == {"stability_threshold": 2, "confidence_threshold": 0.05, "seed": 1}
    assert GenerationRequest.of(quality="fast").params == {"accept_probability": 0.9}
    with pytest.raises(ParameterError) as e:
        GenerationRequest.of(quality="turbo")
    assert e.value.param == "quality" and str(e.value) == "quality = 'turbo': must be one of max, balanced, fast"


def test_command_line_quality_and_a_flag_beside_it():
    args = build_parser().parse_args(["generate", "--demo", "--prompt", "hi", "--quality", "balanced",
                                      "--confidence-threshold", "0.02"])
    assert sampler_overrides(args).params == {"stability_threshold": 0, "confidence_threshold": 0.02}
    args = build_parser().parse_args(["generate", "--demo", "--prompt", "hi"])
    assert sampler_overrides(args).params == {}
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["generate", "--demo", "--prompt", "hi", "--quality", "turbo"])
    assert e.value.code == 2
    assert build_parser().parse_args(["chat", "--quality", "fast"]).quality == "fast"


def test_server_quality_field():
    e = _engine()
    fast = e.sampler_overrides(ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                           "quality": "fast", "seed": 4}), None)
    assert fast.params == {"accept_probability": 0.9, "seed": 4}
    mixed = e.sampler_overrides(ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                            "quality": "balanced", "stability_threshold": 3}), None)
    assert mixed.params == {"stability_threshold": 3, "confidence_threshold": 0.05}


@pytest.mark.parametrize("bad", ["turbo", 1, ["fast"], ""])
def test_server_refuses_an_unknown_quality_with_a_400_naming_the_field(bad):
    from fastapi.testclient import TestClient

    from mlx_dgemma.server.app import create_app

    engine = SimpleNamespace(worker=SimpleNamespace(started=True))  # refused before any model work
    r = TestClient(create_app(engine)).post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "quality": bad})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "quality"
    assert r.json()["error"]["message"] == "quality: must be one of max, balanced, fast"


async def test_settings_quality_row_fills_its_fields_and_reaches_the_answer():
    backend = ScriptedBackend(steps=2, blocks=1, sampler=GenerationRequest.of(quality="fast").params)
    app = DGemmaApp(backend)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: backend.loaded)
        assert screen(app).params == {"accept_probability": 0.9}  # chat --quality fast
        await pilot.press("ctrl+o")
        assert isinstance(app.screen, SettingsScreen)
        select = app.screen.query_one("#set-quality")
        assert select.value == "fast"  # the dial shows what the overrides amount to
        select.value = "balanced"
        await pilot.pause()
        field = lambda name: app.screen.query_one(f"#set-{name}").value  # noqa: E731
        assert (field("stability_threshold"), field("confidence_threshold"), field("accept_probability")) == \
            ("0", "0.05", "")  # empty: the model's default (off)
        app.screen.query_one("#save").press()
        await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen))
        assert screen(app).params == {"stability_threshold": 0, "confidence_threshold": 0.05}
        await send(pilot, "x")
        await wait_for(pilot, lambda: done(app))
        sent = backend.prompts[0][1]
        assert sent["stability_threshold"] == 0 and sent["confidence_threshold"] == 0.05
        await pilot.press("ctrl+o")
        app.screen.query_one("#set-quality").value = "max"  # back to the model's own values
        await pilot.pause()
        assert field("stability_threshold") == "1" and field("confidence_threshold") == "0.005"
        app.screen.query_one("#save").press()
        await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen))
        assert screen(app).params == {}


def test_the_settings_notice_names_the_dials_setting():
    from mlx_dgemma.tui.screens.settings import Settings, describe

    balanced = describe(Settings(GenerationRequest.of(quality="balanced").params))
    assert balanced.startswith("Sampler settings (quality balanced): stability threshold 0, confidence threshold 0.05")
    assert describe(Settings({"seed": 3})).startswith("Sampler settings: seed")  # max: not named
