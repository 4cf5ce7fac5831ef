"""fast's re-quantized tensors, persisted beside an exact directory, and the pass over stored
weights that computes them (the loader's runtime re-quantization too: one code path).

Loading ``fast`` from an exact directory re-quantizes the padded sub-block tensors (Q2_K, Q3_K,
Q6_K: at full size the 262,144 x 2816 embedding/head and some ``attn_v``) to 8-bit groups; at
the published shapes that cost a fixed ~7 s at every start. ``convert`` (exact) therefore also
writes those tensors' fast form once, to :data:`SIDECAR_FILE`, computed by
:func:`requantize_tensors` from the exact arrays it has just written: the same function, on the
same arrays, as the loader's fallback, so the same bytes. The exact shards are untouched (the
converter's promise). config.json's ``mlx_dgemma.fast_sidecar`` records what the file holds:
the file, the rule that made it (:func:`fast_rule`: a version and fast's parameters), each
tensor's target, and a checksum of the file (:func:`file_digest`).

The loader uses the file only when that record matches this code's rule, the tensors it would
re-quantize, and the file's checksum (checked at every load: a corrupted file is never used;
the load falls back to re-quantizing, with one warning). ``verify`` recomputes the file from the
directory's exact arrays and compares it bit for bit. NumPy only: the converter imports no MLX.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .schema import QuantSpec
from .tiers import FAST_BITS, FAST_GROUP, PADDED_TYPES, PAIR_COARSER, PAIRED_TYPES, Requantized, Target, \
    ordered_map, requantize_stored, target

SIDECAR_FILE = "fast-requantized.safetensors"
# Bumped whenever fast's re-quantized numbers change for the same exact input (its rule, its
# code): a directory converted before then falls back to re-quantizing at load.
SIDECAR_VERSION = 1
# the checksum reads the file in pieces of this many bytes, hashed on threads (hashlib
# releases the GIL): one sha256 stream runs ~0.5 GB/s on a slow core, the full-size file is ~0.8 GB
_DIGEST_PIECE = 1 << 26


def fast_rule() -> dict[str, Any]:
    """What makes fast's re-quantized numbers: recorded with the file, compared at load."""
    return {"version": SIDECAR_VERSION, "bits": FAST_BITS, "group_size": FAST_GROUP,
            "pair_coarser": PAIR_COARSER, "padded_types": list(PADDED_TYPES), "paired_types": list(PAIRED_TYPES)}


def goal_for(precision: str, path: str, spec: QuantSpec | None, bits: int, group_size: int, subblock: int,
             packed_cols: int, num_layers: int) -> Target | None:
    """What ``precision`` makes of the quantized weight at ``path`` (stored with ``bits``,
    ``group_size``, ``subblock``, rows of ``packed_cols`` uint32 words; ``spec``: its
    config.json entry), or None when it keeps it as stored (no recipe, or already that form)."""
    if spec is not None and spec.ggml_type:
        width = packed_cols * 32 // bits // (2 if subblock == 16 else 1)
        goal = target(precision, path, spec.ggml_type, num_layers, width)
    else:  # no ggml type recorded: only fast's rule can be applied (padded sub-blocks are its trigger)
        goal = Target(FAST_BITS, FAST_GROUP) if precision == "fast" and subblock == 16 else None
    if goal is None or (bits, group_size, subblock) == (goal.bits, goal.group_size, 32):
        return None
    return goal


@dataclass
class StoredWeight:
    """One quantized weight as stored and its goal: arrays that give NumPy arrays when sliced
    along their leading axis (views of the loader's arrays, or a converted file's rows read
    on demand); bfloat16 scales as float32 or as raw uint16 (cast slice by slice)."""

    path: str
    weight: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int
    group_size: int
    subblock: int
    goal: Target


def requantize_slices(todo: list[StoredWeight]) -> Iterator[tuple[int, int, Requantized]]:
    """Each weight of ``todo`` -> its goal's stored form, through the one re-quantizer
    (:func:`mlx_dgemma.tiers.requantize_stored`), a slice of its leading axis (experts or rows)
    at a time: yields (index in ``todo``, first row, the slice's arrays), in ``todo``'s order
    and each weight's rows in order. All slices share one pool of threads (small tensors are
    done beside large ones); the float temporaries alive at once are a few slices', not a
    tensor's (the real embedding is 3 GB in float32). Each group's numbers depend on that group
    alone: the slicing changes no value. An :class:`OverflowError` names the weight."""
    jobs: list[tuple[int, int, int]] = []  # (weight, first row, rows)
    for k, t in enumerate(todo):
        jobs += [(k, i, _step(t)) for i in range(0, t.weight.shape[0], _step(t))]

    def run(job: tuple[int, int, int]) -> Requantized:
        k, i, n = job
        t = todo[k]
        try:
            return requantize_stored(t.weight[i:i + n], _float(t.scales[i:i + n]), _float(t.biases[i:i + n]), t.bits,
                                     t.group_size, t.subblock, t.goal)
        except OverflowError as e:
            raise OverflowError(f"{t.path}.weight: {e}") from None

    for (k, i, _), r in zip(jobs, ordered_map(run, jobs)):
        yield k, i, r


def requantize_tensors(todo: list[StoredWeight | None]) -> Iterator[tuple[int, tuple[np.ndarray, ...]]]:
    """:func:`requantize_slices` assembled: yields (index, (weight, scales, biases)) in
    ``todo``'s order as each weight's last slice is done, and drops ``todo[index]`` then (its
    views released: the loader frees an exact weight as soon as its new form is in place)."""
    left = Counter(k for k, t in enumerate(todo) for _ in range(0, t.weight.shape[0], _step(t)))
    out: list[np.ndarray] = []
    for k, i, r in requantize_slices(todo):
        arrays = (r.weight, r.scales, r.biases)
        if not out:
            lead = todo[k].weight.shape[0]
            out = [np.empty((lead, *a.shape[1:]), dtype=a.dtype) for a in arrays]
        for o, a in zip(out, arrays):
            o[i:i + len(a)] = a
        left[k] -= 1
        if not left[k]:
            todo[k] = None
            done, out = tuple(out), []
            yield k, done


def _step(t: StoredWeight) -> int:
    """Rows of ``t`` a slice holds: ~1 M weights."""
    return max(1, (1 << 20) // max(1, int(np.prod(t.weight.shape[1:])) * 32 // t.bits))


def fast_todo(quantization: dict, num_layers: int, arrays: dict[str, np.ndarray]) -> list[StoredWeight]:
    """The weights fast re-quantizes in an exact directory (config.json's ``quantization``,
    ``arrays``: its stored arrays by name, sliceable as :class:`StoredWeight` says), in name order."""
    todo = []
    for path, v in sorted(quantization.items()):
        if not isinstance(v, dict) or f"{path}.weight" not in arrays:
            continue
        spec = QuantSpec.from_dict(v)
        w = arrays[f"{path}.weight"]
        goal = goal_for("fast", path, spec, spec.bits, spec.group_size, spec.subblock, w.shape[-1], num_layers)
        if goal is not None:
            s, b = (arrays[f"{path}.{n}"] for n in ("scales", "biases"))
            todo.append(StoredWeight(path, w, s, b, spec.bits, spec.group_size, spec.subblock, goal))
    return todo


def _float(a: np.ndarray) -> np.ndarray:
    """Stored scales as the loader hands them to NumPy: bfloat16 (raw uint16) as float32."""
    return (a.astype(np.uint32) << 16).view(np.float32) if a.dtype == np.uint16 else a


def sidecar_record(todo: list[StoredWeight], digest: str) -> dict[str, Any]:
    """config.json's ``mlx_dgemma.fast_sidecar`` for a file holding ``todo``'s fast form."""
    return {"file": SIDECAR_FILE, "rule": fast_rule(), "sha256": digest,
            "tensors": {t.path: [t.goal.bits, t.goal.group_size] for t in todo}}


def file_digest(path: Path) -> str:
    """sha256 of the sha256 digests of ``path``'s pieces of :data:`_DIGEST_PIECE` bytes (the
    pieces hashed on threads)."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        def piece(at: int) -> bytes:
            return hashlib.sha256(os.pread(fd, _DIGEST_PIECE, at)).digest()

        top = hashlib.sha256()
        for d in ordered_map(piece, range(0, size, _DIGEST_PIECE)):
            top.update(d)
    finally:
        os.close(fd)
    return top.hexdigest()


def recorded(model_dir: Path, config: dict) -> bool:
    """``model_dir``'s config.json records a sidecar of this code's rule and the file is there
    (its checksum is :func:`usable_sidecar`'s to check, when loading)."""
    section = config.get("mlx_dgemma") if isinstance(config, dict) else None
    record = section.get("fast_sidecar") if isinstance(section, dict) else None
    return isinstance(record, dict) and record.get("file") == SIDECAR_FILE and record.get("rule") == fast_rule() \
        and (model_dir / SIDECAR_FILE).is_file()


def usable_sidecar(model_dir: Path, config: dict, wanted: dict[str, Target]) -> tuple[Path | None, str | None]:
    """(the sidecar file of ``model_dir``, None) if config.json records it for this code's rule,
    it holds every weight of ``wanted`` (path -> goal) with that goal, and its checksum matches
    (the whole file is read); else (None, None) when it is absent, older or of another rule
    (re-quantize, nothing to say), or (None, why) when it is recorded but its bytes are not the
    recorded ones (never used: damaged or changed)."""
    f = model_dir / SIDECAR_FILE
    if not recorded(model_dir, config):
        return None, None
    record = config["mlx_dgemma"]["fast_sidecar"]
    tensors = record.get("tensors")
    if not isinstance(tensors, dict) or any(tensors.get(p) != [g.bits, g.group_size] for p, g in wanted.items()):
        return None, None
    if file_digest(f) != record.get("sha256"):
        return None, (f"{f}: its checksum does not match config.json's mlx_dgemma.fast_sidecar (the file is "
                      "damaged or was changed), so it is not used: re-quantizing instead; `mlx-dgemma verify` "
                      "checks it, and deleting it or converting the model again ends this")
    return f, None
