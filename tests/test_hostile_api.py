"""The Python API given what an mlx-lm user, or a hurried one, passes: each wrong argument is one
ParameterError naming it and saying what to pass (before these checks: AttributeError,
TypeError from deep inside, or bytes and floats silently taken as token ids)."""

from __future__ import annotations

import numpy as np
import pytest

import mlx_dgemma
from mlx_dgemma import ChatSession, Runtime, generate, load, stream_generate
from mlx_dgemma.errors import ParameterError


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("MLX_DGEMMA_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield mlx_dgemma.load_demo(kind="random")
    mp.undo()


def _one_line(e: pytest.ExceptionInfo, *words: str) -> None:
    msg = str(e.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("fn", [generate, lambda *a: list(stream_generate(*a))])
def test_the_mlx_lm_form_says_to_load_a_runtime(rt, fn):
    with pytest.raises(ParameterError) as e:
        fn(rt.model, rt.tokenizer, "hi")  # mlx_lm.generate(model, tokenizer, prompt)
    _one_line(e, "model and a tokenizer", "mlx_dgemma.load(path)")
    assert e.value.param == "runtime"


@pytest.mark.parametrize("first, words", [
    ("model", ("DiffusionGemma", "Runtime")),
    ("path", ("the path", "mlx_dgemma.load(path)")),
    (None, ("NoneType", "Runtime")),
])
@pytest.mark.parametrize("fn", [generate, lambda *a: list(stream_generate(*a)), lambda r, _: ChatSession(r)])
def test_a_wrong_first_argument_is_named(rt, fn, first, words):
    arg = rt.model if first == "model" else "models/dgemma.gguf" if first == "path" else None
    with pytest.raises(ParameterError) as e:
        fn(arg, "hi")
    _one_line(e, *words)


def test_extra_positional_settings_are_refused_by_name(rt):
    with pytest.raises(ParameterError) as e:
        generate(rt, "hi", 64)
    _one_line(e, "by name", "max_new_tokens=64")


@pytest.mark.parametrize("prompt, words", [
    (b"hi", ("bytes", "decode")),  # was taken as the token ids [104, 105]
    ([1.5, 2.0], ("1.5",)),  # was truncated to [1, 2]
    (None, ("NoneType",)),
    (5, ("int",)),
])
def test_a_prompt_of_the_wrong_type_is_refused(rt, prompt, words):
    with pytest.raises(ParameterError) as e:
        generate(rt, prompt, max_new_tokens=4, max_denoising_steps=1)
    _one_line(e, "prompt:", *words)


def test_token_ids_as_arrays_and_tuples_are_taken(rt):
    kw = {"max_new_tokens": 4, "max_denoising_steps": 1, "seed": 0}
    want = generate(rt, [5, 6, 7], **kw)
    assert generate(rt, np.array([5, 6, 7]), **kw) == want  # was "truth value of an array is ambiguous"
    assert generate(rt, (5, 6, 7), **kw) == want


def test_a_chat_turn_that_is_not_text_is_named(rt):
    with pytest.raises(ParameterError) as e:
        list(ChatSession(rt).stream(5))
    _one_line(e, "prompt:", "int")  # was "prompt: empty"


@pytest.mark.parametrize("model, tokenizer", [("model", "tok"), ("rt", "tok"), ("model", "str")])
def test_runtime_checks_what_it_is_built_from(rt, model, tokenizer):
    m = {"model": rt.model, "rt": rt}[model]
    t = {"tok": rt.tokenizer, "str": "tokenizer.json"}[tokenizer]
    if (model, tokenizer) == ("model", "tok"):
        assert Runtime(m, t).model is rt.model  # the valid form still builds
        return
    with pytest.raises(ParameterError) as e:
        Runtime(m, t)
    _one_line(e, "Runtime(model, tokenizer)", "mlx_dgemma.load(path)")


@pytest.mark.parametrize("path", [None, 5, "", "  "])
def test_load_names_a_path_that_is_not_one(path):
    with pytest.raises(ParameterError) as e:
        load(path)
    _one_line(e, "path:", "expected a .gguf file")
