"""Train the built-in demo model: a tiny DiffusionGemma on the King James Bible.

Stages (each reads what the previous one wrote under ``build/demo/``):

    prepare   corpus (Debian's ``bible-kjv-text``: ``apt-get install bible-kjv-text``), a BPE
              vocabulary in the gemma4 layout, chat-shaped examples with a held-out split
    train     the DiffusionGemma objective in torch with transformers' reference model
              (needs only torch + transformers, so it can run on another machine)
    export    the trained weights as a GGUF in the published file's format (Q8_0 matrices)
              into ``mlx_dgemma/data/``
    defaults  rewrite only the shipped file's sampler keys (SAMPLER_DEFAULTS), tensors untouched
    evaluate  MLX generation with the default sampler: steps per block, final entropy,
              readability, time to first words (``build/demo/eval.json``)
    plot      the loss curve into ``docs/demo-loss.png`` (needs matplotlib)

``python scripts/train_demo.py all`` runs them in order. Everything is seeded; on a CUDA
machine the run is reproducible up to the GPU's non-deterministic reductions.
Script-only dependencies: torch, transformers >= 5.17 (DiffusionGemma), matplotlib.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "demo"
DATA_DIR = ROOT / "mlx_dgemma" / "data"
GGUF_NAME = "diffusiongemma-9.9M-kjv-demo-Q8_0.gguf"
SEED = 20261122

# The model's shape (GGUF metadata names): 9.9M parameters.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_layers=6, global_layers=(2, 5), num_heads=4,
             num_kv_heads=2, num_global_kv_heads=1, head_dim=64, global_head_dim=128, sliding_window=128,
             num_experts=8, top_k=2, moe_intermediate_size=128, vocab_size=4096, canvas_length=64,
             context_length=4096)
# Sampler defaults written into the file (diffusion.eb_* keys); the rest stay the reference's.
SAMPLER_DEFAULTS = {"diffusion.eb_t_max": 0.25, "diffusion.eb_t_min": 0.05}
N_RESERVED, N_BYTES = 108, 256  # the gemma4 layout: special ids first, then 256 byte tokens
TURN_END, PAD = 106, 0
HELD_OUT_EVERY = 37  # every 37th chapter is held out
# A word, for the corpus word list and the readability metric alike (so both split the same way).
WORD = re.compile(r"[A-Za-z]+")
EDGE_PUNCT = "\"'()[]{},.;:!?-"


def strict_words(text: str) -> list[str]:
    """Whitespace-separated tokens with their edge punctuation stripped, lowercased, those that
    hold a letter: a stricter split than WORD's letter runs, under which a join such as
    ``her.ry`` or ``saying,Ver`` is one token (not a word) instead of two (one a word)."""
    out = []
    for t in text.split():
        t = t.strip(EDGE_PUNCT).lower()
        if any(c.isalpha() for c in t):
            out.append(t)
    return out


# ----------------------------------------------------------------------------- prepare

def read_kjv() -> list[tuple[str, int, str]]:
    """(book, chapter, verse text) for all 31,102 verses, via the ``bible`` program."""
    try:
        out = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], capture_output=True, text=True, check=True).stdout
    except FileNotFoundError:
        sys.exit("train_demo: the `bible` program is missing; install Debian's corpus with "
                 "`apt-get install bible-kjv-text`")
    verses = []
    for line in out.splitlines():
        m = re.match(r"^(\S*?)(\d+):(\d+) (.*)$", line)
        if m:
            verses.append((m.group(1), int(m.group(2)), m.group(4).strip()))
    if len(verses) != 31102:
        sys.exit(f"train_demo: expected 31102 verses from `bible`, got {len(verses)}")
    return verses


def train_vocab(texts: list[str]) -> dict:
    """GGUF tokenizer metadata: a BPE trained on ``texts`` in the gemma4 layout."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    from mlx_dgemma.convert.tokenizer_data import BYTE, CONTROL, NORMAL, SPECIALS, UNKNOWN, UNUSED

    n_pieces = SHAPE["vocab_size"] - N_RESERVED - N_BYTES
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    # Words start at U+2581 and merges stay inside words, so the file's merges applied to a
    # whole string (gemma4 has no pre-tokenizer) give the same tokens.
    tok.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(vocab_size=n_pieces, show_progress=False, initial_alphabet=["\n"],
                                  limit_alphabet=200)
    tok.train_from_iterator(texts + ["user model thought"] * 50, trainer)
    model = json.loads(tok.to_str())["model"]
    pieces = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    tokens = [f"<unused{i}>" for i in range(N_RESERVED)]
    types = [UNUSED] * N_RESERVED
    for i, t in SPECIALS.items():
        tokens[i], types[i] = t, CONTROL
    types[3] = UNKNOWN
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE] * 256
    tokens += pieces
    types += [NORMAL] * len(pieces)
    while len(tokens) < SHAPE["vocab_size"]:
        tokens.append(f"<unused{len(tokens)}>")
        types.append(UNUSED)
    return {
        "tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * len(tokens), "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.mask_token_id": 4,
        "tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": True,
    }


def text_config() -> dict:
    """The transformers text config of SHAPE (as the converter derives it from metadata)."""
    from mlx_dgemma.convert.synthetic import TinySpec

    s = SHAPE
    spec = TinySpec(hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
                    num_layers=s["num_layers"], global_layers=s["global_layers"], num_heads=s["num_heads"],
                    num_kv_heads=s["num_kv_heads"], num_global_kv_heads=s["num_global_kv_heads"],
                    head_dim=s["head_dim"], global_head_dim=s["global_head_dim"],
                    sliding_window=s["sliding_window"], num_experts=s["num_experts"], top_k=s["top_k"],
                    moe_intermediate_size=s["moe_intermediate_size"], vocab_size=s["vocab_size"],
                    canvas_length=s["canvas_length"], context_length=s["context_length"])
    d = spec.text_config().to_dict()
    d.pop("model_type", None)
    return d


# A follow-up turn as ChatSession laid it out when the shipped demo was trained (the previous
# answer's block, padding included, then this turn). ChatSession now renders the whole
# conversation instead; the template is kept here, not in the core, so that this script
# still rebuilds the shipped weights' training data exactly.
CONTINUATION_TEMPLATE = (
    "{% for m in messages %}{{ '<|turn>user\\n' + (m['content'] | trim) + '<turn|>\\n<|turn>model\\n' }}"
    "{% if not enable_thinking %}{{ '<|channel>thought\\n<channel|>' }}{% endif %}{% endfor %}"
)


def prepare(args: argparse.Namespace) -> None:
    from mlx_dgemma.chat_template import DEFAULT_TEMPLATE, render_chat
    from mlx_dgemma.tokenizer import Tokenizer

    BUILD.mkdir(parents=True, exist_ok=True)
    verses = read_kjv()
    chapters: dict[tuple[str, int], list[str]] = {}
    for book, ch, text in verses:
        chapters.setdefault((book, ch), []).append(text)
    keys = list(chapters)
    held = {k for i, k in enumerate(keys) if i % HELD_OUT_EVERY == HELD_OUT_EVERY // 2}
    train_texts = [t for k in keys if k not in held for t in chapters[k]]
    vocab = train_vocab(train_texts)
    tok = Tokenizer(vocab, DEFAULT_TEMPLATE)
    C = SHAPE["canvas_length"]

    def answer_block(text: str) -> list[int] | None:
        ids = tok.encode(text) + [TURN_END]
        return ids + [PAD] * (C - len(ids)) if len(ids) <= C else None

    rng = random.Random(SEED)
    prefixes, canvases, split = [], [], []
    for k in keys:
        vs = chapters[k]
        for i in range(len(vs) - 1):
            block = answer_block(vs[i + 1])
            if block is None:
                continue
            # One turn; a second example of the same continuation with the previous exchange
            # already in the cache, laid out as ChatSession lays out a follow-up turn.
            first = tok.encode(render_chat([{"role": "user", "content": vs[i]}], DEFAULT_TEMPLATE))
            variants = [first]
            prev = answer_block(vs[i - 1]) if i >= 2 else None
            if prev is not None and rng.random() < 0.5:
                opening = tok.encode(render_chat([{"role": "user", "content": vs[i - 2]}], DEFAULT_TEMPLATE))
                follow = tok.encode("\n" + render_chat([{"role": "user", "content": vs[i]}], CONTINUATION_TEMPLATE))
                variants.append(opening + prev + follow)
            for p in variants:
                prefixes.append(np.array(p, np.int32))
                canvases.append(np.array(block, np.int32))
                split.append(k in held)
    offsets = np.cumsum([0] + [len(p) for p in prefixes]).astype(np.int64)
    np.savez_compressed(BUILD / "examples.npz", prefix=np.concatenate(prefixes), offsets=offsets,
                        canvas=np.stack(canvases), held_out=np.array(split))
    (BUILD / "tokenizer.json").write_text(json.dumps(vocab))
    (BUILD / "config.json").write_text(json.dumps({"text_config": text_config(), "canvas_length": C}))
    words = sorted({w.lower() for t in train_texts for w in WORD.findall(t)})
    (BUILD / "words.txt").write_text("\n".join(words))
    strict = sorted({w for t in train_texts for w in strict_words(t)})
    (BUILD / "words_strict.txt").write_text("\n".join(strict))
    sample = train_texts[:2000]
    n_tokens = sum(len(tok.encode(t)) for t in sample)
    print(f"prepare: {len(verses)} verses, {len(chapters)} chapters ({len(held)} held out), "
          f"{len(canvases)} examples ({sum(split)} held out), {len(words)} corpus words, "
          f"{n_tokens / sum(len(t.split()) for t in sample):.2f} tokens per word")


# ----------------------------------------------------------------------------- train

def build_model(cfg: dict, device: str):
    import torch
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    from_ref = {"model_type": "gemma4_vision", "hidden_size": 32, "num_hidden_layers": 1,
                "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16}
    config = DiffusionGemmaConfig(text_config=dict(cfg["text_config"]), vision_config=from_ref,
                                  canvas_length=cfg["canvas_length"])
    attn = "sdpa" if device == "cuda" else "eager"
    config.text_config._attn_implementation = attn
    config._attn_implementation = attn
    torch.manual_seed(SEED)
    return DiffusionGemmaForBlockDiffusion(config).to(device), config


class Batches:
    """Batches of examples with equal prefix lengths (no padding needed), sampled by length."""

    def __init__(self, data: dict, held_out: bool, batch: int, seed: int):
        idx = np.flatnonzero(data["held_out"] == held_out)
        lens = np.diff(data["offsets"])[idx]
        self.data, self.batch = data, batch
        self.groups = [idx[lens == n] for n in np.unique(lens)]
        sizes = np.array([len(g) for g in self.groups], np.float64)
        self.weights = sizes / sizes.sum()
        self.rng = np.random.default_rng(seed)
        self.n = int(sizes.sum())

    def sample(self) -> tuple[np.ndarray, np.ndarray]:
        g = self.groups[self.rng.choice(len(self.groups), p=self.weights)]
        pick = self.rng.choice(g, size=min(self.batch, len(g)), replace=False)
        return self.take(pick)

    def take(self, pick: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        o, d = self.data["offsets"], self.data["prefix"]
        prefix = np.stack([d[o[i]:o[i + 1]] for i in pick])
        return prefix, self.data["canvas"][pick]


def diffusion_loss(model, config, prefix, clean, gen, sc_prob: float = 0.5, noise_level=None):
    """The training objective: the clean prefix through the encoder (causal, filling the
    cache), the canvas corrupted by uniform-token noise at a random level per example (the
    noise the sampler re-draws for unaccepted positions), self-conditioning on a random half
    of the examples (the model's own temperature-scaled logits for the same canvas, as the
    sampler feeds back the previous step's), cross-entropy on every canvas position."""
    import torch
    from transformers import DynamicCache

    B, C = clean.shape
    V = config.text_config.vocab_size
    dev = clean.device
    t = torch.rand(B, 1, device=dev, generator=gen) if noise_level is None else torch.full((B, 1), noise_level, device=dev)
    noisy_mask = torch.rand(B, C, device=dev, generator=gen) < t
    noise = torch.randint(0, V, (B, C), device=dev, generator=gen)
    canvas = torch.where(noisy_mask, noise, clean)
    cache = DynamicCache(config=config.get_text_config(decoder=True))
    model.model.encoder(input_ids=prefix, past_key_values=cache)
    use_sc = torch.rand(B, device=dev, generator=gen) < sc_prob
    sc_logits = None
    if sc_prob > 0:
        with torch.no_grad():
            first = model(decoder_input_ids=canvas, past_key_values=cache).logits
        temp = 0.4 + 0.4 * torch.rand(B, 1, 1, device=dev, generator=gen)
        sc_logits = (first / temp).detach()
    out = model(decoder_input_ids=canvas, past_key_values=cache, self_conditioning_logits=sc_logits,
                self_conditioning_mask=use_sc if sc_logits is not None else None)
    return torch.nn.functional.cross_entropy(out.logits.float().reshape(-1, V), clean.reshape(-1))


def train(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    cfg = json.loads((BUILD / "config.json").read_text())
    data = dict(np.load(BUILD / "examples.npz"))
    model, config = build_model(cfg, device)
    start = 0
    if args.resume:
        ckpt = torch.load(BUILD / "ckpt.pt", map_location="cpu")
        # the encoder's weights are tied to the decoder's: loading the decoder's sets both
        missing = model.load_state_dict(ckpt["state"], strict=False).missing_keys
        assert not [k for k in missing if "vision" not in k and not k.startswith("model.encoder.")], missing
        start = int(ckpt["step"])
    params = [p for n, p in model.named_parameters() if "vision" not in n]
    n_params = sum(p.numel() for p in params)
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    train_b = Batches(data, False, args.batch, SEED)
    held_b = Batches(data, True, args.batch, SEED + 1)
    rng = np.random.default_rng(SEED + 2)
    held_pick = rng.choice(np.flatnonzero(data["held_out"]), size=min(256, held_b.n), replace=False)
    gen = torch.Generator(device=device)
    gen.manual_seed(SEED)
    log_path = BUILD / "train_log.jsonl"
    log = log_path.open("a" if args.resume else "w")
    print(f"train: {n_params / 1e6:.2f}M parameters, {train_b.n} train / {held_b.n} held-out examples, "
          f"device {device}, batch {args.batch}, {args.steps} steps max, {args.minutes} min max", flush=True)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)

    def held_out_loss() -> float:
        model.eval()
        g = torch.Generator(device=device)
        g.manual_seed(SEED + 3)
        losses, order = [], held_pick[np.argsort(np.diff(data["offsets"])[held_pick], kind="stable")]
        lens = np.diff(data["offsets"])[order]
        with torch.no_grad(), amp:
            for n in np.unique(lens):
                group = order[lens == n]
                for s in range(0, len(group), args.batch):
                    p, c = held_b.take(group[s:s + args.batch])
                    loss = diffusion_loss(model, config, torch.from_numpy(p).long().to(device),
                                          torch.from_numpy(c).long().to(device), g)
                    losses.append((loss.item(), len(p)))
        model.train()
        return sum(l * n for l, n in losses) / sum(n for _, n in losses)

    t0 = time.time()
    step, ema, end = start, None, start + args.steps
    model.train()
    while step < end and time.time() - t0 < args.minutes * 60:
        lr = args.lr * min(1.0, (step - start + 1) / args.warmup)
        frac = (time.time() - t0) / (args.minutes * 60)
        lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, max(frac, (step - start) / args.steps))))
        for g_ in opt.param_groups:
            g_["lr"] = lr
        p, c = train_b.sample()
        with amp:
            loss = diffusion_loss(model, config, torch.from_numpy(p).long().to(device),
                                  torch.from_numpy(c).long().to(device), gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % args.log_every == 0:
            rec = {"step": step, "seconds": round(time.time() - t0, 1), "train_loss": round(ema, 4), "lr": lr}
            if step % (args.log_every * args.eval_every) == 0:
                rec["held_out_loss"] = round(held_out_loss(), 4)
                save(model, BUILD / "ckpt.pt", step, args.out)
            print(json.dumps(rec), flush=True)
            log.write(json.dumps(rec) + "\n")
            log.flush()
    rec = {"step": step, "seconds": round(time.time() - t0, 1), "train_loss": round(ema, 4),
           "held_out_loss": round(held_out_loss(), 4), "final": True}
    print(json.dumps(rec), flush=True)
    log.write(json.dumps(rec) + "\n")
    log.close()
    save(model, BUILD / "ckpt.pt", step, args.out)


def save(model, path: Path, step: int, out: str | None = None) -> None:
    """The decoder's weights (the encoder's are tied to them) and the layer scalars, float32;
    with ``out``, also as float16 parts of < 16 MB each (for copying off a remote machine)."""
    import torch

    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()
             if "vision" not in k and (not k.startswith("model.encoder.") or "layer_scalar" in k)}
    tmp = path.with_suffix(".tmp")
    torch.save({"step": step, "state": state}, tmp)
    os.replace(tmp, path)
    if out:
        keys = sorted(state)
        for i in range(3):
            part = {k: state[k].half() for k in keys[i::3]}
            torch.save({"step": step, "state": part}, Path(out) / f"ckpt_part{i}.pt")


def merge_parts(args: argparse.Namespace) -> None:
    """Join ``ckpt_part*.pt`` from --out into build/demo/ckpt.pt."""
    import torch

    state, step = {}, 0
    for f in sorted(Path(args.out).glob("ckpt_part*.pt")):
        part = torch.load(f, map_location="cpu")
        state.update({k: v.float() for k, v in part["state"].items()})
        step = part["step"]
    torch.save({"step": step, "state": state}, BUILD / "ckpt.pt")
    print(f"merge_parts: step {step}, {len(state)} tensors")


# ----------------------------------------------------------------------------- export

def export(args: argparse.Namespace) -> None:
    import torch
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter
    from gguf.quants import quantize

    from mlx_dgemma.chat_template import DEFAULT_TEMPLATE
    from mlx_dgemma.convert.metadata import ARCH
    from mlx_dgemma.schema import ModelArgs
    from mlx_dgemma.convert.names import expected_tensors, mlx_name
    from mlx_dgemma.convert.synthetic import _add_kv
    from mlx_dgemma.bench.peers import hf_names

    cfg = json.loads((BUILD / "config.json").read_text())
    state = torch.load(BUILD / "ckpt.pt", map_location="cpu")["state"]
    vocab = json.loads((BUILD / "tokenizer.json").read_text())
    tc = ModelArgs(**{k: v for k, v in cfg["text_config"].items() if k in ModelArgs.__dataclass_fields__})
    s = SHAPE
    pattern = [i not in s["global_layers"] for i in range(s["num_layers"])]
    p = ARCH + "."
    md = {
        "general.type": "model", "general.name": "DiffusionGemma demo (KJV)",
        "general.size_label": "9.9M", "general.license": "public-domain text; Apache-2.0 weights",
        "general.quantization_version": 2, "general.file_type": 7,  # MOSTLY_Q8_0
        p + "block_count": s["num_layers"], p + "context_length": s["context_length"],
        p + "embedding_length": s["hidden_size"], p + "feed_forward_length": s["intermediate_size"],
        p + "attention.head_count": s["num_heads"],
        p + "attention.head_count_kv": [s["num_kv_heads"] if sl else s["num_global_kv_heads"] for sl in pattern],
        p + "rope.freq_base": 1e6, p + "rope.freq_base_swa": 1e4,
        p + "attention.layer_norm_rms_epsilon": 1e-6, p + "expert_count": s["num_experts"],
        p + "expert_used_count": s["top_k"], p + "attention.key_length": s["global_head_dim"],
        p + "attention.value_length": s["global_head_dim"], p + "final_logit_softcapping": 30.0,
        p + "attention.sliding_window": s["sliding_window"], p + "attention.shared_kv_layers": 0,
        p + "embedding_length_per_layer_input": 0, p + "attention.sliding_window_pattern": pattern,
        p + "attention.key_length_swa": s["head_dim"], p + "attention.value_length_swa": s["head_dim"],
        p + "expert_feed_forward_length": s["moe_intermediate_size"],
        p + "rope.dimension_count": s["global_head_dim"], p + "rope.dimension_count_swa": s["head_dim"],
        p + "attention.causal": False, "diffusion.canvas_length": s["canvas_length"],
    }
    # This small model's own sampler defaults (the published file carries none): a cooler
    # temperature schedule than the reference's 0.8 -> 0.4, with which its stop rule fires.
    md.update(SAMPLER_DEFAULTS)
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    out = Path(args.output) if args.output else DATA_DIR / GGUF_NAME
    tmp = out.with_suffix(".tmp")
    w = GGUFWriter(str(tmp), ARCH)
    for k, v in md.items():
        _add_kv(w, k, v)
    for k, v in vocab.items():
        _add_kv(w, k, v)
    w.add_string("tokenizer.chat_template", DEFAULT_TEMPLATE)
    for e in expected_tensors(tc):
        shape = tuple(reversed(e.ne))
        if e.name == "rope_freqs.weight":
            f = np.full(shape, 1e30, np.float32)
            f[: int(0.25 * e.ne[0])] = 1.0  # partial rotary 0.25 of the global head dim
            w.add_tensor(e.name, f)
            continue
        names = hf_names(mlx_name(e.name))
        if e.name.endswith("enc_layer_output_scale.weight") or e.name.endswith("layer_output_scale.weight"):
            arr = state[names[0]].numpy()
        else:
            # encoder and decoder copies are tied: take the decoder's
            arr = state[names[-1]].numpy()
        arr = np.ascontiguousarray(arr.astype(np.float32)).reshape(shape)
        if e.matrix and args.types == "f16":
            w.add_tensor(e.name, arr.astype(np.float16))
        elif e.matrix and args.types == "q8_0" and e.ne[0] % 32 == 0:
            w.add_tensor(e.name, quantize(arr, T.Q8_0), raw_dtype=T.Q8_0)
        else:
            w.add_tensor(e.name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    print(f"export: {out} ({out.stat().st_size / 1e6:.1f} MB)")


def defaults(args: argparse.Namespace) -> None:
    """Rewrite the shipped file's sampler keys (``diffusion.eb_*``) to SAMPLER_DEFAULTS, every
    other key and every tensor copied as they are (no checkpoint or retraining needed); the
    tensors of the result are checked byte for byte against the original's before it replaces it."""
    import gguf

    from mlx_dgemma.convert.synthetic import _add_kv

    src = Path(args.output) if args.output else DATA_DIR / GGUF_NAME
    reader = gguf.GGUFReader(src)
    tmp = src.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), reader.get_field("general.architecture").contents())
    written = False
    for f in reader.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF."):
            continue  # the writer writes these itself
        if f.name.startswith("diffusion.eb_"):
            continue  # replaced: a key no longer among the defaults leaves the reference's value
        vt = f.types[0]
        sub = f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), vt, sub_type=sub)
        if f.name == "diffusion.canvas_length":  # where export writes them, so the order is export's
            for k, v in SAMPLER_DEFAULTS.items():
                _add_kv(w, k, v)
            written = True
    if not written:
        for k, v in SAMPLER_DEFAULTS.items():
            _add_kv(w, k, v)
    for t in reader.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in reader.tensors:
        w.write_tensor_data(t.data)
    w.close()
    # The tensor data is the file's tail (from the aligned data offset on): the same bytes, or no file.
    n = src.stat().st_size - reader.data_offset
    with open(src, "rb") as a, open(tmp, "rb") as b:
        a.seek(-n, os.SEEK_END)
        b.seek(-n, os.SEEK_END)
        same = tmp.stat().st_size - n >= 0 and a.read() == b.read()
    if not same:
        tmp.unlink()
        sys.exit(f"defaults: the rewritten tensor data differs from {src}'s; the file is left as it was")
    del reader
    os.replace(tmp, src)
    print(f"defaults: {src}: {SAMPLER_DEFAULTS}; tensor data ({n} bytes) byte-identical")


# ----------------------------------------------------------------------------- evaluate

def evaluate(args: argparse.Namespace) -> None:
    import mlx.core as mx

    from mlx_dgemma.loader import load
    from mlx_dgemma.events import DoneEvent, StepEvent
    from mlx_dgemma.generation import stream_generate

    runtime = load(DATA_DIR / GGUF_NAME, dtype=mx.float32)
    tok, gen_cfg = runtime.tokenizer, runtime.generation_config
    # --reference-sampler: the published model's defaults instead of the file's own
    overrides = {"t_max": 0.8, "t_min": 0.4} if args.reference_sampler else {}
    for kv in args.set or []:  # --set entropy_bound=0.03
        k, v = kv.split("=", 1)
        overrides[k] = type(gen_cfg.get(k, 0.0))(v)
    words = set((BUILD / "words.txt").read_text().split())
    strict_list = set((BUILD / "words_strict.txt").read_text().split("\n"))
    data = dict(np.load(BUILD / "examples.npz"))
    rng = np.random.default_rng(SEED + 4)
    held = rng.choice(np.flatnonzero(data["held_out"]), size=args.prompts, replace=False)
    prompts = []
    for i in held:
        ids = data["prefix"][data["offsets"][i]:data["offsets"][i + 1]].tolist()
        prompts.append(ids)
    free_prompts = ["In the beginning God created the heaven and the earth.", "The Lord is my shepherd",
                    "Tell me about the sea.", "Hello! Who are you?"]
    steps, final_entropy, first_words, n_words, n_known, samples = [], [], [], 0, 0, []
    unknown: dict[str, int] = {}
    n_strict, n_strict_known = 0, 0
    distinct, answers = [], []
    for k, prompt in enumerate(prompts + free_prompts):
        t0 = time.perf_counter()
        first, last_entropy, text = None, None, ""
        for ev in stream_generate(runtime, prompt, generation_config=gen_cfg,
                                  seed=SEED + k, **overrides):
            if isinstance(ev, StepEvent):
                last_entropy = ev.mean_entropy
                if first is None:
                    draft = tok.decode([t for t in ev.draft.tolist() if t not in tok.special_ids])
                    if any(w.lower() in words for w in WORD.findall(draft)):
                        first = time.perf_counter() - t0
                if ev.stopped or ev.step == ev.max_steps:  # the entropy the block ended with
                    final_entropy.append(last_entropy)
            if isinstance(ev, DoneEvent):
                steps += list(ev.steps_per_block)
                text = ev.text
        first_words.append(first if first is not None else float("nan"))
        ws = [w.lower() for w in WORD.findall(text)]
        st = strict_words(text)
        n_strict += len(st)
        n_strict_known += sum(w in strict_list for w in st)
        n_words += len(ws)
        n_known += sum(w in words for w in ws)
        for w in ws:
            if w not in words:
                unknown[w] = unknown.get(w, 0) + 1
        # repetition check: distinct words / words of this answer (1.0: no word repeated)
        distinct.append(len(set(ws)) / len(ws) if ws else float("nan"))
        answers.append(text)
        if k >= len(prompts):
            samples.append({"prompt": prompt, "answer": text})
        print(json.dumps({"prompt": k, "steps": steps[-1:], "first_words_s": first, "answer": text}), flush=True)
    max_steps = overrides.get("max_denoising_steps", gen_cfg["max_denoising_steps"])
    res = {
        "prompts": len(prompts) + len(free_prompts), "max_steps": max_steps,
        "median_steps_per_block": float(np.median(steps)), "mean_steps_per_block": float(np.mean(steps)),
        "blocks": len(steps),
        "final_mean_entropy": float(np.mean(final_entropy)) if final_entropy else None,
        "word_tokens": n_words, "known_word_fraction": n_known / max(1, n_words),
        "strict_word_tokens": n_strict, "strict_known_fraction": n_strict_known / max(1, n_strict),
        "distinct_word_ratio": float(np.nanmean(distinct)),
        "median_first_words_seconds": float(np.nanmedian(first_words)),
        "max_first_words_seconds": float(np.nanmax(first_words)), "samples": samples,
        "unknown_words": dict(sorted(unknown.items(), key=lambda kv: -kv[1])), "answers": answers,
    }
    res["blocks_stopped_early"] = float(np.mean(np.array(steps) < res["max_steps"]))
    res["sampler"] = {**gen_cfg, **overrides}
    name = args.eval_name or ("eval_reference_sampler.json" if args.reference_sampler else "eval.json")
    (BUILD / name).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "answers"}, indent=1))


def plot(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(line) for line in (BUILD / "train_log.jsonl").read_text().splitlines()]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot([r["step"] for r in recs], [r["train_loss"] for r in recs], label="train (EMA)")
    held = [r for r in recs if "held_out_loss" in r]
    ax.plot([r["step"] for r in held], [r["held_out_loss"] for r in held], "o-", label="held-out chapters")
    ax.set_xlabel("step")
    ax.set_ylabel("canvas cross-entropy (nats/token)")
    ax.set_title("Demo DiffusionGemma on the KJV Bible")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = ROOT / "docs" / "demo-loss.png"
    fig.savefig(out)
    print(f"plot: {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["prepare", "train", "merge_parts", "export", "defaults", "evaluate", "plot",
                                      "all"])
    ap.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--minutes", type=float, default=7.5,
                    help="training wall-time budget (the shipped model: 7.5 on one H100)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=15, help="held-out loss every N log lines")
    ap.add_argument("--types", choices=["q8_0", "f16", "f32"], default="q8_0", help="export: matrix type")
    ap.add_argument("--output", default=None,
                    help="export, defaults: the GGUF path (default: the package's demo file)")
    ap.add_argument("--reference-sampler", action="store_true",
                    help="evaluate: the published model's sampler defaults instead of the file's")
    ap.add_argument("--set", action="append", help="evaluate: a sampler override KEY=VALUE (repeatable)")
    ap.add_argument("--eval-name", default=None, help="evaluate: the result file's name under build/demo/")
    ap.add_argument("--resume", action="store_true", help="continue from build/demo/ckpt.pt")
    ap.add_argument("--out", default=None, help="also write float16 checkpoint parts here")
    ap.add_argument("--prompts", type=int, default=6, help="held-out prompts for evaluate")
    args = ap.parse_args()
    stages = ["prepare", "train", "export", "evaluate", "plot"] if args.stage == "all" else [args.stage]
    for s in stages:
        globals()[s](args)


if __name__ == "__main__":
    main()
