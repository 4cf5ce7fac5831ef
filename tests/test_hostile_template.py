"""Hostile chat templates render in the sandbox within a budget: a clear error, never a hang."""

from __future__ import annotations

import time

import pytest

from mlx_dgemma.chat_template import render_chat
from mlx_dgemma.errors import ParameterError

MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",  # silent loops
    "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "{{ 'x' * 1000000000 }}",
    "{% for c in 'ab' * 100000000 %}{% endfor %}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{{ 2 ** 100000000 }}",
    "{% set n = 7 %}{{ n ** (n * 1000) }}",
    "{% set ns = namespace(s='x') %}{% for i in range(99999) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
])
def test_runaway_template_hits_the_budget(template):
    t0 = time.perf_counter()
    with pytest.raises(ParameterError, match="chat template"):
        render_chat(MSG, template)
    assert time.perf_counter() - t0 < 15


@pytest.mark.parametrize("template, expect", [
    ("{% for x in %}", "does not compile"),
    ("{{ messages[5]['content'] }}", "chat template"),
    ("{{ raise_exception('no system role') }}", "no system role"),
    ("{{ ''.__class__.__mro__ }}", "chat template"),  # the sandbox refuses internals
])
def test_template_errors_are_parameter_errors(template, expect):
    with pytest.raises(ParameterError, match=expect):
        render_chat(MSG, template)


def test_normal_templates_still_render():
    assert "hi" in render_chat(MSG)
    long = [{"role": "user", "content": "word " * 20000}] * 3
    assert render_chat(long).count("word") == 60000
