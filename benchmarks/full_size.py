"""The model at its full published size, measured: a synthetic GGUF with the published tensor
inventory (all 692 tensors, the published ggml types and shapes, valid random blocks), then
``convert`` (time, peak RSS, directory size), ``verify`` (time, peak RSS), and for each
precision: ``load`` of the directory and of the .gguf (time, resident memory), a prefill and one
denoising step with their peak memory.

    python3 benchmarks/full_size.py --workdir /data/fullsize --precisions exact,fast

Every measurement runs in a fresh child process (``bench.isolate.isolated``), so each peak is
its own, and under a memory watchdog: a child is stopped, and its row says so, when the
machine's available memory falls below ``--min-free-gb`` (other work on the machine is never
pushed into the OOM killer). A load is started only when its estimated peak leaves that much
free. The GGUF is written tensor by tensor (the whole file is never in memory), to a
``.partial`` name renamed when complete; results go to ``WORKDIR/full_size.json`` after each
measurement and a rerun skips what is already there (``--redo`` measures again), so an
interrupted run keeps what finished (a child stopped part-way keeps the phases it finished).
Needs ~17 GB (GGUF) + ~22 GB (exact directory) of disk, plus each tier's directory.

A memory tier (``q4``, ``q3``) is converted to its own directory (``convert --precision``) and
loaded from it. ``--tier-layout-only`` writes that directory with random values in place of the
NumPy re-quantizer's (hours at full size on a slow CPU): the tier's exact layout and size, so
its load, memory and step are measured, its quality is not.

``--layers N`` keeps the first N transformer blocks (``blk.0.`` .. ``blk.{N-1}.``) and every
tensor outside them (embedding and head, norms, self-conditioning) at their published shapes, its
metadata cut to N layers (:func:`first_layers`): the real shapes at a fraction of the disk, for
fitting each phase's time as ``a + b * layers`` (the embedding's cost in ``a``). Its files are
named for N (a workdir can hold runs of several N, each with its own ``--results``).

The tokenizer is the synthetic gemma4 vocabulary at the published size (262,144 tokens; far
fewer merges than the published 514,906) and the file carries no chat template: neither
matters for the memory or time of the weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES

ROOT = Path(__file__).resolve().parents[1]
HEADER = ROOT / "tests" / "data" / "diffusiongemma-26b-a4b-it-q4_k_m.header.json"
GGUF_NAME = "diffusiongemma-26b-a4b-synthetic-q4_k_m.gguf"
ALIGNMENT = 32  # GGUF's default; the published file's tensor data total assumes it
GB = 1e9
_ARCH = "diffusion-gemma"  # the metadata keys' prefix (mlx_dgemma.convert.metadata.ARCH, not imported: no MLX here)
# Global layers rotate the first quarter of their head dim (rope_freqs: 64 of 256 entries 1.0).
PARTIAL_ROTARY = 0.25


# --------------------------------------------------------------------------------------------
# the inventory writer


def load_header(path: str | Path = HEADER) -> dict:
    """The published file's header (metadata with long arrays summarized, the tensor list)."""
    return json.loads(Path(path).read_text())


def _summarized(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("<") and value.endswith(">") and (
        value.startswith("<array of") or "template" in value)


def vocab_size(header: dict) -> int:
    """Rows of the token embedding (its GGUF ``ne[1]``)."""
    return int(next(t["ne"][1] for t in header["tensors"] if t["name"] == "token_embd.weight"))


def first_layers(header: dict, n: int) -> dict:
    """``header`` cut to its first ``n`` transformer blocks: the tensors of ``blk.0.`` ..
    ``blk.{n-1}.`` and every tensor outside the blocks, in the published order; ``block_count``
    set to ``n`` and every per-layer metadata array (one entry per block: the sliding-window
    pattern, the per-layer KV head counts) cut to its first ``n`` entries, so the file converts
    and loads as an ``n``-layer model of the published shapes."""
    key = f"{_ARCH}.block_count"
    total = int(header["metadata"][key])
    if not 1 <= n <= total:
        raise ValueError(f"--layers {n}: expected a number of layers in [1, {total}] (the header has {total})")
    md = {k: v[:n] if isinstance(v, list) and len(v) == total else v for k, v in header["metadata"].items()}
    md[key] = n

    def kept(name: str) -> bool:
        return not name.startswith("blk.") or int(name.split(".")[1]) < n

    return {**header, "metadata": md, "tensors": [t for t in header["tensors"] if kept(t["name"])]}


def gguf_name(layers: int | None) -> str:
    """The synthetic file's name: the published inventory's, or its first ``layers`` blocks'."""
    return GGUF_NAME if layers is None else GGUF_NAME.replace("-synthetic-", f"-synthetic-{layers}layers-")


def synthetic_metadata(header: dict) -> dict:
    """The published metadata, in its order, with the summarized entries (tokenizer arrays, chat
    template) replaced: a synthetic gemma4 vocabulary of the published size, no chat template."""
    from mlx_dgemma.convert.tokenizer_data import synthetic_gemma4_vocab

    tok = synthetic_gemma4_vocab(vocab_size(header))
    md: dict = {}
    for k, v in header["metadata"].items():
        if _summarized(v):
            if k in tok:
                md[k] = tok[k]
            continue  # the chat template: none (the app's default Gemma 4 turn format applies)
        md[k] = v
    return md


def tensor_nbytes(ne: list[int], qtype: T) -> int:
    """Bytes of one tensor's data in a GGUF of type ``qtype`` (``ne`` fastest axis first)."""
    block, size = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(ne))
    if ne[0] % block:
        raise ValueError(f"ne[0] = {ne[0]} is not a multiple of {qtype.name}'s block of {block}")
    return n // block * size


def data_bytes(tensors: list[dict], alignment: int = ALIGNMENT) -> int:
    """Tensor data of a GGUF holding ``tensors``, each padded to ``alignment``."""
    return sum(-(-tensor_nbytes(t["ne"], T[t["type"]]) // alignment) * alignment for t in tensors)


def write_inventory_gguf(path: str | Path, header: dict, *, select: Callable[[str], bool] | None = None,
                         seed: int = 0,
                         weight_std: float = 0.02,
                         progress: Callable[[int, int, str], None] | None = None) -> Path:
    """Write a GGUF with ``header``'s metadata (see :func:`synthetic_metadata`) and tensors
    (names, shapes, types in the published order; valid random blocks), streamed tensor by
    tensor: memory stays at about the largest tensor (the Q6_K embedding, ~0.6 GB).

    ``select(name)`` keeps only some tensors (tests: the header and a few MB). The file appears under ``path``
    only once complete (written as ``path.partial``, then renamed).
    """
    from mlx_dgemma.convert.metadata import ARCH, args_from_metadata
    from mlx_dgemma.convert.names import expected_tensors
    from mlx_dgemma.convert.synthetic import add_metadata, random_tensor

    path = Path(path)
    md = synthetic_metadata(header)
    args = args_from_metadata(md, vocab_size(header))
    matrix = {e.name: e.matrix for e in expected_tensors(args)}
    tensors = [t for t in header["tensors"] if select is None or select(t["name"])]
    tmp = path.with_name(path.name + ".partial")
    w = GGUFWriter(str(tmp), ARCH)
    for k, v in md.items():
        if k != "general.architecture":  # GGUFWriter writes it
            add_metadata(w, k, v)
    for t in tensors:
        qt = T[t["type"]]
        nbytes = tensor_nbytes(t["ne"], qt)
        if qt == T.F32:
            w.add_tensor_info(t["name"], list(reversed(t["ne"])), np.dtype(np.float32), nbytes)
        else:
            block, size = GGML_QUANT_SIZES[qt]
            byte_shape = [*reversed(t["ne"][1:]), t["ne"][0] // block * size]
            w.add_tensor_info(t["name"], byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    try:
        for i, t in enumerate(tensors):
            data, _ = random_tensor(t["name"], t["ne"], T[t["type"]], matrix[t["name"]], rng,
                                    weight_std=weight_std, partial_rotary=PARTIAL_ROTARY)
            w.write_tensor_data(np.ascontiguousarray(data))
            del data
            if progress:
                progress(i + 1, len(tensors), t["name"])
        w.close()
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------------------------
# measurements (each runs in its own child process)


def _rss_now() -> int:
    from mlx_dgemma.rss import current_rss_bytes  # not .memory: that imports MLX into the convert child

    return current_rss_bytes()


def _peak() -> int:
    from mlx_dgemma.rss import peak_rss_bytes

    return peak_rss_bytes()


def _log_every(label: str, every: int = 50) -> Callable[[int, int, str], None]:
    t0 = time.perf_counter()

    def log(i: int, n: int, name: str) -> None:
        if i == n or i % every == 0:
            print(f"  {label}: {i}/{n} tensors ({time.perf_counter() - t0:.0f} s, RSS {_rss_now() / GB:.2f} GB) "
                  f"{name}", file=sys.stderr, flush=True)
    return log


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def measure_write(gguf: str, header: str, seed: int, layers: int | None = None) -> dict:
    t0 = time.perf_counter()
    h = load_header(header)
    write_inventory_gguf(gguf, h if layers is None else first_layers(h, layers), seed=seed,
                         progress=_log_every("write"))
    return {"impl": "write synthetic GGUF", "seconds": time.perf_counter() - t0,
            "gguf_bytes": Path(gguf).stat().st_size, "peak_rss_bytes": _peak()}


def measure_convert(gguf: str, out: str, precision: str = "exact") -> dict:
    from mlx_dgemma.convert.converter import convert

    log = _log_every("convert")
    kw = {} if precision == "exact" else {"precision": precision}  # tiers: convert --precision
    t0 = time.perf_counter()
    rep = convert(gguf, out, progress=lambda done, total, i, n, name: log(i, n, name), **kw)
    return {"impl": f"convert ({precision})", "seconds": time.perf_counter() - t0, "peak_rss_bytes": _peak(),
            "dir_bytes": dir_bytes(Path(out)), "input_bytes": rep.input_bytes, "tensors": rep.tensors}


def measure_tier_layout(gguf: str, out: str, precision: str, seed: int = 0) -> dict:
    """``convert --precision`` of a memory tier with the re-quantizer's arithmetic (min-max and
    least-squares refits of every group) replaced by random values of the same shapes and
    dtypes: the directory has the tier's exact layout, config and size, so its load, memory
    and speed are the tier's; its values (and conversion_report's errors) are not. For a quick
    look at a tier's layout; the real tier conversion is measured by ``measure_convert``."""
    from mlx_dgemma.convert import tensors
    from mlx_dgemma.tiers import Requantized

    rng = np.random.default_rng(seed)

    def fake_requantize(q: np.ndarray, scales: Any, biases: Any, bits: int, subblock: int, t: Any) -> Requantized:
        lead, n = q.shape[:-1], q.shape[-1]
        levels = (1 << t.bits) - 1
        w = rng.integers(0, 1 << 32, (*lead, n * t.bits // 32), dtype=np.uint32)
        s = np.full((*lead, n // t.group_size), 0.04 / levels, dtype=np.float16)
        return Requantized(w, s, np.full_like(s, -0.02), 0.0, 0.0, 1.0)

    import shutil

    real_usage = shutil.disk_usage

    def disk_usage(path: Any) -> Any:
        # The converter asks for 2.5 bytes per weight (63 GB at full size, three times what any
        # precision writes); the tiers' directories (11-14 GB) fit in what the run leaves.
        u = real_usage(path)
        return type(u)(u.total, u.used, max(u.free, 10**12))

    saved = tensors.requantize_affine
    tensors.requantize_affine = fake_requantize
    shutil.disk_usage = disk_usage
    try:
        res = measure_convert(gguf, out, precision)
    finally:
        tensors.requantize_affine = saved
        shutil.disk_usage = real_usage
    res["impl"] = f"convert ({precision}), random values in the tier's layout"
    return res


def measure_verify(out: str, gguf: str) -> dict:
    from mlx_dgemma.convert.verify import verify

    t0 = time.perf_counter()
    rep = verify(out, gguf, progress=_log_every("verify"))
    return {"impl": "verify", "seconds": time.perf_counter() - t0, "peak_rss_bytes": _peak(),
            "checked": rep.checked, "exact": rep.exact, "ok": rep.ok, "mismatches": rep.mismatches[:5]}


def measure_load(path: str, precision: str, prefill_tokens: int = 0, canvas: int = 0,
                 partial: str | None = None) -> dict:
    """Load ``path`` in ``precision``: time and resident memory; then, if asked, a prefill of
    ``prefill_tokens`` random ids and one denoising step of a ``canvas``-token canvas (the
    compiled step generation runs, self-conditioned), each with the process's peak after it.
    After each phase the figures so far go to ``partial`` (JSON), so a child stopped later
    (watchdog, timeout) still reports what it measured."""

    def keep(res: dict) -> None:
        if partial:
            Path(partial).write_text(json.dumps(res))

    import mlx.core as mx

    from mlx_dgemma import load

    t0 = time.perf_counter()
    # the benchmark's own watchdog guards the machine: the loader's memory plan must not choose or
    # refuse the precision being measured
    runtime = load(path, precision=precision, memory_limit=1 << 50)
    model = runtime.model
    res: dict[str, Any] = {"impl": f"load {Path(path).name} {precision}", "precision": runtime.precision.label,
                           "load_seconds": time.perf_counter() - t0, "resident_bytes": _rss_now(),
                           "mlx_active_bytes": int(mx.get_active_memory()), "load_peak_rss_bytes": _peak()}
    print(f"  loaded {path} ({precision}) in {res['load_seconds']:.0f} s, RSS {res['resident_bytes'] / GB:.2f} GB, "
          f"peak {res['load_peak_rss_bytes'] / GB:.2f} GB", file=sys.stderr, flush=True)
    keep(res)
    if prefill_tokens:
        rng = np.random.default_rng(0)
        V = model.args.vocab_size
        cache = model.make_cache()
        t0 = time.perf_counter()
        model.prefill(mx.array(rng.integers(0, V, (1, prefill_tokens)), dtype=mx.int32), cache)
        mx.eval(cache.state())  # prefill evaluates each chunk; this only makes sure
        res.update(prefill_tokens=prefill_tokens, prefill_seconds=time.perf_counter() - t0,
                   prefill_peak_rss_bytes=_peak(), after_prefill_rss_bytes=_rss_now())
        print(f"  prefill {prefill_tokens} tokens: {res['prefill_seconds']:.0f} s, peak RSS "
              f"{res['prefill_peak_rss_bytes'] / GB:.2f} GB", file=sys.stderr, flush=True)
        keep(res)
        if canvas:
            res.update(_one_step(runtime, cache, canvas, rng))
    return res


def _one_step(runtime: Any, cache: Any, canvas: int, rng: np.random.Generator) -> dict:
    """One compiled denoising step (decoder + sampler + stopping rule), self-conditioned as
    generation's second and later steps are: the runtime's own step (its precision's activation
    dtype and self-conditioning width; a StepFunction built here in float32 timed fast's step at
    4x its decoder pass on a GPU). The previous step's logits it conditions on are
    random (a decoder pass to make them would double the measurement's time; the work of the
    step does not depend on their values)."""
    import mlx.core as mx

    from mlx_dgemma.sampler import SamplerParams

    V = runtime.model.args.vocab_size
    ids = mx.array(rng.integers(0, V, (1, canvas)), dtype=mx.int32)
    sc = mx.array(rng.normal(0.0, 3.0, (1, canvas, V)).astype(np.float32))
    mx.eval(sc)
    fn = runtime.step(SamplerParams.from_config(runtime.generation_config))
    hist = fn.initial_history((1, canvas))
    t0 = time.perf_counter()
    mx.eval(list(fn(ids, sc, 0.6, mx.random.key(0), hist, cache).values()))
    step = time.perf_counter() - t0
    print(f"  compiled step (canvas {canvas}): {step:.0f} s, peak RSS {_peak() / GB:.2f} GB", file=sys.stderr,
          flush=True)
    return {"canvas": canvas, "step_seconds": step, "step_peak_rss_bytes": _peak()}


# --------------------------------------------------------------------------------------------
# memory: what a load needs, what the machine has


def available_bytes() -> int:
    """The machine's available memory now (Linux MemAvailable, macOS vm_stat; no /proc needed)."""
    from mlx_dgemma.memory import system_available_bytes  # imports no MLX

    avail = system_available_bytes()
    return avail if avail is not None else total_bytes()


def total_bytes() -> int:
    """The machine's RAM (sysconf: Linux and macOS)."""
    from mlx_dgemma.rss import physical_ram_bytes

    return physical_ram_bytes()


def on_disk_tiers() -> tuple[str, ...]:
    """Precisions ``convert --precision`` writes as their own (smaller) directory, besides exact
    and fast: the memory tiers, where this checkout has them."""
    try:
        from mlx_dgemma.tiers import TIER_ROWS
    except ImportError:
        return ()
    return tuple(t.name for t in TIER_ROWS if t.requantizes)


def estimate_load_peak(model_dir: Path, exact_dir: Path) -> int:
    """Upper estimate of a load's peak: the weights the loader holds before putting them in
    their runtime form (``model_dir``'s safetensors: the exact directory for exact and fast,
    a tier's own directory for a tier, also for a tier loaded from the .gguf, which is
    re-quantized tensor by tensor), plus ~0.5 GB (measured: 0.4 GB over q3's directory). The watchdog guards
    a load that does worse than this."""
    d = model_dir if model_dir.is_dir() else exact_dir
    return sum(f.stat().st_size for f in d.glob("*.safetensors")) + int(0.5 * GB)


# --------------------------------------------------------------------------------------------
# the run


def _run(fn: str, results: dict, key: str, redo: bool, floor: int, timeout: float, **kw: Any) -> dict:
    from mlx_dgemma.bench.isolate import isolated

    if key in results and not redo and "skipped" not in results[key]:
        print(f"[{key}] kept from an earlier run", file=sys.stderr, flush=True)
        return results[key]
    print(f"[{key}] ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    res = isolated(f"full_size:{fn}", timeout=timeout, min_available_bytes=floor, **kw)
    res["impl"] = key
    res["wall_seconds"] = time.perf_counter() - t0
    results[key] = res
    print(f"[{key}] {json.dumps(res)}", file=sys.stderr, flush=True)
    return res


def _gb(n: Any) -> str:
    return f"{n / GB:.2f}" if isinstance(n, (int, float)) else "-"


def table(result: dict) -> str:
    """The printed report of a run's result."""
    m = result["machine"]
    lines = [f"machine: {m['platform']} ({m['device']}, mlx {m['mlx']}), {m['cpus']} CPUs, "
             f"{m['memory_bytes'] / GB:.1f} GB RAM", f"{'measurement':<34} {'seconds':>9} {'GB':>36}"]
    for key, r in result["rows"].items():
        if "skipped" in r:
            lines.append(f"{key:<34} not measured: {r['skipped']}")
            continue
        if key == "write":
            lines.append(f"{key:<34} {r['seconds']:>9.1f}   file {_gb(r['gguf_bytes'])}, peak RSS {_gb(r['peak_rss_bytes'])}")
        elif key.startswith("convert"):
            lines.append(f"{key:<34} {r['seconds']:>9.1f}   directory {_gb(r['dir_bytes'])}, peak RSS "
                         f"{_gb(r['peak_rss_bytes'])}")
        elif key == "verify":
            lines.append(f"{key:<34} {r['seconds']:>9.1f}   peak RSS {_gb(r['peak_rss_bytes'])}; "
                         f"{r['exact']}/{r['checked']} exact")
        else:
            lines.append(f"{key:<34} {r['load_seconds']:>9.1f}   resident {_gb(r['resident_bytes'])}, load peak "
                         f"{_gb(r['load_peak_rss_bytes'])}")
            if "prefill_seconds" in r:
                lines.append(f"{'  prefill ' + str(r['prefill_tokens']) + ' tokens':<34} {r['prefill_seconds']:>9.1f}   "
                             f"peak RSS {_gb(r['prefill_peak_rss_bytes'])}")
            if "stopped" in r:
                lines.append(f"{'  then':<34} {'':>9}   {r['stopped']}")
            if "step_seconds" in r:
                lines.append(f"{'  step, canvas ' + str(r['canvas']):<34} {r['step_seconds']:>9.1f}   peak RSS "
                             f"{_gb(r['step_peak_rss_bytes'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from mlx_dgemma.bench.report import machine
    from mlx_dgemma.precision import PRECISIONS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, help="where the GGUF, the directory and the results go (~40 GB)")
    p.add_argument("--header", default=str(HEADER), help="the published header JSON")
    p.add_argument("--precisions", default=",".join(x for x in PRECISIONS if x != "auto"),
                   help="comma-separated; measured in the order given (smallest first is safest)")
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--canvas", type=int, default=32, help="canvas of the denoising step (256 on a GPU)")
    p.add_argument("--min-free-gb", type=float, default=4.0,
                   help="keep at least this much of the machine's memory available (watchdog and gate)")
    p.add_argument("--child-timeout", type=float, default=7200.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None,
                   help="keep only the first N transformer blocks (and everything outside them, at full size): "
                        "the real shapes in less disk (default: all of them)")
    for s in ("write", "convert", "verify", "load-dir", "load-gguf", "step"):
        p.add_argument(f"--skip-{s}", action="store_true")
    p.add_argument("--tier-layout-only", action="store_true",
                   help="write each memory tier's directory with random values in its exact layout instead of "
                        "running the re-quantizer (hours at full size on a slow CPU); sizes, load, memory and "
                        "speed are the tier's")
    p.add_argument("--results", default="full_size.json",
                   help="results file in the workdir (two runs at once: give each its own)")
    p.add_argument("--redo", action="store_true", help="measure again what the results file already has")
    a = p.parse_args(argv)
    if a.layers is not None:
        try:
            first_layers(load_header(a.header), a.layers)
        except ValueError as e:
            p.error(str(e))
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:  # the children import this file as `full_size` (spawn copies sys.path)
        sys.path.insert(0, here)
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    sub = "" if a.layers is None else f"-{a.layers}layers"  # an N-layer run's files are its own
    gguf, out, res_file = work / gguf_name(a.layers), work / f"converted{sub}", work / a.results

    def tier_dir(prec: str) -> Path:
        return work / f"converted{sub}-{prec}"

    result = json.loads(res_file.read_text()) if res_file.is_file() else {"rows": {}, "layers": a.layers}
    if result.get("layers") != a.layers:  # a results file from before --layers: the whole model
        def run(n: int | None) -> str:
            return "all layers" if n is None else f"--layers {n}"

        p.error(f"--results: {res_file} holds a run of {run(result.get('layers'))}, this one is of {run(a.layers)}; "
                "give this run its own --results")
    result["machine"] = {**machine(), "memory_bytes": total_bytes()}
    rows = result["rows"]
    floor = int(a.min_free_gb * GB)
    kw = dict(results=rows, redo=a.redo, floor=floor, timeout=a.child_timeout)
    # writing and converting stream (well under 2 GB): a lower floor, so that another process's
    # short peak does not stop an hour's conversion
    stream = {**kw, "floor": min(floor, int(2 * GB)), "redo": True}

    def save() -> None:
        res_file.write_text(json.dumps(result, indent=2) + "\n")

    try:
        if not a.skip_write and (a.redo or not gguf.is_file()):
            _run("measure_write", key="write", gguf=str(gguf), header=a.header, seed=a.seed, layers=a.layers,
                 **stream)
            save()
        if not a.skip_convert and (a.redo or not out.is_dir()):
            _run("measure_convert", key="convert", gguf=str(gguf), out=str(out), **stream)
            save()
        if not a.skip_verify:
            _run("measure_verify", key="verify", out=str(out), gguf=str(gguf), **kw)
            save()
        precisions = [x for x in a.precisions.split(",") if x]
        tiers = on_disk_tiers()
        for prec in precisions:
            if prec in tiers and not a.skip_convert and (a.redo or not tier_dir(prec).is_dir()):
                if a.tier_layout_only:
                    _run("measure_tier_layout", key=f"convert {prec} (layout only)", gguf=str(gguf),
                         out=str(tier_dir(prec)), precision=prec, **stream)
                else:
                    _run("measure_convert", key=f"convert {prec}", gguf=str(gguf), out=str(tier_dir(prec)),
                         precision=prec, **stream)
                save()
            own = tier_dir(prec) if prec in tiers else out  # a tier loads from its own directory
            for kind, path, skip in (("dir", own, a.skip_load_dir), ("gguf", gguf, a.skip_load_gguf)):
                if skip:
                    continue
                key = f"load {kind} {prec}"
                need = estimate_load_peak(tier_dir(prec) if prec in tiers else out, out)
                avail = available_bytes()
                if (key not in rows or a.redo or "skipped" in rows[key]) and avail - need < floor:
                    rows[key] = {"impl": key, "skipped": f"needs ~{need / GB:.1f} GB (estimated load peak) of "
                                 f"{total_bytes() / GB:.0f}; {avail / GB:.1f} GB available, {a.min_free_gb:g} GB "
                                 "kept free for the rest of the machine"}
                    save()
                    continue
                step = kind == "dir" and not a.skip_step
                part = work / f".partial-{key.replace(' ', '-')}.json"
                part.unlink(missing_ok=True)
                res = _run("measure_load", key=key, path=str(path), precision=prec,
                           prefill_tokens=a.prefill_tokens if step else 0, canvas=a.canvas if step else 0,
                           partial=str(part), **kw)
                if "skipped" in res and part.is_file():  # stopped part-way: keep the phases it finished
                    rows[key] = {**json.loads(part.read_text()), "impl": key,
                                 "stopped": res["skipped"], "wall_seconds": res["wall_seconds"]}
                part.unlink(missing_ok=True)
                save()
    except KeyboardInterrupt:
        print("interrupted: keeping what finished", file=sys.stderr)
    finally:
        save()
    print(table(result))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
