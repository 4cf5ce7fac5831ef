"""``mlx-dgemma convert``: a DiffusionGemma GGUF -> an MLX model directory.

The GGUF is converted tensor by tensor, and each tensor is read, repacked and written in row
chunks, so peak memory is a chunk plus one tensor's scales (1.21 GB RSS in all for the
published 16.8 GB model, measured), not a tensor nor the model.
Output goes to a hidden temporary directory beside OUT_DIR and is renamed at the end:
an interrupted or failed conversion never leaves a directory that looks like a model.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path
from typing import Callable

import numpy as np

from mlx_dgemma.errors import terminate_as_interrupt
from mlx_dgemma.memory import gb  # its estimates import no MLX (the converter never does)
from mlx_dgemma.paths import output_clash, user_path
from mlx_dgemma.plan import Budget, make_plan, offline_budget
from mlx_dgemma.rss import peak_rss_bytes
from mlx_dgemma.schema import QuantSpec
from mlx_dgemma.sidecar import SIDECAR_FILE, fast_todo, file_digest, requantize_slices, sidecar_record
from mlx_dgemma.tiers import PADDED_TYPES, TIERS, TensorInfo, target, tensor_bytes, tier
from mlx_dgemma.validate import check_tokenizer_data, model_dir_shards

from .errors import ConvertError
from .metadata import ARCH
from .source import GGUFSource, Progress, check_input_file
from .tensors import Converted, Part
from .writer import ShardWriter, finalize_shard_names, header_reserve, open_safetensors, write_index

DEFAULT_SHARD_BYTES = 5 * 10**9
TOKENIZER_FILE = "tokenizer_gguf.json"


@dataclass
class TypeStats:
    tensors: int = 0
    elements: int = 0
    gguf_bytes: int = 0
    mlx_bytes: int = 0

    @property
    def gguf_bpw(self) -> float:
        return 8 * self.gguf_bytes / max(1, self.elements)

    @property
    def mlx_bpw(self) -> float:
        return 8 * self.mlx_bytes / max(1, self.elements)


@dataclass
class ConvertReport:
    """What a conversion did: sizes, bits per weight per ggml type, errors (lossy precisions), time."""

    source: Path
    output: Path
    precision: str = "exact"
    seconds: float = 0.0
    input_bytes: int = 0
    output_bytes: int = 0
    tensors: int = 0
    peak_rss_bytes: int = 0
    by_type: dict[str, TypeStats] = field(default_factory=dict)
    # lossy precisions: per quantized tensor, max |stored - exact| and relative RMS (0: exact)
    max_abs_error: dict[str, float] = field(default_factory=dict)
    rel_rms_error: dict[str, float] = field(default_factory=dict)

    @property
    def lossy(self) -> bool:
        """Lossy (the former ``--compact`` is ``precision == "fast"``)."""
        return not tier(self.precision).lossless

    def summary_lines(self, errors: bool = True) -> list[str]:
        """The summary a conversion prints; ``errors=False`` leaves out the lossy tensors' error
        line (``--verify`` follows with its own, recomputed from the GGUF)."""
        row = tier(self.precision)
        mode = f"{row.name} (lossless)" if row.lossless else f"{row.name} (lossy: {row.recipe})"
        lines = [f"converted {self.tensors} tensors in {self.seconds:.1f} s [{mode}]",
                 f"  input  {self.source}  {self.input_bytes / 1e9:.3f} GB",
                 f"  output {self.output}  {self.output_bytes / 1e9:.3f} GB",
                 f"  peak memory (max RSS) {self.peak_rss_bytes / 1e9:.2f} GB",
                 "  type   tensors      weights   GGUF bpw   MLX bpw"]
        for t, s in sorted(self.by_type.items()):
            lines.append(f"  {t:<6} {s.tensors:>7} {s.elements:>12,} {s.gguf_bpw:>9.3f} {s.mlx_bpw:>9.3f}")
        if errors and self.lossy and self.max_abs_error:
            lines.append("  " + self.error_line())
        return lines

    def error_line(self) -> str:
        """How far the lossy tensors are from exact: the worst relative RMS and max error, and
        how many tensors stayed exact (their error is 0 by construction, not a measurement),
        counted over all tensors as ``verify`` counts them."""
        lossy = {k: v for k, v in self.max_abs_error.items() if v > 0}
        total = sum(s.tensors for s in self.by_type.values())
        exact = total - len(lossy)
        if not lossy:
            return f"all {total} tensors exact (nothing re-quantized)"
        worst_rel = max(lossy, key=lambda k: self.rel_rms_error.get(k, 0.0))
        worst_abs = max(lossy, key=lossy.get)
        return (f"{len(lossy)} of {total} tensors lossy, {exact} exact; largest relative RMS error "
                f"{self.rel_rms_error.get(worst_rel, 0.0):.3g} ({worst_rel}), largest max |{self.precision} - exact| "
                f"{lossy[worst_abs]:.3g} ({worst_abs}); per-tensor errors in {REPORT_FILE}")

    def to_dict(self) -> dict:
        return {"source": str(self.source), "precision": self.precision, "lossy": self.lossy,
                "seconds": self.seconds,
                "input_bytes": self.input_bytes, "output_bytes": self.output_bytes,
                "tensors": self.tensors, "peak_rss_bytes": self.peak_rss_bytes,
                "by_type": {t: {"tensors": s.tensors, "elements": s.elements, "gguf_bpw": s.gguf_bpw,
                                "mlx_bpw": s.mlx_bpw} for t, s in sorted(self.by_type.items())},
                "max_abs_error": self.max_abs_error, "rel_rms_error": self.rel_rms_error}


def estimate_output_bytes(source: GGUFSource, precision: str, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> int:
    """Bytes the output directory of ``precision`` will take, from the tensor inventory alone:
    the weights as :func:`mlx_dgemma.tiers.tensor_bytes` prices them (exact for the scale dtypes
    a GGUF normally gives), each shard's reserved safetensors header, and the side files (the
    tokenizer and chat template: at most the GGUF's metadata; index, config and report: less than
    one header), exact's fast sidecar (:func:`fast_sidecar_bytes`), plus a 1 % margin."""
    layers = source.args.num_hidden_layers
    reserve = 8 + header_reserve(source.stored_names())
    reserve += -reserve % 8
    weights, shards, offset = 0, 0, 0
    for info in source.inventory():
        n = tensor_bytes(TensorInfo(*info), precision, layers)
        if shards == 0 or (offset and offset + n > max_shard_bytes):  # as _write_shards splits
            shards, offset = shards + 1, 0
        weights, offset = weights + n, offset + n
    total = weights + shards * reserve + int(source.reader.data_offset) + reserve + 4096
    if precision == "exact":
        total += fast_sidecar_bytes([TensorInfo(*i) for i in source.inventory()], layers)
    return total + total // 100


def fast_sidecar_bytes(inventory: list[TensorInfo], num_layers: int) -> int:
    """Bytes of the fast sidecar an exact directory of ``inventory`` holds
    (:func:`write_fast_sidecar`; 0 when nothing is re-quantized): fast's form of the padded
    tensors as :func:`mlx_dgemma.tiers.tensor_bytes` prices it, and the file's header."""
    padded = [i for i in inventory if i.ggml_type in PADDED_TYPES
              and target("fast", i.module, i.ggml_type, num_layers, i.shape[-1]) is not None]
    if not padded:
        return 0
    header = 8 + header_reserve([f"{i.module}.{k}" for i in padded for k in ("weight", "scales", "biases")])
    return sum(tensor_bytes(i, "fast", num_layers) for i in padded) + header + -header % 8


def _write_side_files(tmp: Path, source: GGUFSource, cfg_json: dict) -> None:
    tok = source.tokenizer
    check_tokenizer_data(tok, f"{source.path}: tokenizer.ggml.*", cfg_json["text_config"]["vocab_size"])
    (tmp / "config.json").write_text(json.dumps(cfg_json, indent=2) + "\n")
    (tmp / "generation_config.json").write_text(json.dumps(source.generation_config, indent=2) + "\n")
    (tmp / TOKENIZER_FILE).write_text(json.dumps(tok, ensure_ascii=False))
    if source.chat_template is not None:
        (tmp / "chat_template.jinja").write_text(source.chat_template)


def convert(gguf_path: str | Path, out_dir: str | Path, *, precision: str = "exact", compact: bool = False,
            force: bool = False, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
            progress: Progress | None = None, budget: Budget | None = None,
            notice: Callable[[str], None] | None = None) -> ConvertReport:
    """Convert a DiffusionGemma GGUF into an MLX model directory in ``precision`` (exact unless
    told: ``mlx_dgemma.tiers``; ``compact=True`` is the older spelling of ``precision="fast"``),
    so a small machine never has to hold the exact form.

    ``budget`` (:class:`mlx_dgemma.plan.Budget`: a Mac preset, a memory limit, or this machine's,
    :func:`mlx_dgemma.plan.offline_budget`) is what the output must run in: before anything is
    written, ``notice`` is told (one line) when ``precision``'s form will not run there and what
    would; ``precision="auto"`` writes the most exact form that runs there (this machine's without
    a ``budget``), and refuses when none does.

    ``force`` replaces ``out_dir`` only if it is a directory an earlier conversion wrote; an
    output that is, contains or lies inside the input is always refused.
    """
    t0 = time.perf_counter()
    precision = "fast" if compact and precision == "exact" else precision
    if precision not in (*TIERS, "auto"):
        raise ConvertError(f"precision {precision!r}: must be auto or one of {', '.join(TIERS)}")
    src, out = user_path(gguf_path), user_path(out_dir)
    if not (isinstance(max_shard_bytes, int) and max_shard_bytes >= 1):
        raise ConvertError(f"max_shard_bytes = {max_shard_bytes!r}: must be a positive integer")
    check_input_file(src)
    parent = _check_output(src, out, force)
    remove_stale_partials(parent, out.name)
    source = GGUFSource(src, ARCH)
    if budget is not None or precision == "auto":
        try:
            precision = choose_form(source, precision, budget or offline_budget(), notice)
        except BaseException:
            source.close()
            raise
    need = estimate_output_bytes(source, precision, max_shard_bytes)
    tmp = parent / f"{_tmp_prefix(out.name)}.partial-{os.getpid()}"
    report = ConvertReport(src, out, precision, input_bytes=src.stat().st_size)
    created = [p for p in (parent, *parent.parents) if not p.exists()]  # like mkdir -p; undone on failure
    try:
        with source, terminate_as_interrupt():
            parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            free = shutil.disk_usage(parent).free
            if free < need:
                raise ConvertError(f"{parent}: not enough disk space ({free / 1e9:.2f} GB free, the output "
                                   f"needs {need / 1e9:.2f} GB in {precision}); free some space or choose another disk")
            specs = _write_shards(source, tmp, precision, max_shard_bytes, progress, report)
            cfg_json = source.config(specs, precision)
            if precision == "exact":  # what loading it as fast would re-quantize at every start, once
                record = write_fast_sidecar(tmp, cfg_json)
                if record is not None:
                    cfg_json["mlx_dgemma"]["fast_sidecar"] = record
            _write_side_files(tmp, source, cfg_json)
            source.check_unchanged()
            report.seconds = time.perf_counter() - t0
            report.output_bytes = sum(p.stat().st_size for p in tmp.iterdir())
            report.peak_rss_bytes = peak_rss_bytes()
            (tmp / REPORT_FILE).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
            _swap_into_place(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        if e.errno == errno.ENOSPC:
            raise ConvertError(f"{parent}: no space left on device while writing the conversion "
                               f"(needs about {need / 1e9:.2f} GB); nothing was kept") from e
        raise ConvertError(f"{out}: cannot write the output ({e.strerror or e}); nothing was kept") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        raise
    return report


def choose_form(source: GGUFSource, precision: str, budget: Budget, notice: Callable[[str], None] | None) -> str:
    """The precision to write from ``source`` (a :class:`GGUFSource`: its shape and inventory):
    ``precision``, or for ``auto`` the most exact form that runs in ``budget`` (a
    :class:`ConvertError` when none does); ``notice`` is told, before anything is written, when
    the form written will not run there, and what would (the memory plan's figures,
    :mod:`mlx_dgemma.plan`)."""
    plan = make_plan(source.path.name, source.args, [TensorInfo(*t) for t in source.inventory()], "gguf",
                     budget=budget, gguf=str(source.path))
    big = max(plan.available_bytes, plan.row("exact").resident_bytes) >= 1e9

    def size(n: int) -> str:  # one unit in a line ("0.10 GB, more than 0.10 GB" said nothing)
        return gb(n) if big else f"{n / 1e6:.0f} MB"

    where = f"the {size(plan.available_bytes)} of {plan.budget}"
    if precision == "auto":
        form = plan.best_form(TIERS)
        if form is None:
            raise ConvertError(f"--precision auto: no form of {source.path.name} runs in {where}: "
                               f"{TIERS[-1]}, the smallest, needs {size(plan.row(TIERS[-1]).resident_bytes)}; "
                               "give a precision to write one anyway, or --machine NAME for the Mac it is for")
        if notice is not None:
            notice(f"--precision auto: writing {form}, the most exact form that runs in {where} "
                   f"(it needs about {size(plan.row(form).resident_bytes)})")
        return form
    need = plan.row(precision).resident_bytes
    if need > plan.available_bytes and notice is not None:
        form = plan.best_form(TIERS)
        what = (f"--precision {form} writes one that does ({size(plan.row(form).resident_bytes)}), and "
                "--precision auto picks it" if form is not None
                else f"no form does ({TIERS[-1]}, the smallest, needs {size(plan.row(TIERS[-1]).resident_bytes)})")
        notice(f"note: the {precision} form needs about {size(need)} to run, more than {where}: it will not "
               f"run there; {what} (writing {precision} as asked; Ctrl+C stops before anything is kept)")
    return precision


def _remove_empty(dirs: list[Path]) -> None:
    """Remove the parent directories a failed conversion created (deepest first), if empty."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            break


REPORT_FILE = "conversion_report.json"


def _check_output(src: Path, out: Path, force: bool) -> Path:
    """Refuse outputs that would overwrite the input or anything we did not write; returns the
    (resolved) parent directory the output goes in."""
    clash = output_clash(out, [src])  # the rule every command's outputs follow (symlinks, hard links)
    if clash is not None:
        raise ConvertError(f"{out}: {clash}; choose a new directory for the output")
    out_r = out.resolve()
    name_max = 255
    try:
        name_max = os.pathconf(out_r.parent, "PC_NAME_MAX") if out_r.parent.is_dir() else 255
    except (OSError, ValueError):
        pass
    if len(os.fsencode(out.name)) > name_max:
        raise ConvertError(f"{out.name[:40]}...: output name too long ({len(os.fsencode(out.name))} bytes; "
                           f"this file system allows {name_max}); choose a shorter name")
    if out.is_symlink() or out.exists():
        if not out.is_symlink() and out.is_dir() and not _entries(out):
            pass  # made beforehand (mkdir ~/models/dgemma): an empty directory holds nothing to lose
        elif not force:
            raise ConvertError(f"{out}: output directory already exists; choose another path or pass "
                               "--force to replace it")
        elif out.is_symlink() or not out.is_dir():
            raise ConvertError(f"{out}: exists and is not a directory; --force only replaces a directory "
                               "written by mlx-dgemma convert, remove it yourself if it should go")
        elif not is_converted_dir(out):
            raise ConvertError(f"{out}: exists and was not written by mlx-dgemma convert (no "
                               f"{REPORT_FILE}); --force only replaces our own output, choose another path")
        else:
            foreign = [n for n in _entries(out) if not _ours(out / n)]
            if foreign:  # --force replaces the whole directory: a user's file put in it would go too
                shown = ", ".join(sorted(foreign)[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
                raise ConvertError(f"{out}: also holds {shown}, which mlx-dgemma convert did not write; --force "
                                   "replaces the whole directory: move them out first, or choose another path")
    parent = out_r.parent
    existing = next(p for p in (parent, *parent.parents) if p.exists())  # missing parents are created
    if not existing.is_dir():
        raise ConvertError(f"{existing}: not a directory, so the output {out} cannot be created there; "
                           "choose another output path")
    return parent


# What a conversion writes into its directory (shards: model.safetensors or model-0000i-of-0000n)
_OUR_FILES = frozenset({"config.json", "generation_config.json", "chat_template.jinja", TOKENIZER_FILE, REPORT_FILE,
                        "model.safetensors", "model.safetensors.index.json", SIDECAR_FILE})
_OUR_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# what a Mac's Finder leaves in any folder it showed: not the user's data
_FOLDER_METADATA = frozenset({".DS_Store"})


def _entries(path: Path) -> list[str]:
    """The names in directory ``path``, the file manager's own metadata left out."""
    return [n for n in os.listdir(path) if n not in _FOLDER_METADATA]


def _ours(p: Path) -> bool:
    """``p`` (in an output directory) is a file a conversion writes."""
    return p.is_file() and not p.is_symlink() and (p.name in _OUR_FILES or _OUR_SHARD.fullmatch(p.name) is not None)


def is_converted_dir(path: Path) -> bool:
    """A directory our converter wrote: its report and a config.json with our section."""
    try:
        cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    except (OSError, ValueError):
        cfg = {}
    return (path / REPORT_FILE).is_file() or (isinstance(cfg, dict) and "mlx_dgemma" in cfg)


def _tmp_prefix(name: str) -> str:
    # short enough that ".NAME.partial-PID" fits wherever NAME itself does
    return f".{name[:200]}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def remove_stale_partials(parent: Path, name: str) -> list[Path]:
    """Remove ``.NAME.partial-PID`` / ``.NAME.old-PID`` left by conversions that died (kill -9,
    power loss); a live process's temporaries are left alone."""
    removed = []
    prefix = _tmp_prefix(name)
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for p in entries:
        head, sep, pid = p.name.rpartition("-")
        if not sep or not pid.isdigit() or head not in (f"{prefix}.partial", f"{prefix}.old"):
            continue
        if int(pid) == os.getpid() or _pid_alive(int(pid)):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def _swap_into_place(tmp: Path, out: Path) -> None:
    if out.is_dir() and not out.is_symlink() and not _entries(out):
        # an empty directory made beforehand: the files move in and the directory stays (it may be
        # the current directory or a mount point, which cannot be renamed); the report last, so
        # an interrupted move never leaves what looks like a complete conversion
        moved: list[Path] = []
        try:
            for name in sorted(os.listdir(tmp), key=lambda n: n == REPORT_FILE):
                os.replace(tmp / name, out / name)
                moved.append(out / name)
        except BaseException:
            for p in moved:
                p.unlink(missing_ok=True)
            raise
        tmp.rmdir()
    elif out.exists():  # --force (checked: our own output): keep it until the new one is complete
        trash = out.parent / f"{_tmp_prefix(out.name)}.old-{os.getpid()}"
        os.replace(out, trash)
        os.replace(tmp, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, out)


def _write_shards(source: GGUFSource, tmp: Path, precision: str, max_shard_bytes: int,
                  progress: Progress | None, report: ConvertReport) -> dict[str, QuantSpec]:
    reserve = header_reserve(source.stored_names())
    files: list[Path] = []
    weight_map: dict[str, str] = {}
    specs: dict[str, QuantSpec] = {}
    shard: ShardWriter | None = None
    try:
        for c in source.tensors(precision, progress=progress):
            lo, hi = c.nbytes_range()  # the parts are streamed: their scale dtype may be known only after

            def full(n: int) -> bool:
                return shard is not None and bool(shard.offset) and shard.offset + n > max_shard_bytes

            if full(lo) != full(hi) and c.prepare is not None:  # rare: decide the dtype first (a second pass)
                c.prepare()
                lo, hi = c.nbytes_range()
            if shard is None or full(hi):
                if shard is not None:
                    shard.close()
                shard = ShardWriter(tmp / f"shard-{len(files) + 1}.tmp", reserve)
                files.append(shard.path)
            for name, part in c.parts.items():
                shard.add(name, part)
                weight_map[name] = shard.path.name
            _account(report, c)
            if c.spec is not None:
                specs[c.module] = c.spec
        if shard is not None:
            shard.close()
            shard = None
    finally:
        if shard is not None:
            shard.abort()
    finalize_shard_names(tmp, files, weight_map)
    write_index(tmp, weight_map, sum((tmp / f).stat().st_size for f in set(weight_map.values())))
    return specs


def write_fast_sidecar(model_dir: Path, config: dict) -> dict | None:
    """fast's re-quantized form of the exact directory ``model_dir``'s padded tensors, written
    beside its shards (:data:`mlx_dgemma.sidecar.SIDECAR_FILE`), from the arrays as stored, by
    the loader's own pass (the same bytes it would compute); the shards are not touched. The
    exact arrays are read and each weight streams out slice by slice (its scales and biases,
    1/16 of it, are held), so the converter's memory stays bounded. Returns config.json's record of it, or None: nothing to
    re-quantize, or a weight fast cannot hold (loading fast then says which)."""
    arrays: dict = {}
    for f in model_dir_shards(model_dir):
        arrays.update(open_safetensors(f, rows=True))  # not mapped: the pages read stay out of the RSS
    todo = fast_todo(config["quantization"], config["text_config"]["num_hidden_layers"], arrays)
    if not todo:
        return None
    path = model_dir / SIDECAR_FILE
    writer = ShardWriter(path, header_reserve([f"{t.path}.{k}" for t in todo for k in ("weight", "scales", "biases")]))
    try:
        for k, group in groupby(requantize_slices(todo), key=lambda e: e[0]):
            t, halves = todo[k], ([], [])

            def weight_slices(group=group, halves=halves):
                for _, _, r in group:
                    halves[0].append(r.scales)
                    halves[1].append(r.biases)
                    yield r.weight

            lead, n = t.weight.shape[:-1], t.weight.shape[-1] * 32 // t.bits // (2 if t.subblock == 16 else 1)
            writer.add(f"{t.path}.weight", Part((*lead, n * t.goal.bits // 32), (np.dtype(np.uint32),), weight_slices))
            writer.add(f"{t.path}.scales", np.concatenate(halves[0]))
            writer.add(f"{t.path}.biases", np.concatenate(halves[1]))
        writer.close()
    except OverflowError:
        writer.abort()
        path.unlink()
        return None
    except BaseException:
        writer.abort()
        raise
    return sidecar_record(todo, file_digest(path))


def _account(report: ConvertReport, c: Converted) -> None:
    s = report.by_type.setdefault(c.ggml_type, TypeStats())
    s.tensors += 1
    s.elements += c.n_elements
    s.gguf_bytes += c.gguf_bytes
    s.mlx_bytes += c.nbytes
    report.tensors += 1
    if report.lossy and c.spec is not None:
        report.max_abs_error[c.gguf_name] = c.max_abs_error
        report.rel_rms_error[c.gguf_name] = c.rel_rms_error
