"""The package layout rules (docs/architecture.md), checked without running the model."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_events_are_plain_data_without_mlx():
    # The trace, the TUI screens and the TUI's test fakes read events: none of them may need MLX.
    code = ("import sys; import mlx_dgemma.events, mlx_dgemma.trace, tests.tui_fakes; "
            "from mlx_dgemma import StepEvent, DoneEvent; "
            "assert StepEvent is mlx_dgemma.events.StepEvent; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'mlx'); "
            "assert not bad, f'MLX imported: {bad}'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_events_are_imported_from_their_own_module():
    # One home for the event classes: the package's names are mlx_dgemma.events' classes, and
    # nothing imports them from generation.py (which once re-exported them for older imports).
    import mlx_dgemma
    from mlx_dgemma import events

    for name in events.__all__:
        assert getattr(mlx_dgemma, name) is getattr(events, name), name
    bad = []
    for path in _sources("mlx_dgemma", "convert", "tui", "tests", "benchmarks", "scripts"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.ImportFrom) and (node.module or "").endswith("generation")
                    and any(a.name in events.__all__ for a in node.names)):
                bad.append(f"{path.relative_to(ROOT).as_posix()}:{node.lineno}")
    assert not bad, "events imported from mlx_dgemma.generation, not mlx_dgemma.events:\n" + "\n".join(bad)


def _sources(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


# The dependency rule, read from the source with `ast` (nothing is imported): the core
# (mlx_dgemma/*.py) imports neither mlx_dgemma.tui nor mlx_dgemma.convert's modules; convert/ and tui/
# reach the core only by public names of public modules and absolute imports, and not each other.
# Today's exceptions, each (core file, module it imports); docs/architecture.md says why.
# A new exception fails the test: move the code, or argue for it here and in the doc.
KNOWN_CORE_EXCEPTIONS = {
    # load_gguf turns a GGUFSource into MLX arrays: the convert package's public names only.
    ("mlx_dgemma/loader.py", "mlx_dgemma.convert"),
    # The CLI front end runs the converter, the verifier and the chat app.
    ("mlx_dgemma/cli.py", "mlx_dgemma.convert.converter"),
    ("mlx_dgemma/cli.py", "mlx_dgemma.convert.verify"),
    ("mlx_dgemma/cli.py", "mlx_dgemma.tui.app"),
    # The demo model is built from a synthetic GGUF, converted.
    ("mlx_dgemma/demo.py", "mlx_dgemma.convert.synthetic"),
    # `doctor` checks one decoder layer at the published shapes, built like the benchmark's
    # real-shapes model: a synthetic GGUF, converted in memory.
    ("mlx_dgemma/doctor.py", "mlx_dgemma.convert.synthetic"),
}

# The benchmark (mlx_dgemma/bench/) is tooling beside the core, like the command line: it may
# use convert's public names (its models are synthetic GGUFs, converted; its peers are given a
# GGUF's weights), and only the command line that runs it imports it.
BENCH_IMPORTERS = {"mlx_dgemma/cli.py",
                   "mlx_dgemma/doctor.py"}  # the published layer shapes: bench.configs' "real-shapes"

# Installed package -> source folder (pyproject's package-dir mapping).
PACKAGES = {"mlx_dgemma": "mlx_dgemma", "mlx_dgemma.bench": "mlx_dgemma/bench", "mlx_dgemma.convert": "convert",
            "mlx_dgemma.tui": "tui", "mlx_dgemma.tui.screens": "tui/screens", "mlx_dgemma.tui.widgets": "tui/widgets"}

# The packages beside the core: (source folder prefix, installed package, packages it must not import).
SIDES = {"convert/": ("mlx_dgemma.convert", ("mlx_dgemma.tui", "mlx_dgemma.bench")),
         "tui/": ("mlx_dgemma.tui", ("mlx_dgemma.convert", "mlx_dgemma.bench")),
         "mlx_dgemma/bench/": ("mlx_dgemma.bench", ("mlx_dgemma.tui",))}


def _imports(package: str, folder: str) -> list[tuple[str, str, str, int]]:
    """(file, imported module, imported name or "", line) for every import in ``folder``'s files,
    relative imports resolved against ``package``; function-level (lazy) imports included."""
    out = []
    for path in sorted((ROOT / folder).glob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            if isinstance(node, ast.Import):
                out += [(rel, a.name, "", node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module
                for a in node.names:
                    out.append((rel, module, a.name, node.lineno))
                    # `from pkg import submodule`: the submodule is imported too (a public name
                    # of the package itself, `from mlx_dgemma.convert import GGUFSource`, is not).
                    if module in PACKAGES and _is_module(module, a.name):
                        out.append((rel, f"{module}.{a.name}", "", node.lineno))
    return out


def _is_module(package: str, name: str) -> bool:
    folder = ROOT / PACKAGES[package]
    return (folder / f"{name}.py").is_file() or (folder / name / "__init__.py").is_file()


def _all_imports() -> list[tuple[str, str, str, int]]:
    return [i for package, folder in PACKAGES.items() for i in _imports(package, folder)]


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_import_scan_sees_relative_and_lazy_imports():
    # The scan itself: a known lazy relative import of the core and a known absolute one of tui.
    found = {(f, m) for f, m, _, _ in _all_imports()}
    assert ("mlx_dgemma/loader.py", "mlx_dgemma.convert") in found  # lazy
    assert ("mlx_dgemma/loader.py", "mlx_dgemma.convert.source") not in found  # a public name, not the module
    assert ("mlx_dgemma/__init__.py", "mlx_dgemma.loader") in found  # lazy, relative
    assert ("tui/screens/chat.py", "mlx_dgemma.tui.engine") in found  # `from ..engine import`
    assert ("tui/screens/chat.py", "mlx_dgemma.events") in found
    assert ("mlx_dgemma/bench/peers.py", "mlx_dgemma.convert.names") in found  # lazy, absolute


def test_core_imports_neither_tui_nor_convert_beyond_the_known_exceptions():
    bad = sorted(f"{f}:{line} imports {m}" for f, m, _, line in _all_imports()
                 if f.count("/") == 1 and f.startswith("mlx_dgemma/")
                 and (_under(m, "mlx_dgemma.tui") or _under(m, "mlx_dgemma.convert"))
                 and (f, m) not in KNOWN_CORE_EXCEPTIONS)
    assert not bad, "the core reaches into convert/tui (see docs/architecture.md):\n" + "\n".join(bad)


def test_gguf_files_are_read_in_convert_only():
    # GGUF knowledge lives in convert/ (issue 22): the binary pre-scan, the value types, the
    # metadata rules and the reader. The core (server included) and tui never import gguf-py;
    # the core opens a .gguf only through convert's exported GGUFSource (KNOWN_CORE_EXCEPTIONS).
    # The benchmark is tooling: its peers read a GGUF with gguf-py directly.
    bad = []
    for path in sorted((ROOT / "mlx_dgemma").rglob("*.py")) + sorted((ROOT / "tui").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("mlx_dgemma/bench/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bad += [f"{rel}:{node.lineno} imports {n}" for n in names if _under(n, "gguf")]
    assert not bad, "GGUF files are read in convert/ (see docs/architecture.md):\n" + "\n".join(bad)


def test_core_never_imports_the_benchmark():
    bad = sorted(f"{f}:{line} imports {m}" for f, m, _, line in _all_imports()
                 if _under(m, "mlx_dgemma.bench") and not f.startswith("mlx_dgemma/bench/")
                 and f not in BENCH_IMPORTERS)
    assert not bad, "only the command line runs the benchmark (see docs/architecture.md):\n" + "\n".join(bad)


# The peer's (mlx-vlm's) private members that a study of its step's parts needs: its decoder
# has no public way to build the decoder masks or the self-conditioned canvas embedding alone.
PEER_PRIVATE = {("benchmarks/step_parts.py", "_make_decoder_masks"), ("benchmarks/step_parts.py", "_embed_canvas")}


def test_the_benchmark_uses_public_members_only():
    # The bench and benchmarks/ measure the model as a user runs it: a study that needs a piece
    # of the model gets a public method there (e.g. `DiffusionGemma.global_freqs`), not `._x`.
    bad = []
    for path in sorted((ROOT / "mlx_dgemma/bench").glob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                if (path.relative_to(ROOT).as_posix(), node.attr) not in PEER_PRIVATE:
                    bad.append(f"{path.relative_to(ROOT).as_posix()}:{node.lineno}: .{node.attr}")
    assert not bad, "private members reached into:\n" + "\n".join(bad)


def test_the_core_takes_only_the_convert_packages_exported_names():
    # `from mlx_dgemma.convert import X`: X must be in convert/__init__.py's __all__ (GGUFSource...)
    tree = ast.parse((ROOT / "convert" / "__init__.py").read_text())
    exported = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets))
    assert "GGUFSource" in exported
    taken = [(f, name, line) for f, m, name, line in _all_imports()
             if f.count("/") == 1 and f.startswith("mlx_dgemma/") and m == "mlx_dgemma.convert" and name]
    assert taken, "the scan should see loader.py's import of GGUFSource"
    bad = [f"{f}:{line} imports mlx_dgemma.convert.{name}, not in its __all__" for f, name, line in taken
           if name not in exported]
    assert not bad, "\n".join(bad)


def test_convert_tui_and_bench_use_the_cores_public_names_only():
    bad = []
    for f, m, name, line in _all_imports():
        side = next((v for k, v in SIDES.items() if f.startswith(k)), None)
        if side is None or not _under(m, "mlx_dgemma"):
            continue
        own, others = side
        if any(_under(m, o) for o in others):
            bad.append(f"{f}:{line} imports {m} (convert, tui and bench do not import each other; "
                       "bench may use convert's public names)")
        elif not _under(m, own):
            private = [p for p in m.split(".")[1:] + [name] if p.startswith("_") and p != "__future__"]
            if private:
                bad.append(f"{f}:{line} imports private {m} {name}".rstrip())
    assert not bad, "\n".join(bad)


def test_convert_and_tui_reach_the_core_by_absolute_imports():
    # `..` across the package-dir mapping hides which package a name comes from (issue 11).
    bad = []
    for package, folder in PACKAGES.items():
        own = ".".join(package.split(".")[:2])  # mlx_dgemma.convert, mlx_dgemma.tui or mlx_dgemma.bench
        if own == "mlx_dgemma":
            continue
        for path in sorted((ROOT / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level:
                    parts = package.split(".")
                    if not _under(".".join(parts[:len(parts) - node.level + 1]), own):
                        bad.append(f"{path.relative_to(ROOT).as_posix()}:{node.lineno}: relative import "
                                   f"leaves {own}; write `from mlx_dgemma.<module> import ...`")
    assert not bad, "\n".join(bad)


def test_the_packages_import_nothing_of_mlx_lm():
    # mlx-lm's package __init__ imports transformers (and torch): 4-6 s before a command's first
    # line on a Mac (issue 30). Its expert layers are vendored (mlx_dgemma/switch_layers.py, held
    # to mlx-lm's by tests/test_switch_layers.py); the benchmark's peers may use it (mlx-vlm does).
    bad = [f"{f}:{line} imports {m}" for f, m, _, line in _all_imports()
           if _under(m, "mlx_lm") and not f.startswith("mlx_dgemma/bench/")]
    assert not bad, "\n".join(bad)


# --------------------------------------------------------------------------------------------
# No attributes hung on objects from outside: what belongs with a loaded model (tokenizer,
# generation defaults, precision, demo kind, compiled steps) is a field of
# mlx_dgemma.runtime.Runtime, not an attribute set on the model (issue 22).
# Each exception: (file, the call's source text), and why it is model-building, not hanging.
SETATTR_EXCEPTIONS = {
    # DiffusionGemma.shard -> shard_module: each sharded layer's own parameter replaced by this
    # rank's slice while the model is built (nn.Module parameters, as load_weights sets them).
    ("mlx_dgemma/distributed.py", "setattr(module, name, take(params[name], axis, ranges))"),
}


def test_nothing_sets_attributes_from_outside():
    found, bad = set(), []
    for path in _sources("mlx_dgemma", "convert", "tui"):
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            hit = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
                hit = node
            elif isinstance(node, ast.Attribute) and node.attr in ("__setattr__", "__dict__"):
                hit = node  # object.__setattr__(model, ...), model.__dict__[...] / .pop(...)
            if hit is not None:
                call = ast.get_source_segment(text, hit)
                if (rel, call) in SETATTR_EXCEPTIONS:
                    found.add((rel, call))
                else:
                    bad.append(f"{rel}:{hit.lineno}: {call}")
    assert not bad, "attributes set from outside (make them Runtime fields or the object's own):\n" + "\n".join(bad)
    assert found == SETATTR_EXCEPTIONS, f"stale exceptions: {SETATTR_EXCEPTIONS - found}"


def test_the_scan_for_hung_attributes_sees_them(tmp_path):
    # the rule above on the spellings it must catch (and the one it must not)
    code = ("object.__setattr__(model, 'precision', p)\nsetattr(model, 'x', 1)\nmodel.__dict__.pop('_s', None)\n"
            "model.args = a\n")
    kinds = [type(n).__name__ for n in ast.walk(ast.parse(code))
             if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "setattr")
             or (isinstance(n, ast.Attribute) and n.attr in ("__setattr__", "__dict__"))]
    assert sorted(kinds) == ["Attribute", "Attribute", "Call"]


# --------------------------------------------------------------------------------------------
# No import cycles anywhere in the installed packages (core, server, bench, convert, tui),
# lazy imports included; imports under `if TYPE_CHECKING:` are annotations, not imports.
ALL_PACKAGES = {**PACKAGES, "mlx_dgemma.server": "mlx_dgemma/server"}


def _module_of(path: Path) -> str:
    folder = path.parent.relative_to(ROOT).as_posix()
    package = next(p for p, f in ALL_PACKAGES.items() if f == folder)
    return package if path.stem == "__init__" else f"{package}.{path.stem}"


def _runtime_imports(tree: ast.AST):
    """Import nodes outside ``if TYPE_CHECKING:`` blocks."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skip]


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports. ``from pkg import name`` imports ``pkg.name``
    where that is a module (and only then ``pkg`` itself: a name defined in its __init__)."""
    files = [p for f in ALL_PACKAGES.values() for p in sorted((ROOT / f).glob("*.py"))]
    known = {_module_of(p) for p in files}
    graph: dict[str, set[str]] = {}
    for path in files:
        mod = _module_of(path)
        package = mod if path.stem == "__init__" else mod.rpartition(".")[0]
        deps = graph.setdefault(mod, set())
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            for t in targets:
                while t and t not in known:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    deps.add(t)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_in_the_whole_package():
    graph = import_graph()
    assert {"mlx_dgemma.loader", "mlx_dgemma.server.app", "mlx_dgemma.bench.studies", "mlx_dgemma.convert.source",
            "mlx_dgemma.tui.screens.chat"} <= set(graph)
    assert "mlx_dgemma.params" in graph["mlx_dgemma.validate"]  # `from . import params`: the module
    cycles = _cycles(graph)
    detail = [" <-> ".join(c) + ": " + "; ".join(f"{a} -> {b}" for a in c for b in sorted(graph[a]) if b in c)
              for c in cycles]
    assert not cycles, "import cycles:\n" + "\n".join(detail)


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_every_module_constant_is_used_somewhere():
    # a constant nothing reads is a second, stale statement of a fact (loader.REQUIRED_FILES restated
    # validate's check; demo.DEMO_NOTICE one of DEMO_NOTICES): the package's UPPER_CASE module names
    # are each read by the code, the tests, the benchmarks or the scripts
    import re

    readers = [p.read_text() for p in _sources("mlx_dgemma", "convert", "tui", "tests", "benchmarks", "scripts")]
    unused = []
    for path in _sources("mlx_dgemma", "convert", "tui"):
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            for name in (t.id for t in targets if isinstance(t, ast.Name) and re.fullmatch(r"[A-Z][A-Z0-9_]+", t.id)):
                word = re.compile(rf"\b{name}\b")
                if sum(len(word.findall(text)) for text in readers) < 2:  # its definition alone
                    unused.append(f"{path.relative_to(ROOT).as_posix()}: {name}")
    assert not unused, "module constants nothing reads (delete them):\n" + "\n".join(unused)


# --------------------------------------------------------------------------------------------
# No source module over MAX_MODULE_LINES lines (issue 34): a module that long holds several
# concerns; split it by concern (doctor.py: the command, doctor_checks, doctor_device,
# doctor_report; server/engine.py: metrics.py, payloads.py, shaping.py; cli.py: cli_options.py,
# cli_generate.py). An exception is listed with why (none today); one that shrinks below the
# limit must leave this list.
MAX_MODULE_LINES = 600
LONG_MODULES: dict[str, str] = {}


def test_no_source_module_is_over_the_line_limit():
    lengths = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines())
               for p in _sources("mlx_dgemma", "convert", "tui")}
    assert {"mlx_dgemma/doctor.py", "mlx_dgemma/server/engine.py", "mlx_dgemma/cli.py"} <= set(lengths)  # seen
    long = {f: n for f, n in lengths.items() if n > MAX_MODULE_LINES}
    bad = [f"{f}: {n} lines" for f, n in sorted(long.items()) if f not in LONG_MODULES]
    assert not bad, f"source modules over {MAX_MODULE_LINES} lines (split them by concern):\n" + "\n".join(bad)
    stale = sorted(set(LONG_MODULES) - set(long))
    assert not stale, f"no longer over {MAX_MODULE_LINES} lines: remove from LONG_MODULES: {stale}"


# A test file over this holds several screens' or features' tests (issue 34: test_tui.py was 1,004
# lines before it was split by screen); split it by what it tests.
MAX_TEST_LINES = 800


def test_no_test_file_is_over_the_line_limit():
    lengths = {p.name: len(p.read_text().splitlines()) for p in (ROOT / "tests").glob("*.py")}
    assert "test_architecture.py" in lengths  # seen
    long = [f"tests/{f}: {n} lines" for f, n in sorted(lengths.items()) if n > MAX_TEST_LINES]
    assert not long, f"test files over {MAX_TEST_LINES} lines (split them by what they test):\n" + "\n".join(long)
