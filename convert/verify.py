"""``mlx-dgemma verify OUT_DIR MODEL.gguf``: every dequantized weight against gguf-py.

The reference is ``gguf.quants.dequantize`` of the original blocks; ours is what MLX's
``mx.dequantize`` gives from the stored arrays (scales upcast to float32, sub-block padding
dropped). Values are compared as float32, row chunk by row chunk, so memory stays bounded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np
from gguf.quants import dequantize as gguf_dequantize

from mlx_dgemma.errors import ModelFilesError
from mlx_dgemma.paths import EMPTY, empty_path, input_problem, user_path
from mlx_dgemma.schema import ModelArgs, QuantSpec, unpad_subblocks
from mlx_dgemma.sidecar import SIDECAR_FILE, fast_rule, fast_todo, file_digest, requantize_slices
from mlx_dgemma.tiers import stored_precision
from mlx_dgemma.validate import check_model_dir, model_dir_shards, short_repr

from .errors import ConvertError
from .metadata import ARCH
from .names import mlx_name, module_path, stored_names
from .source import GGUFSource
from .writer import open_safetensors

_CHUNK_ELEMENTS = 1 << 22


def open_model_dir(model_dir: str | Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(config, lazily mapped weights) of a converted directory, validated first (the same
    checks ``load`` runs: config, shards listed by the index and no others, headers)."""
    given, model_dir = model_dir, user_path(model_dir)
    # missing, a file, unreadable, empty: said as such
    problem = EMPTY if empty_path(given) else input_problem(model_dir, want_dir=True)
    if problem is not None:
        raise ConvertError(f"{repr(str(given)) if problem == EMPTY else model_dir}: {problem}; give the directory "
                           "written by mlx-dgemma convert")
    config = check_model_dir(model_dir)  # names config.json when it is missing or not a file
    weights: dict[str, np.ndarray] = {}
    for f in model_dir_shards(model_dir):
        weights.update(open_safetensors(f))
    return config, weights


_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "num_global_key_value_heads", "head_dim", "global_head_dim",
               "vocab_size", "num_experts", "top_k_experts", "moe_intermediate_size", "layer_types")


def check_same_model(config: dict, gguf_cfg: ModelArgs, model_dir: Path, gguf_path: Path) -> None:
    """The directory was converted from a model of this GGUF's architecture and shapes."""
    ours, theirs = config.get("text_config", {}), gguf_cfg.to_dict()
    for k in _SHAPE_KEYS:
        if ours.get(k) != theirs.get(k):
            raise ConvertError(f"{model_dir}: converted from a different model than {gguf_path} (text_config.{k} "
                               f"is {short_repr(ours.get(k), 40)} here, {short_repr(theirs.get(k), 40)} in the "
                               "GGUF); verify against the GGUF it was converted from")


@dataclass
class VerifyReport:
    checked: int = 0
    exact: int = 0
    mismatches: list[str] = field(default_factory=list)
    # lossy directories: per lossy tensor, its measured max |stored - exact| and relative RMS
    max_abs_error: dict[str, float] = field(default_factory=dict)
    rel_rms_error: dict[str, float] = field(default_factory=dict)
    # the form of the directory's weights (config.json mlx_dgemma.weights): a lossy one is
    # checked against what its precision's re-quantizer gives for this GGUF, recomputed here
    # (nothing the directory says about its own errors is trusted)
    precision: str = "exact"

    @property
    def ok(self) -> bool:
        return not self.mismatches and self.checked > 0

    @property
    def lossy(self) -> bool:
        return self.precision != "exact"

    def bound_summary(self) -> str:
        """One line for every lossy tensor together: how many, and the worst measured error
        against the GGUF's exact values (a real model has hundreds; one line each would bury
        the verdict). The per-tensor figures stay in the report (``max_abs_error``,
        ``rel_rms_error``), and the converter writes them to its conversion_report.json."""
        worst_abs = max(self.max_abs_error, key=self.max_abs_error.__getitem__)
        worst_rel = max(self.rel_rms_error, key=self.rel_rms_error.__getitem__, default=worst_abs)
        return (f"  {len(self.max_abs_error)} lossy tensors: worst max |{self.precision} - exact| "
                f"{self.max_abs_error[worst_abs]:.3g} ({worst_abs}), worst relative RMS "
                f"{self.rel_rms_error.get(worst_rel, 0.0):.3g} ({worst_rel})")


def _mlx_dequant(w: np.ndarray, s: np.ndarray, b: np.ndarray, spec: QuantSpec) -> np.ndarray:
    out = mx.dequantize(mx.array(np.ascontiguousarray(w)), mx.array(np.asarray(s, np.float32)),
                        mx.array(np.asarray(b, np.float32)), group_size=spec.group_size, bits=spec.bits)
    return unpad_subblocks(np.array(out), spec.subblock)


def _differences(got: np.ndarray, ref: np.ndarray) -> tuple[int, int, int, float]:
    """(values that differ, NaN here but not in the GGUF, NaN in the GGUF but not here, max abs
    error over the differing values that are not NaN); NaN on both sides counts as equal.
    No NumPy warning: the max is taken over the numbers only."""
    got_nan, ref_nan = np.isnan(got), np.isnan(ref)
    neq = ~((got == ref) | (got_nan & ref_nan))
    if not neq.any():
        return 0, 0, 0, 0.0
    nan_here, nan_gguf = got_nan & ~ref_nan, ref_nan & ~got_nan
    numbers = neq & ~nan_here & ~nan_gguf
    with np.errstate(invalid="ignore", over="ignore"):  # Inf - Inf of opposite signs is Inf, not a warning
        err = float(np.abs(got[numbers] - ref[numbers]).max()) if numbers.any() else 0.0
    return int(neq.sum()), int(nan_here.sum()), int(nan_gguf.sum()), err


def _nan_text(nan_here: int, nan_gguf: int) -> str:
    parts = ([f"{nan_here} NaN here where the GGUF has a number"] if nan_here else []) + \
            ([f"{nan_gguf} NaN in the GGUF where this directory has a number"] if nan_gguf else [])
    return ", ".join(parts)


def verify(model_dir: str | Path, gguf_path: str | Path,
           progress: Callable[[int, int, str], None] | None = None) -> VerifyReport:
    """Compare every tensor of ``model_dir`` with the GGUF it was converted from."""
    config, weights = open_model_dir(model_dir)
    with GGUFSource(gguf_path, ARCH) as source:  # architecture, tensor names and shapes first
        check_same_model(config, source.args, user_path(model_dir), source.path)
        stored = stored_precision(config)
        if stored != "exact":
            return _compare_lossy(stored, weights, source, model_dir, progress)
        report = _compare(config, weights, source, model_dir, progress)
    report.mismatches += compare_fast_sidecar(config, weights, user_path(model_dir))
    return report


def compare_fast_sidecar(config: dict, weights: dict[str, np.ndarray], model_dir: Path) -> list[str]:
    """An exact directory's fast sidecar (:mod:`mlx_dgemma.sidecar`) against what the loader
    would compute from the directory's exact arrays (checked against the GGUF by :func:`verify`):
    recomputed by the same pass, compared bit for bit, slice by slice (memory stays bounded),
    with the checksum and record that the loader trusts. The problems found, one line each,
    naming the file; none when the directory has no sidecar (never written, or deleted to save
    disk: the loader then re-quantizes, as it did before sidecars)."""
    f = model_dir / SIDECAR_FILE
    record = (config.get("mlx_dgemma") or {}).get("fast_sidecar")
    if not f.exists() and not f.is_symlink():  # deleted to save disk: loading fast re-quantizes, as before
        return []
    again = "delete it (loading fast then re-quantizes) or convert the model again"
    if not f.is_file():
        return [f"{f}: not a file; {again}"]
    if not isinstance(record, dict):
        return [f"{f}: config.json's mlx_dgemma.fast_sidecar does not describe it (the loader ignores the file); "
                f"{again}"]
    if record.get("rule") != fast_rule():
        return [f"{f}: made by another version of fast's re-quantizer ({short_repr(record.get('rule'), 80)}, this "
                f"one is {short_repr(fast_rule(), 80)}), so the loader re-quantizes instead; convert the model again"]
    try:
        stored = open_safetensors(f)
    except (ModelFilesError, ConvertError) as e:
        return [f"{e}"]
    todo = fast_todo(config["quantization"], config["text_config"]["num_hidden_layers"], weights)
    bad = []
    names = {f"{t.path}.{k}" for t in todo for k in ("weight", "scales", "biases")}
    if set(stored) != names or set(record.get("tensors") or {}) != {t.path for t in todo}:
        return [f"{f}: holds {sorted(stored)[:6]}, fast re-quantizes {sorted(names)[:6]} here; {again}"]
    differ: dict[str, int] = {}
    for k, i, r in requantize_slices(todo):
        path = todo[k].path
        for key, want in zip(("weight", "scales", "biases"), (r.weight, r.scales, r.biases)):
            got = stored[f"{path}.{key}"]
            part = got[i:i + len(want)]
            if part.shape != want.shape or part.dtype != want.dtype:
                differ[f"{path}.{key}"] = differ.get(f"{path}.{key}", 0) + want.size
            else:
                differ[f"{path}.{key}"] = differ.get(f"{path}.{key}", 0) + int(np.count_nonzero(part != want))
    bad += [f"{f}: {name}: {n} values differ from fast's re-quantization of the exact weights; {again}"
            for name, n in differ.items() if n]
    if file_digest(f) != record.get("sha256"):
        bad.append(f"{f}: its checksum does not match config.json's mlx_dgemma.fast_sidecar.sha256 (the loader "
                   f"will not use it); {again}")
    return bad


def _compare_lossy(precision: str, weights: dict[str, np.ndarray], source: GGUFSource, model_dir: str | Path,
                   progress: Callable[[int, int, str], None] | None) -> VerifyReport:
    """A lossy directory: every stored array must be what ``convert --precision PRECISION`` gives
    for this GGUF (the re-quantizer is deterministic NumPy), recomputed here from the GGUF's
    blocks, and each lossy tensor's error is measured against the GGUF's exact values. The
    directory's own conversion_report.json is never read: a forged bound cannot pass."""
    report = VerifyReport(precision=precision)
    n = len(source.reader.tensors)
    seen: set[str] = set()
    for i, c in enumerate(source.tensors(precision)):
        bad = []
        for name, want in c.arrays.items():
            seen.add(name)
            got = weights.get(name)
            want = np.asarray(want)
            if got is None:
                bad.append(f"{name} missing from {model_dir}")
            elif got.shape != want.shape or got.dtype != want.dtype:
                bad.append(f"{name} stored as {got.dtype}{list(got.shape)}, {precision} gives "
                           f"{want.dtype}{list(want.shape)}")
            elif not np.array_equal(got, want):
                differ = int(np.count_nonzero(got != want))
                bad.append(f"{name}: {differ} of {want.size} stored values differ from what --precision "
                           f"{precision} gives for this GGUF")
        report.checked += 1
        if bad:
            report.mismatches.append(f"{c.gguf_name}: " + "; ".join(bad) + f" (its {precision} bound: max "
                                     f"|{precision} - exact| {c.max_abs_error:.3g})")
        elif c.max_abs_error > 0:
            report.max_abs_error[c.gguf_name] = c.max_abs_error
            report.rel_rms_error[c.gguf_name] = c.rel_rms_error
        else:
            report.exact += 1
        if progress:
            progress(i + 1, n, c.gguf_name)
    report.mismatches += [f"{k}: stored in {model_dir} but not in the GGUF" for k in sorted(set(weights) - seen)]
    return report


def _compare(config: dict, weights: dict[str, np.ndarray], source: GGUFSource, model_dir: str | Path,
             progress: Callable[[int, int, str], None] | None) -> VerifyReport:
    quant = config.get("quantization", {})
    report = VerifyReport()
    tensors = list(source.reader.tensors)
    for i, t in enumerate(tensors):
        path = mlx_name(t.name)
        if path is None:
            report.mismatches.append(f"{t.name}: not a DiffusionGemma tensor")
            continue
        base = module_path(path)
        spec = QuantSpec.from_dict(quant[base]) if isinstance(quant.get(base), dict) else None
        shape = tuple(int(x) for x in reversed(t.shape))
        raw = np.asarray(t.data)
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        width = shape[-1]
        try:
            if spec is None:
                ours = weights[path].reshape(rows, width)
            else:
                w, s, b = (weights[n].reshape(rows, -1) for n in stored_names(path, quantized=True))
        except KeyError as e:
            report.mismatches.append(f"{t.name}: {e.args[0]} missing from {model_dir}")
            continue
        except ValueError:
            report.mismatches.append(f"{t.name}: stored shape does not match GGUF shape {list(shape)}")
            continue
        raw2 = raw.reshape(rows, -1)
        step = max(1, _CHUNK_ELEMENTS // width)
        bad, err, nan_here, nan_gguf = 0, 0.0, 0, 0
        for r0 in range(0, rows, step):
            ref = gguf_dequantize(raw2[r0:r0 + step], t.tensor_type).reshape(-1, width)
            if spec is None:
                got = np.asarray(ours[r0:r0 + step])
                got = (got.astype(np.uint32) << 16).view(np.float32) if got.dtype == np.uint16 \
                    else got.astype(np.float32)
            else:
                got = _mlx_dequant(w[r0:r0 + step], s[r0:r0 + step], b[r0:r0 + step], spec)
            d = _differences(got, ref)
            bad, err = bad + d[0], max(err, d[3])
            nan_here, nan_gguf = nan_here + d[1], nan_gguf + d[2]
        report.checked += 1
        if bad:
            report.max_abs_error[t.name] = err
            if nan_here or nan_gguf:  # NaN is never an error of 0
                report.max_abs_error[t.name] = float("nan")
                others = bad - nan_here - nan_gguf
                report.mismatches.append(f"{t.name}: {bad} of {rows * width} values differ "
                                         f"({_nan_text(nan_here, nan_gguf)}"
                                         f"{f'; max abs error of the other {others} {err:.3g}' if others else ''})")
            else:
                report.mismatches.append(f"{t.name}: {bad} of {rows * width} values differ "
                                         f"(max abs error {err:.3g})")
        else:
            report.exact += 1
        if progress:
            progress(i + 1, len(tensors), t.name)
    stored = {k.rsplit(".", 1)[0] if k.endswith((".scales", ".biases")) else k for k in weights}
    expected = {mlx_name(t.name) for t in tensors}
    expected |= {module_path(p) for p in expected}
    extra = sorted(k for k in stored if k not in expected)
    report.mismatches += [f"{k}: stored in {model_dir} but not in the GGUF" for k in extra]
    return report
