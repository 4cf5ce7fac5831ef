"""GGUF tensor names, the MLX parameter tree they map to, and the expected inventory.

One declarative map with ``{i}`` templates drives conversion, verification and the error
messages for unknown or missing tensors; :func:`module_path` and :func:`stored_names` are
the one place the names of quantized arrays and their ``quantization`` keys come from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gguf import GGMLQuantizationType as T

from mlx_dgemma.formats import TYPES
from mlx_dgemma.schema import ModelArgs

# GGUF name -> MLX parameter path (quantized tensors also get .scales/.biases next to .weight).
NAME_MAP: dict[str, str] = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "rope_freqs.weight": "rope_freqs",
    "self_cond_pre_norm.weight": "self_conditioning.pre_norm.weight",
    "self_cond_gate.weight": "self_conditioning.gate_proj.weight",
    "self_cond_up.weight": "self_conditioning.up_proj.weight",
    "self_cond_down.weight": "self_conditioning.down_proj.weight",
    "blk.{i}.attn_norm.weight": "layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q_norm.weight": "layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.post_attention_norm.weight": "layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "layers.{i}.mlp.down_proj.weight",
    "blk.{i}.post_ffw_norm_1.weight": "layers.{i}.post_feedforward_layernorm_1.weight",
    "blk.{i}.pre_ffw_norm_2.weight": "layers.{i}.pre_feedforward_layernorm_2.weight",
    "blk.{i}.ffn_gate_inp.weight": "layers.{i}.router.proj.weight",
    "blk.{i}.ffn_gate_inp.scale": "layers.{i}.router.scale",
    "blk.{i}.ffn_down_exps.scale": "layers.{i}.router.per_expert_scale",
    "blk.{i}.ffn_gate_up_exps.weight": "layers.{i}.experts.gate_up_proj.weight",
    "blk.{i}.ffn_down_exps.weight": "layers.{i}.experts.down_proj.weight",
    "blk.{i}.post_ffw_norm_2.weight": "layers.{i}.post_feedforward_layernorm_2.weight",
    "blk.{i}.post_ffw_norm.weight": "layers.{i}.post_feedforward_layernorm.weight",
    "blk.{i}.layer_output_scale.weight": "layers.{i}.layer_scalar",
    "blk.{i}.enc_layer_output_scale.weight": "layers.{i}.encoder_layer_scalar",
}

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def mlx_name(gguf_name: str) -> str | None:
    """MLX parameter path for a GGUF tensor name, or None when the name is not in the map."""
    if gguf_name in NAME_MAP:
        return NAME_MAP[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m:
        template = NAME_MAP.get("blk.{i}." + m.group(2))
        if template is not None:
            return template.format(i=int(m.group(1)))
    return None


# A quantized weight is stored as three arrays named after its module.
QUANTIZED_PARTS = ("weight", "scales", "biases")


def module_path(path: str) -> str:
    """The module an MLX parameter belongs to ('layers.0.mlp.up_proj.weight' ->
    'layers.0.mlp.up_proj'): a quantized weight's arrays are named after it, and it is the
    weight's key in config.json's ``quantization`` section."""
    return path[: -len(".weight")] if path.endswith(".weight") else path


def stored_names(path: str, quantized: bool) -> list[str]:
    """The array names an MLX parameter is stored under: itself, or its module's
    ``.weight``/``.scales``/``.biases`` when quantized."""
    if not quantized:
        return [path]
    return [f"{module_path(path)}.{part}" for part in QUANTIZED_PARTS]


@dataclass(frozen=True)
class Expected:
    """One tensor the model needs: GGUF name, GGUF ``ne`` shape (fastest axis first)."""

    name: str
    ne: tuple[int, ...]
    # Matrices whose rows are quantizable; vectors and router weights stay float.
    matrix: bool


def expected_tensors(cfg: ModelArgs) -> list[Expected]:
    """Every tensor a DiffusionGemma GGUF must hold, derived from its metadata."""
    H, V, FF = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    E, EF = cfg.num_experts, cfg.moe_intermediate_size
    out = [
        Expected("output_norm.weight", (H,), False),
        Expected("rope_freqs.weight", (cfg.global_head_dim // 2,), False),
        Expected("self_cond_down.weight", (FF, H), True),
        Expected("self_cond_gate.weight", (H, FF), True),
        Expected("self_cond_pre_norm.weight", (H,), False),
        Expected("self_cond_up.weight", (H, FF), True),
        Expected("token_embd.weight", (H, V), True),
    ]
    for i, kind in enumerate(cfg.layer_types):
        sliding = kind == "sliding_attention"
        hd = cfg.head_dim if sliding else cfg.global_head_dim
        kv = cfg.num_key_value_heads if sliding else cfg.num_global_key_value_heads
        nq = cfg.num_attention_heads * hd
        blk = [
            ("attn_k.weight", (H, kv * hd), True),
            ("attn_k_norm.weight", (hd,), False),
            ("attn_norm.weight", (H,), False),
            ("attn_output.weight", (nq, H), True),
            ("attn_q.weight", (H, nq), True),
            ("attn_q_norm.weight", (hd,), False),
            ("attn_v.weight", (H, kv * hd), True) if sliding else None,
            ("enc_layer_output_scale.weight", (1,), False),
            ("ffn_down.weight", (FF, H), True),
            ("ffn_down_exps.scale", (E,), False),
            ("ffn_down_exps.weight", (EF, H, E), True),
            ("ffn_gate.weight", (H, FF), True),
            ("ffn_gate_inp.scale", (H,), False),
            ("ffn_gate_inp.weight", (H, E), False),
            ("ffn_gate_up_exps.weight", (H, 2 * EF, E), True),
            ("ffn_norm.weight", (H,), False),
            ("ffn_up.weight", (H, FF), True),
            ("layer_output_scale.weight", (1,), False),
            ("post_attention_norm.weight", (H,), False),
            ("post_ffw_norm.weight", (H,), False),
            ("post_ffw_norm_1.weight", (H,), False),
            ("post_ffw_norm_2.weight", (H,), False),
            ("pre_ffw_norm_2.weight", (H,), False),
        ]
        out += [Expected(f"blk.{i}.{n}", ne, m) for n, ne, m in filter(None, blk)]
    return out


def _use_more_bits(i: int, n: int) -> bool:
    """llama.cpp ``use_more_bits``: first and last eighth, and every third layer between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _kind(name: str) -> str:
    """'blk.3.attn_v.weight' -> 'attn_v'; 'token_embd.weight' -> 'token_embd'."""
    m = _BLOCK_RE.match(name)
    return (m.group(2) if m else name).rsplit(".", 1)[0]


def q4_k_m_types(expected: list[Expected]) -> dict[str, T]:
    """The ggml type llama.cpp's Q4_K_M recipe (file type 15) gives each tensor.

    Counters run over tensors of one kind (e.g. the 25 ``attn_v`` of the sliding layers), as
    in llama.cpp's ``llama_tensor_get_type``.
    """
    counts: dict[str, int] = {}
    for e in expected:
        if e.matrix:
            counts[_kind(e.name)] = counts.get(_kind(e.name), 0) + 1
    seen: dict[str, int] = {}
    types: dict[str, T] = {}
    for e in expected:
        if not e.matrix:
            types[e.name] = T.F32
            continue
        kind = _kind(e.name)
        i = seen.get(kind, 0)
        seen[kind] = i + 1
        n = counts.get(kind, 1)
        if kind == "token_embd":
            t = T.Q6_K  # tied output head: llama.cpp gives it the output tensor's type
        elif kind in ("attn_v", "ffn_down", "ffn_down_exps"):
            t = T.Q6_K if _use_more_bits(i, n) else T.Q4_K
        else:
            t = T.Q4_K
        fallback = TYPES[t.name].fallback  # llama.cpp's type where a row is not a multiple of 256
        if e.ne[0] % 256 and fallback is not None:
            t = T[fallback]
        types[e.name] = t
    return types
