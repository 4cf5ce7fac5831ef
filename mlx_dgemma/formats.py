"""The ggml types mlx-dgemma reads, each declared once: one :class:`GGMLType` row a type.

What every layer knows of a type is its row: the bytes the memory plan prices it at
(:func:`mlx_dgemma.tiers.tensor_bytes`), what ``fast`` does with it (:mod:`mlx_dgemma.tiers`:
padded sub-blocks re-quantized, by the pairs rule or not; 5-bit types repacked on a GPU), the
type names config.json may record (:mod:`mlx_dgemma.validate`), llama.cpp's fallback in the
synthetic Q4_K_M files (``convert/names.py``) and, through the converter's block classes that
register against a row (``convert/quants.py``, ``BlockFormat``'s ``qtype=`` as gguf-py's
quant classes), the bits and sub-block width of the exact repacking, the supported set and
the synthetic writer's ``all`` cycle.

Plain data, standard library only (the core may not import the converter or gguf-py; the plan
and tiers read it without MLX). Names are gguf-py's ``GGMLQuantizationType`` member names.

A new ggml type: its row here, and its class in ``convert/quants.py`` (the block's struct
split into MLX affine fields, and the float16 fields the synthetic writer fills);
``tests/test_formats.py`` holds that nothing else needs an edit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class GGMLType:
    """One ggml type: ``bits`` (quantized: bits per element of its exact MLX form) or
    ``float_bytes`` (a float type: bytes per element as stored), never both."""

    name: str
    bits: int = 0
    float_bytes: int = 0
    # elements sharing one scale; 16: each sub-block stored padded to a 32-element MLX group
    # (MLX's smallest), so its exact form holds twice the elements (schema.pad_subblocks)
    subblock: int = 32
    # its exact scales (K-quants: d * sc) are seldom exact in float16, so the converter keeps
    # them float32 (quants.narrowest_exact_dtype); the plan prices them at 4 bytes
    float32_scales: bool = False
    # fast re-quantizes it (padded types) from its two sub-blocks' integers (tiers.Target.pairs)
    paired: bool = False
    # fast on a GPU repacks its integers into 8-bit groups, same scales (tiers.REPACK_BITS)
    repack: bool = False
    # llama.cpp's type in its place where a row is not a multiple of the 256-element K-quant
    # super-block (the synthetic Q4_K_M files, convert/names.py)
    fallback: str | None = None

    def __post_init__(self) -> None:
        # a wrong row fails at import, not as a wrong byte count later
        if (self.bits > 0) == (self.float_bytes > 0) or self.subblock not in (16, 32) or \
                (self.paired and not self.padded) or (self.float_bytes and self.subblock != 32):
            raise ValueError(f"ggml type row {self}: give bits (quantized) or float_bytes (float), a subblock "
                             "of 16 or 32, and paired only with 16-element sub-blocks")

    @property
    def quantized(self) -> bool:
        return self.bits > 0

    @property
    def padded(self) -> bool:
        """Stored rows twice as wide: every 16-element sub-block padded to a 32-element group."""
        return self.subblock == 16


# Declaration order is the synthetic writer's ``all`` cycle (convert/synthetic.py: every type but
# F32, the other tensors' type; the test models' types depend on it): a new type goes last.
TYPES: dict[str, GGMLType] = {t.name: t for t in (
    GGMLType("F32", float_bytes=4),
    GGMLType("Q4_K", 4, float32_scales=True, fallback="Q5_0"),
    # Q6_K, Q3_K: the offset is tied to the scale (w = d * sc * (q - c)), so fast's pairs rule
    # keeps one sub-block of each group exact
    GGMLType("Q6_K", 6, subblock=16, float32_scales=True, paired=True, fallback="Q8_0"),
    GGMLType("Q8_0", 8),
    # Q5_0, Q5_1: MLX's 5-bit kernels are not its GPUs' fast path (H100, MLX 0.32.4 CUDA: gather_qmm
    # at 5 bits 1.9 TFLOP/s, at 8 bits 5.0-5.5; issue 33); llama.cpp falls back to them (Q4_K_M,
    # Q5_K_M) where a row is not a multiple of 256: the published file's 704- and 2112-wide down
    # projections, 16 of its 30 layers' experts, +1.56 GB at full size repacked
    GGMLType("Q5_0", 5, repack=True),
    # not repacked: a Q5_K_M file holds most of its weights in it, and repacked the model would
    # take nearly Q8_0's memory
    GGMLType("Q5_K", 5, float32_scales=True, fallback="Q5_1"),
    GGMLType("Q4_0", 4),
    GGMLType("Q4_1", 4),
    GGMLType("Q5_1", 5, repack=True),
    GGMLType("Q3_K", 3, subblock=16, float32_scales=True, paired=True, fallback="Q4_0"),
    # not paired: Q2_K's independent minimums seldom let one sub-block's grid cover the other:
    # min-max with refits keeps its error lower (13 % on random blocks)
    GGMLType("Q2_K", 2, subblock=16, float32_scales=True, fallback="Q4_0"),
    GGMLType("F16", float_bytes=2),
    GGMLType("BF16", float_bytes=2),
)}


def lookup(name: str) -> GGMLType:
    """The row of ggml type ``name``; ValueError naming the known types for any other."""
    t = TYPES.get(name)
    if t is None:
        raise ValueError(f"unknown ggml type {name!r} (known: {', '.join(TYPES)})")
    return t


def names(having: Callable[[GGMLType], bool]) -> tuple[str, ...]:
    """The declared types of which ``having(row)`` holds, sorted by name (a stable order for the
    records that list them, e.g. fast's sidecar rule)."""
    return tuple(sorted(n for n, t in TYPES.items() if having(t)))
