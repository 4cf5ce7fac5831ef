"""A precision tier is one :class:`mlx_dgemma.tiers.Tier` row: the rows are today's precisions,
and a row added to ``TIER_ROWS`` alone (a 2-bit ``q2``, in a separate process) reaches the
recipe, the command line, the memory plan, ``convert --precision``, loading, ``verify`` and
doctor's fit rows, with no other edit (docs/architecture.md, "What a change costs")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mlx_dgemma.tiers import AUTO_ORDER, PRECISIONS, STORED_FORMS, TIER_ROWS, TIERS, stored_precision, tier


def test_the_derived_names_follow_the_rows():
    assert TIERS == tuple(t.name for t in TIER_ROWS)
    assert PRECISIONS == ("auto", *TIERS)
    # auto never picks the lossless form, and tries the rest most exact first
    assert AUTO_ORDER == tuple(t.name for t in TIER_ROWS if not t.lossless)
    assert [t.name for t in TIER_ROWS if t.lossless] == [TIERS[0]]
    assert set(STORED_FORMS) == set(TIERS) | {a for t in TIER_ROWS for a in t.aliases}
    for t in TIER_ROWS:
        assert tier(t.name) is t
        for name in (t.name, *t.aliases):  # an older name of a form reads as its tier
            assert stored_precision({"mlx_dgemma": {"weights": name}}) == t.name
    with pytest.raises(ValueError, match="unknown precision 'auto'"):
        tier("auto")  # the plan resolves auto; no row is named so


# One edit: the q2 row appended to TIER_ROWS in tiers.py's source (found with ast, so the test
# follows the declaration wherever it sits), loaded as mlx_dgemma.tiers before anything imports
# it. Then each consumer is asked what it makes of q2; the answers come back as JSON.
_SCRIPT = r'''
import ast, contextlib, importlib.util, io, json, sys
from pathlib import Path

ROW = 'Tier("q2", "experts 2-bit, the rest 4-6 bits", experts=2, edge_experts=3, embedding=6, rest=4)'
spec = importlib.util.find_spec("mlx_dgemma.tiers")
src = Path(spec.origin).read_bytes()
decl = next(n for n in ast.parse(src).body if isinstance(n, ast.Assign)
            and [getattr(t, "id", None) for t in n.targets] == ["TIER_ROWS"])
last = decl.value.elts[-1]
at = sum(len(line) for line in src.splitlines(keepends=True)[:last.end_lineno - 1]) + last.end_col_offset
src = src[:at] + b", " + ROW.encode() + src[at:]
tiers = importlib.util.module_from_spec(spec)
sys.modules["mlx_dgemma.tiers"] = tiers
exec(compile(src, spec.origin, "exec"), tiers.__dict__)

import mlx.core as mx
from mlx_dgemma import load
from mlx_dgemma.cli import build_parser
from mlx_dgemma.convert.converter import convert
from mlx_dgemma.convert.verify import verify
from mlx_dgemma.demo import trained_demo_path
from mlx_dgemma.doctor_device import MemoryInfo, precision_fit
from mlx_dgemma.errors import ParameterError
from mlx_dgemma.loader import plan_model
from mlx_dgemma.precision import quantized_dtype_report

out, gguf, tmp = {}, str(trained_demo_path()), Path(sys.argv[1])
layers = 30
out["target"] = [tuple(t.__dict__.values()) if t else None for t in (
    tiers.target("q2", "layers.7.experts.gate_up_proj", "Q4_K", layers, 2816),
    tiers.target("q2", "layers.29.experts.down_proj", "Q8_0", layers, 704),
    tiers.target("q2", "embed_tokens", "Q6_K", layers, 2816),
    tiers.target("q2", "layers.3.self_attn.q_proj", "Q4_K", layers, 2816))]
parser = build_parser()


def help_of(command):
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        try:
            parser.parse_args([command, "--help"])
        except SystemExit:
            pass
    return " ".join(text.getvalue().split())


out["help"] = {c: "q2 = experts 2-bit, the rest 4-6 bits" in help_of(c) for c in ("generate", "convert", "serve")}
out["parsed"] = [parser.parse_args([*argv, "--precision", "q2"]).precision
                 for argv in (["generate", "--demo", "--prompt", "hi"], ["convert", "a.gguf", "out"], ["chat", "--demo"])]
plan = plan_model(gguf, 1 << 40)
out["plan_rows"] = [r.precision for r in plan.rows]
q2, q3 = plan.row("q2"), plan.row("q3")
out["q2_smaller"] = q2.weights_bytes < q3.weights_bytes
tight = plan_model(gguf, q2.needed_bytes)
out["auto_tight"] = tight.choose("auto")
out["refusal"] = plan_model(gguf, 1000).refusal("auto")
out["split"] = {r.precision: r.split_refused for r in plan_model(gguf, 1 << 40, ranks=2, rank=0).rows}
report = convert(gguf, tmp / "q2", precision="q2")
out["summary"] = report.summary_lines()[0].split("[", 1)[1]
out["stored"] = json.loads((tmp / "q2" / "config.json").read_text())["mlx_dgemma"]["weights"]
out["verify_ok"] = verify(tmp / "q2", gguf).ok
for name, path, precision in (("dir", tmp / "q2", "auto"), ("gguf", gguf, "q2")):
    rt = load(path, precision=precision)
    out[name] = [rt.precision.name, rt.precision.lossy_weights,
                 sorted({bits for p, _, bits, _ in quantized_dtype_report(rt.model) if ".experts." in p})]
try:
    load(tmp / "q2", precision="q3")
    out["more_exact"] = None
except ParameterError as e:
    out["more_exact"] = str(e)
fit = precision_fit(tmp / "q2", MemoryInfo("test", 1 << 40))
out["doctor"] = [(r.precision, r.fits) for r in fit.precisions]
print(json.dumps(out))
'''


def test_a_new_tier_is_one_row(tmp_path):
    run = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    # the row's recipe by role: experts 2-bit (the first and last layers' 3), embedding 6, the rest 4
    assert got["target"] == [[2, 128, False], [3, 64, False], [6, 64, False], [4, 64, False]]
    assert got["help"] == {"generate": True, "convert": True, "serve": True}
    assert got["parsed"] == ["q2", "q2", "q2"]
    # the plan prices it last (the least exact), auto takes it when only it fits, and the
    # refusal names it as the smallest
    assert got["plan_rows"] == [*TIERS, "q2"] and got["q2_smaller"]
    assert got["auto_tight"] == "q2"
    assert "(q2, the smallest, needs" in got["refusal"]
    # over two ranks, a .gguf's q2 is made whole before the split, as q4 and q3 are: the demo's
    # groups do not split, so it is refused as they are
    assert got["split"]["q2"] is got["split"]["q3"] is True
    # convert --precision q2 writes it, verify recomputes it, a load of the directory or of the
    # .gguf runs it with 2- and 3-bit experts (re-quantized as read, never the exact form first)
    assert got["summary"] == "q2 (lossy: experts 2-bit, the rest 4-6 bits)]"
    assert got["stored"] == "q2" and got["verify_ok"]
    assert got["dir"] == ["q2", True, [2, 3]] and got["gguf"] == ["q2", True, [2, 3]]
    assert "holds q2 weights (converted with --precision q2), which cannot be made more exact" in got["more_exact"]
    # doctor's fit rows are the plan's: q2 there too, the only one a q2 directory can load
    assert [p for p, _ in got["doctor"]] == [*TIERS, "q2"]
    assert [p for p, fits in got["doctor"] if fits] == ["q2"]
