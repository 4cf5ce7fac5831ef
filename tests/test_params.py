"""The parameter registry (mlx_dgemma.params): a parameter added there alone reaches the CLI's
flags, the server's request model, the settings screen, the GGUF key map and generation itself
(the sampler's parameters the step runs with), with its range."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import fields

import pytest

from mlx_dgemma import params
from mlx_dgemma.cli import build_parser, sampler_overrides
from mlx_dgemma.errors import ParameterError
from mlx_dgemma.schema import SamplerDefaults

# a parameter nothing else in the code knows: every place below learns it from the registry only
NEW = ("params.Param('dial_tone', float, 0.25, 0.75, 'a number in [0.25, 0.75]', '--dial-tone', 'X', "
       "'how the dial sounds', label='dial tone', screen_order=5, no_default='off: silence', server=True, "
       "gguf_key='diffusion.eb_dial_tone', model_default=False)")


@pytest.fixture
def registry_with_new_param(monkeypatch):
    monkeypatch.setattr(params, "PARAMS", params.PARAMS + (eval(NEW, {"params": params}),))  # noqa: S307


def test_a_new_parameter_gets_its_flag_and_range_on_the_command_line(registry_with_new_param, capsys):
    args = build_parser().parse_args(["generate", "--demo", "--prompt", "hi", "--dial-tone", "0.5"])
    assert args.dial_tone == 0.5 and sampler_overrides(args)["dial_tone"] == 0.5
    with pytest.raises(ParameterError, match=r"^--dial-tone 0\.9: must be a number in \[0\.25, 0\.75\]$"):
        sampler_overrides(build_parser().parse_args(["generate", "--demo", "--prompt", "hi", "--dial-tone", "0.9"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--demo", "--prompt", "hi", "--dial-tone", "loud"])  # typed: a float
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    assert "--dial-tone X" in capsys.readouterr().out


def test_a_new_parameter_with_a_gguf_key_is_read_from_the_gguf(registry_with_new_param):
    from mlx_dgemma.convert.metadata import generation_config

    assert params.gguf_keys()["diffusion.eb_dial_tone"].name == "dial_tone"
    assert generation_config({"diffusion.eb_dial_tone": 0.5})["dial_tone"] == 0.5
    assert "dial_tone" not in generation_config({})


def test_a_new_gguf_key_out_of_its_range_is_refused_before_converting(registry_with_new_param, tmp_path, capsys):
    """The GGUF pre-check reads the same map: the converter refuses the file in one line."""
    from mlx_dgemma.convert.synthetic import TinySpec, write_tiny_gguf
    from tests.hostile_util import promise

    src = write_tiny_gguf(tmp_path / "m.gguf", TinySpec(extra_metadata={"diffusion.eb_dial_tone": 0.9}))
    code, line = promise(["convert", str(src), str(tmp_path / "out")], capsys, tmp_path, {src.name})
    assert code == 2
    assert "diffusion.eb_dial_tone" in line and "a number in [0.25, 0.75]" in line, line


# The server's request model and the settings screen are built when their modules are imported:
# a fresh interpreter adds the parameter first, then imports them.
SCRIPT = """
import json, types
from mlx_dgemma import params
params.PARAMS = params.PARAMS + ({new},)
from fastapi.testclient import TestClient
from mlx_dgemma.server.app import create_app
from mlx_dgemma.server.schemas import SAMPLER_FIELDS
from mlx_dgemma.tui.screens.settings import FIELDS, NO_DEFAULT

engine = types.SimpleNamespace(worker=types.SimpleNamespace(started=True))
client = TestClient(create_app(engine))
bad = client.post("/v1/chat/completions", json={{"messages": [{{"role": "user", "content": "hi"}}], "dial_tone": 0.9}})
print(json.dumps({{"status": bad.status_code, "body": bad.json(), "server": "dial_tone" in SAMPLER_FIELDS,
                  "fields": [list(map(str, f)) for f in FIELDS], "no_default": NO_DEFAULT}}))
"""


def test_a_new_parameter_reaches_the_server_and_the_settings_screen():
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT.format(new=NEW))], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["status"] == 400
    assert out["body"]["error"]["param"] == "dial_tone"
    assert out["body"]["error"]["message"] == "dial_tone: must be a number in [0.25, 0.75]"  # the registry's words
    assert out["server"]
    assert ["dial_tone", "dial tone", "<class 'float'>"] in out["fields"]
    # sorted by screen_order: after the stability threshold (5), before the confidence threshold (6)
    names = [f[0] for f in out["fields"]]
    assert names.index("stability_threshold") < names.index("dial_tone") < names.index("confidence_threshold")
    assert out["no_default"]["dial_tone"] == "off: silence"


# The sampler's parameters are built when it is imported: a fresh interpreter adds the parameter
# first, then generates with it and watches it arrive at the step.
GENERATE = """
import json
from mlx_dgemma import params
params.PARAMS = params.PARAMS + ({new},)
from mlx_dgemma import load, stream_generate
from mlx_dgemma.errors import ParameterError
from mlx_dgemma.runtime import Runtime

seen = []
real = Runtime.step
Runtime.step = lambda self, p, *a, **k: (seen.append(p.dial_tone), real(self, p, *a, **k))[1]
rt = load({model!r})
events = list(stream_generate(rt, "hi", dial_tone=0.5, max_new_tokens=8, max_denoising_steps=1, seed=0))
try:
    list(stream_generate(rt, "hi", dial_tone=0.9))
    refused = None
except ParameterError as e:
    refused = str(e)
print(json.dumps({{"seen": seen, "done": type(events[-1]).__name__, "refused": refused}}))
"""


def test_a_new_parameter_reaches_generation(tiny_model_dir):
    """Given to ``stream_generate`` by its name alone, the new parameter is checked against its
    range and arrives, with its value, in the sampler's parameters the denoising step runs with."""
    script = textwrap.dedent(GENERATE.format(new=NEW, model=str(tiny_model_dir)))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["seen"] == [0.5] and out["done"] == "DoneEvent"
    assert out["refused"] == "dial_tone = 0.9: must be a number in [0.25, 0.75]"


def test_the_registry_matches_the_sampler_and_its_defaults():
    """A parameter with a model default is a SamplerDefaults field; the others are None = off."""
    from mlx_dgemma.sampler import SamplerParams

    with_default = {p.name for p in params.PARAMS if p.model_default}
    assert with_default == {f.name for f in fields(SamplerDefaults)} - {"eos_token_id", "pad_token_id"}
    assert {p.name for p in params.PARAMS} <= {f.name for f in fields(SamplerParams)}
    for p in params.PARAMS:
        default = getattr(SamplerParams(), p.name)
        assert (default is None) == (not p.model_default), p.name
        if default is not None:
            assert isinstance(default, p.kind) and p.low <= default <= p.high, p.name


def test_the_registry_imports_no_mlx():
    """The CLI builds its flags from the registry before anything heavy is imported."""
    code = ("import sys, mlx_dgemma.params, mlx_dgemma.validate; "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'mlx'], 'MLX imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
