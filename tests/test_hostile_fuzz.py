"""Generated hostile inputs: mutators over a tiny GGUF (header, metadata, tensor table, data,
truncation) and over a converted directory (JSON files, safetensors headers), each run through
the CLI in-process. For every case the promise holds: success, or a non-zero exit with one line
of stderr and no traceback; nothing left on disk; bounded time (a watchdog turns a hang into a
failure). A sample runs in CI (MLX_DGEMMA_FUZZ_EXAMPLES, default 30 per mutator family, seed
MLX_DGEMMA_FUZZ_SEED, default 0); the long sweep is marked slow.
"""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from tests.hostile_util import promise

EXAMPLES = int(os.environ.get("MLX_DGEMMA_FUZZ_EXAMPLES", "30"))
SEED = int(os.environ.get("MLX_DGEMMA_FUZZ_SEED", "0"))
SLOW_EXAMPLES = 400
CASE_SECONDS = 60  # a case taking longer is a hang

TALLY: dict[str, list[int]] = {}  # family: [tried, clean (promise kept), refused (exit 2)]


def _settings(n: int):
    return settings(max_examples=n, deadline=None, database=None, derandomize=False,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])


# --- an independent GGUF walker: where the numeric fields are (not the code under test's) -----

def gguf_fields(data: bytes) -> tuple[list[tuple[int, int, str]], int]:
    """[(position, width, what)] of every count, length, type, dimension and offset; and the
    end of the tensor table."""
    out: list[tuple[int, int, str]] = [(8, 8, "tensor count"), (16, 8, "kv count")]
    n_t, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def string(what: str) -> None:
        nonlocal pos
        out.append((pos, 8, what))
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n

    for _ in range(n_kv):
        string("key length")
        out.append((pos, 4, "value type"))
        (vt,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if vt == 8:
            string("string length")
        elif vt == 9:
            out.append((pos, 4, "array item type"))
            out.append((pos + 4, 8, "array count"))
            it, count = struct.unpack_from("<IQ", data, pos)
            pos += 12
            if it == 8:
                for _ in range(count):
                    string("array string length")
            else:
                pos += sizes[it] * count
        else:
            out.append((pos, sizes[vt], "scalar value"))
            pos += sizes[vt]
    for _ in range(n_t):
        string("tensor name length")
        out.append((pos, 4, "n_dims"))
        (nd,) = struct.unpack_from("<I", data, pos)
        pos += 4
        for _ in range(nd):
            out.append((pos, 8, "dimension"))
            pos += 8
        out.append((pos, 4, "ggml type"))
        out.append((pos + 4, 8, "tensor offset"))
        pos += 12
    return out, pos


INTERESTING = st.one_of(st.sampled_from([0, 1, 2, 3, 7, 8, 9, 12, 13, 31, 32, 33, 255, 256, 2**16, 2**31 - 1,
                                         2**31, 2**32 - 1, 2**32, 2**48, 2**62, 2**63, 2**64 - 1]),
                        st.integers(0, 2**64 - 1))


class Base(tuple):
    """(bytes, fields, end of the tensor table), with a short repr for hypothesis' reports."""

    def __repr__(self) -> str:
        return f"<tiny GGUF, {len(self[0])} bytes>"


@pytest.fixture(scope="module")
def base_gguf(tiny_gguf) -> Base:
    data = tiny_gguf.read_bytes()
    fields, table_end = gguf_fields(data)
    return Base((data, fields, table_end))


def _watchdog():
    # a hang fails the run loudly (the real stderr: pytest's capture has no file descriptor)
    faulthandler.dump_traceback_later(CASE_SECONDS, exit=True, file=sys.__stderr__)


def run_convert_case(family: str, data: bytes, capsys) -> None:
    work = Path(tempfile.mkdtemp(prefix="hostile-"))
    try:
        src = work / "in.gguf"
        src.write_bytes(data)
        t0 = time.perf_counter()
        _watchdog()
        tally = TALLY.setdefault(family, [0, 0, 0])
        tally[0] += 1
        code, line = promise(["convert", str(src), str(work / "out")], capsys, work, {"in.gguf"})
        faulthandler.cancel_dump_traceback_later()
        assert time.perf_counter() - t0 < CASE_SECONDS
        assert code in (0, 2), (code, line)
        if code == 2:
            assert str(src) in line or "in.gguf" in line, line  # the error names the file
        tally[1] += 1
        tally[2] += code != 0
    finally:
        faulthandler.cancel_dump_traceback_later()
        shutil.rmtree(work, ignore_errors=True)


# --- GGUF mutators --------------------------------------------------------------------------

def mutate_field(base, pick: int, value: int) -> bytes:
    data, fields, _ = base
    pos, width, _ = fields[pick % len(fields)]
    buf = bytearray(data)
    buf[pos:pos + width] = (value % (1 << (8 * width))).to_bytes(width, "little")
    return bytes(buf)


def flip_bytes(base, picks: list[tuple[int, int]]) -> bytes:
    data, _, table_end = base
    buf = bytearray(data)
    for pos, val in picks:
        buf[pos % table_end] = val
    return bytes(buf)


def truncate(base, at: int) -> bytes:
    data = base[0]
    return data[: at % len(data)]


def _gguf_cases():
    return st.one_of(
        st.tuples(st.just("field"), st.integers(0, 10**6), INTERESTING),
        st.tuples(st.just("flip"), st.lists(st.tuples(st.integers(0, 10**7), st.integers(0, 255)), min_size=1,
                                              max_size=4)),
        st.tuples(st.just("truncate"), st.integers(0, 10**8)),
    )


def _apply(base, case) -> bytes:
    if case[0] == "field":
        return mutate_field(base, case[1], case[2])
    if case[0] == "flip":
        return flip_bytes(base, case[1])
    return truncate(base, case[1])


@seed(SEED)
@_settings(EXAMPLES)
@given(case=_gguf_cases())
def test_mutated_gguf(base_gguf, capsys, case):
    run_convert_case(f"gguf-{case[0]}", _apply(base_gguf, case), capsys)


@pytest.mark.slow
@seed(SEED + 1)
@_settings(SLOW_EXAMPLES)
@given(case=_gguf_cases())
def test_mutated_gguf_sweep(base_gguf, capsys, case):
    run_convert_case(f"gguf-{case[0]}", _apply(base_gguf, case), capsys)


# --- metadata values: any key of the tiny model's metadata given a hostile value ------------

HOSTILE_VALUES = st.one_of(
    st.sampled_from([0, 1, 2, 3, 9, 2**31 - 1, 2**32 - 1, True, False, "", "three", "diffusion-gemma",
                     [], [0], [1, 1], [True] * 3, [3, 3, 3, 3], ["a", "b"]]),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.integers(0, 2**32 - 1),
    st.text(max_size=8),
)


def _metadata_keys():
    from mlx_dgemma.convert.synthetic import TinySpec

    return sorted(k for k in TinySpec().metadata() if k != "general.architecture") + [
        "diffusion.eb_max_steps", "diffusion.eb_t_min", "diffusion.eb_t_max", "diffusion.eb_stability_threshold",
        "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.mask_token_id"]


def run_metadata_case(key, value, capsys):
    from mlx_dgemma.convert.synthetic import TinySpec, write_tiny_gguf
    from mlx_dgemma.convert.tokenizer_data import synthetic_gemma4_vocab

    class BrokenSpec(TinySpec):
        def text_config(self):
            return TinySpec().text_config()

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "m.gguf"
        if key.startswith("tokenizer."):
            tok = synthetic_gemma4_vocab(512)
            tok[key] = value
            write_tiny_gguf(p, TinySpec(), tokenizer=tok)
        else:
            write_tiny_gguf(p, BrokenSpec(extra_metadata={key: value}))
        data = p.read_bytes()
    run_convert_case("metadata", data, capsys)


@seed(SEED)
@_settings(max(5, EXAMPLES // 3))
@given(key=st.sampled_from(_metadata_keys()), value=HOSTILE_VALUES)
def test_hostile_metadata_value(capsys, key, value):
    run_metadata_case(key, value, capsys)


@pytest.mark.slow
@seed(SEED + 1)
@_settings(SLOW_EXAMPLES)
@given(key=st.sampled_from(_metadata_keys()), value=HOSTILE_VALUES)
def test_hostile_metadata_value_sweep(capsys, key, value):
    run_metadata_case(key, value, capsys)


# --- converted directories ------------------------------------------------------------------

JSON_FILES = ["config.json", "generation_config.json", "tokenizer_gguf.json"]
JSON_VALUES = st.one_of(st.sampled_from([None, 0, -1, 1, 2**40, 1e308, "x", [], {}, [1, 2], True, "nan"]),
                        st.integers(-2**63, 2**63), st.floats(allow_nan=False), st.text(max_size=4))


def _json_paths(obj, prefix=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield prefix + (k,)
            if k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                         "tokenizer.ggml.merges", "quantization"):
                yield from _json_paths(v, prefix + (k,))
    elif isinstance(obj, list) and len(obj) <= 8:
        for i, v in enumerate(obj):
            yield prefix + (i,)


def _set(obj, path, value, delete=False):
    for k in path[:-1]:
        obj = obj[k]
    if delete and isinstance(obj, dict):
        obj.pop(path[-1])
    else:
        obj[path[-1]] = value


def tamper_dir(d: Path, case) -> None:
    kind = case[0]
    if kind == "json":
        _, fname, pick, value, delete = case
        f = d / fname
        obj = json.loads(f.read_text())
        paths = list(_json_paths(obj))
        _set(obj, paths[pick % len(paths)], value, delete)
        f.write_text(json.dumps(obj))
    elif kind == "raw":
        _, fname, cut = case
        f = d / fname
        raw = f.read_bytes()
        f.write_bytes(raw[: cut % max(1, len(raw))])
    else:  # safetensors header bytes
        _, picks = case
        f = d / "model.safetensors"
        buf = bytearray(f.read_bytes())
        (n,) = struct.unpack_from("<Q", buf)
        for pos, val in picks:
            buf[pos % (8 + n)] = val
        f.write_bytes(bytes(buf))


def _dir_cases():
    return st.one_of(
        st.tuples(st.just("json"), st.sampled_from(JSON_FILES), st.integers(0, 10**6), JSON_VALUES, st.booleans()),
        st.tuples(st.just("raw"), st.sampled_from(JSON_FILES + ["model.safetensors", "chat_template.jinja"]),
                  st.integers(0, 10**8)),
        st.tuples(st.just("st"), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1,
                                            max_size=4)),
    )


@pytest.fixture(scope="module")
def base_dir(tiny_model_dir, tmp_path_factory) -> Path:
    from tests.conftest import CHAT_TEMPLATE

    d = tmp_path_factory.mktemp("fuzzbase") / "m"
    shutil.copytree(tiny_model_dir, d)
    if not (d / "chat_template.jinja").is_file():
        (d / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return d


def run_dir_case(base: Path, case, capsys) -> None:
    work = Path(tempfile.mkdtemp(prefix="hostile-dir-"))
    try:
        d = work / "m"
        shutil.copytree(base, d)
        tamper_dir(d, case)
        tally = TALLY.setdefault(f"dir-{case[0]}", [0, 0, 0])
        tally[0] += 1
        _watchdog()
        t0 = time.perf_counter()
        code, line = promise(["generate", "--model", str(d), "--prompt", "hi", "--steps", "1", "--max-tokens", "1",
                              "--seed", "0", "--json"], capsys, work, {"m"})
        faulthandler.cancel_dump_traceback_later()
        assert time.perf_counter() - t0 < CASE_SECONDS
        assert code in (0, 2), (code, line)
        capsys.readouterr()
        tally[1] += 1
        tally[2] += code != 0
    finally:
        faulthandler.cancel_dump_traceback_later()
        shutil.rmtree(work, ignore_errors=True)


@seed(SEED)
@_settings(EXAMPLES)
@given(case=_dir_cases())
def test_tampered_converted_dir(base_dir, capsys, case):
    run_dir_case(base_dir, case, capsys)


@pytest.mark.slow
@seed(SEED + 1)
@_settings(SLOW_EXAMPLES)
@given(case=_dir_cases())
def test_tampered_converted_dir_sweep(base_dir, capsys, case):
    run_dir_case(base_dir, case, capsys)


def test_found_by_the_sweep_control_character_in_a_tensor_name(base_dir, capsys):
    """A byte flip that puts a newline into a safetensors tensor name: still one line."""
    run_dir_case(base_dir, ("st", [(42, 10)]), capsys)


def test_report_tally():
    """Prints how many generated cases ran and kept the promise (pytest -s shows it)."""
    tried = sum(t[0] for t in TALLY.values())
    clean = sum(t[1] for t in TALLY.values())
    print(f"\nhostile inputs: {tried} tried, {clean} clean " +
          json.dumps({k: {"tried": t, "clean": c, "refused": r} for k, (t, c, r) in sorted(TALLY.items())}))
    assert clean == tried
