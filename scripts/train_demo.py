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


def split_chapters(verses: list[tuple[str, int, str]]) -> tuple[dict[tuple[str, int], list[str]], set]:
    """The verses by chapter (in order) and the held-out chapters' keys (every 37th)."""
    chapters: dict[tuple[str, int], list[str]] = {}
    for book, ch, text in verses:
        chapters.setdefault((book, ch), []).append(text)
    held = {k for i, k in enumerate(chapters) if i % HELD_OUT_EVERY == HELD_OUT_EVERY // 2}
    return chapters, held


def train_words() -> set[str]:
    """The corpus words: every WORD of the training chapters, lowercased (``words.txt``)."""
    chapters, held = split_chapters(read_kjv())
    return {w.lower() for k, vs in chapters.items() if k not in held for t in vs for w in WORD.findall(t)}


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
    chapters, held = split_chapters(verses)
    keys = list(chapters)
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
    listen = listen_examples(chapters, held, tok.encode, answer_block)
    n_names, n_things = listen.pop("names"), listen.pop("things")
    np.savez_compressed(BUILD / "listen.npz", **listen)
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
          f"{n_tokens / sum(len(t.split()) for t in sample):.2f} tokens per word; fine-tuning set: "
          f"{len(listen['canvas'])} examples ({int(listen['held_out'].sum())} held out), {n_names} names, "
          f"{n_things} things")


# The fine-tuning data (``listen.npz``): chat pairs whose answer depends on the user's turn.
# A prompt that names a person, place or thing of the corpus; its answer is a verse naming it.
NAME_PROMPTS = ("Who was {}?", "Tell me about {}.", "What did {} do?", "What of {}?", "Speak of {}.", "{}")
THING_PROMPTS = ("Tell me about the {}.", "What is {}?", "What of the {}?", "Speak of the {}.", "Where is the {}?",
                 "{}")
# kinds of example and their shares: the start of a verse and its continuation; a question naming
# something and a verse naming it; either as the second turn of a conversation (ChatSession's render)
LISTEN_MIX = (("continue", 0.4), ("about", 0.45), ("follow-up", 0.15))
LISTEN_EXAMPLES, LISTEN_HELD_OUT = 30000, 1000
# Fine-tuning draws the noise level as u ** (1/3) (mean 0.75): the first steps of a block see a
# canvas of pure noise, where only the prompt can tell the model what to write.
FT_NOISE_POWER = 1 / 3
# ... and keeps the answer's tail (<turn|>, pads) clean in most examples, as the sampler's
# canvases have it from the second step on (diffusion_loss's tail_clean).
FT_TAIL_CLEAN = 0.7


DETERMINERS = {"the", "a", "an", "his", "her", "my", "thy", "their", "our", "your", "this", "that", "these", "those"}


def corpus_entities(texts: list[str]) -> tuple[list[str], list[str]]:
    """Names (words written capitalized in >= 95 % of their >= 3 uses: persons, places, "LORD")
    and things (lowercase words used 5-2000 times, 3+ letters, not among the 150 most frequent
    words, after a determiner in >= 30 % of their uses, so mostly nouns: "sea", "wisdom",
    "bread", ...) of ``texts``, sorted."""
    from collections import Counter

    counts, after_det = Counter(), Counter()
    for t in texts:
        ws = WORD.findall(t)
        counts.update(ws)
        after_det.update(w for d, w in zip(ws, ws[1:]) if d.lower() in DETERMINERS)
    cap, low = Counter(), Counter()
    for w, c in counts.items():
        (cap if w[0].isupper() else low)[w.lower()] += c
    names = sorted(w for w, c in counts.items()
                   if w[0].isupper() and c >= 3 and len(w) >= 3 and cap[w.lower()] >= 0.95 * (cap[w.lower()] + low[w.lower()]))
    common = {w for w, _ in low.most_common(150)}
    things = sorted(w for w, c in low.items()
                    if 5 <= c <= 2000 and len(w) >= 3 and w not in common and after_det[w] >= 0.3 * c)
    return names, things


def listen_examples(chapters: dict[tuple[str, int], list[str]], held: set, encode, answer_block,
                    entities: tuple[list[str], list[str]] | None = None) -> dict:
    """The fine-tuning set: LISTEN_EXAMPLES training and LISTEN_HELD_OUT held-out chat pairs
    (LISTEN_MIX), each answer a canvas block (its tokens, ``<turn|>``, pads); the held-out ones
    answer from the held-out chapters only. ``entities``: the names and things to ask about
    (default: ``corpus_entities`` of the training chapters). Seeded."""
    from mlx_dgemma.chat_template import DEFAULT_TEMPLATE, render_chat

    rng = random.Random(SEED + 5)
    names, things = entities or corpus_entities([t for k, vs in chapters.items() if k not in held for t in vs])
    pools = {}
    for part in (False, True):
        keys = [k for k in chapters if (k in held) == part]
        verses = [(k, i) for k in keys for i in range(len(chapters[k]))]
        by_word: dict[str, list[tuple]] = {}
        for k, i in verses:
            for w in set(WORD.findall(chapters[k][i])):
                by_word.setdefault(w, []).append((k, i))
        pools[part] = (verses, by_word)

    def continuation(part: bool) -> tuple[str, str] | None:
        verses, _ = pools[part]
        k, i = rng.choice(verses)
        vs, words = chapters[k], chapters[k][i].split()
        nxt = vs[i + 1] if i + 1 < len(vs) else None
        if len(words) >= 8 and rng.random() < 0.8:  # the start of a verse: its rest (and the next verse)
            cut = rng.randint(3, len(words) - 4)
            rest = " ".join(words[cut:])
            if len(words) - cut < 8 and nxt is not None:
                rest += " " + nxt
            return " ".join(words[:cut]), rest
        return (vs[i], nxt) if nxt is not None else None  # a whole verse: the next one

    def about(part: bool) -> tuple[str, str] | None:
        _, by_word = pools[part]
        if rng.random() < 0.4:
            word, template = rng.choice(names), rng.choice(NAME_PROMPTS)
            found = by_word.get(word, [])
        else:
            word, template = rng.choice(things), rng.choice(THING_PROMPTS)
            found = by_word.get(word, [])
        if not found:
            return None
        k, i = rng.choice(found)
        return template.format(word), chapters[k][i]

    def pair(part: bool) -> tuple[list[dict], list[int]] | None:
        kind = rng.choices([m for m, _ in LISTEN_MIX], [w for _, w in LISTEN_MIX])[0]
        turns = 2 if kind == "follow-up" else 1
        messages, block = [], None
        for _ in range(turns):
            qa = (continuation if rng.random() < 0.5 else about)(part) if kind == "follow-up" else \
                (continuation if kind == "continue" else about)(part)
            if qa is None or (block := answer_block(qa[1])) is None:
                return None
            messages += [{"role": "user", "content": qa[0]}, {"role": "assistant", "content": qa[1]}]
        return messages[:-1], block

    prefixes, canvases, split = [], [], []
    for part, n in ((False, LISTEN_EXAMPLES), (True, LISTEN_HELD_OUT)):
        made = 0
        while made < n:
            ex = pair(part)
            if ex is None:
                continue
            prefixes.append(np.array(encode(render_chat(ex[0], DEFAULT_TEMPLATE)), np.int32))
            canvases.append(np.array(ex[1], np.int32))
            split.append(part)
            made += 1
    offsets = np.cumsum([0] + [len(p) for p in prefixes]).astype(np.int64)
    return {"prefix": np.concatenate(prefixes), "offsets": offsets, "canvas": np.stack(canvases),
            "held_out": np.array(split), "names": len(names), "things": len(things)}


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


def corrupt(clean, t, vocab_size: int, gen, tail_clean: float = 0.0):
    """``clean`` canvases [B, C] with each position replaced by a uniform random token with
    probability ``t`` [B, 1]; in a ``tail_clean`` share of the rows the tail (from the first
    ``<turn|>`` on) is left clean (see ``diffusion_loss``)."""
    import torch

    B, C = clean.shape
    noisy = torch.rand(B, C, device=clean.device, generator=gen) < t
    if tail_clean > 0:
        tail = torch.cumsum((clean == TURN_END).int(), dim=1) > 0
        noisy &= ~((torch.rand(B, 1, device=clean.device, generator=gen) < tail_clean) & tail)
    noise = torch.randint(0, vocab_size, (B, C), device=clean.device, generator=gen)
    return torch.where(noisy, noise, clean)


def diffusion_loss(model, config, prefix, clean, gen, sc_prob: float = 0.5, noise_level=None,
                   noise_power: float = 1.0, tail_clean: float = 0.0):
    """The training objective: the clean prefix through the encoder (causal, filling the
    cache), the canvas corrupted by uniform-token noise at a random level per example (the
    noise the sampler re-draws for unaccepted positions), self-conditioning on a random half
    of the examples (the model's own temperature-scaled logits for the same canvas, as the
    sampler feeds back the previous step's), cross-entropy on every canvas position.

    The noise level is u ** ``noise_power``, u ~ U(0, 1): 1 draws it uniformly; 1/3 draws
    high levels more often (mean 0.75), where only the prompt tells what the answer is.
    ``tail_clean``: the share of examples whose tail (``<turn|>`` and the pads after it) stays
    clean while the answer's tokens are noised at the level drawn. The sampler accepts the
    tail first (it is the easiest part), so from the second step on its canvases look like
    that: a clean tail and an answer of noise. A model trained on uniform noise only reads
    the clean tail as a sign of little noise and keeps the random tokens of the answer as
    if they were the answer's (the shipped base model did: its answers were the seed's noise)."""
    import torch
    from transformers import DynamicCache

    B, C = clean.shape
    V = config.text_config.vocab_size
    dev = clean.device
    t = torch.rand(B, 1, device=dev, generator=gen) ** noise_power if noise_level is None \
        else torch.full((B, 1), noise_level, device=dev)
    canvas = corrupt(clean, t, V, gen, tail_clean)
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
    """The base model: from random weights on ``examples.npz`` (verse -> next verse), within
    ``--minutes`` (the cosine decay follows the time budget); ``--resume`` continues ckpt.pt."""
    fit(args, data_name="examples.npz", log_name="train_log.jsonl", out=BUILD / "ckpt.pt",
        init=BUILD / "ckpt.pt" if args.resume else None, steps=args.steps, lr=args.lr, warmup=args.warmup,
        batch=args.batch, minutes=args.minutes, noise_power=1.0, tail_clean=0.0, append=args.resume, stop=None)


def finetune(args: argparse.Namespace) -> None:
    """The shipped model: the base model (``--init``: a checkpoint or a GGUF; default ckpt.pt)
    fine-tuned on ``listen.npz`` (answers that depend on the prompt) for a fixed number of
    steps (the schedule follows the steps, not the clock, so any machine gets the same model)
    into ckpt_listen.pt, which ``export`` writes out."""
    fit(args, data_name="listen.npz", log_name="finetune_log.jsonl", out=BUILD / "ckpt_listen.pt",
        init=Path(args.init) if args.init else BUILD / "ckpt.pt", steps=args.ft_steps, lr=args.ft_lr,
        warmup=args.ft_warmup, batch=args.ft_batch, minutes=None, noise_power=FT_NOISE_POWER,
        tail_clean=FT_TAIL_CLEAN, append=False, stop=args.ft_stop)


def load_init(model, path: Path) -> int:
    """Weights from a checkpoint (``save``'s; returns its step) or a GGUF (dequantized, as
    the parity tests' reference holds them; returns 0) into ``model``."""
    import torch

    if path.suffix == ".gguf":
        from mlx_dgemma.bench.peers import hf_model_from_gguf

        state, step = hf_model_from_gguf(path).state_dict(), 0
    else:
        ckpt = torch.load(path, map_location="cpu")
        state, step = ckpt["state"], int(ckpt["step"])
    # the encoder's weights are tied to the decoder's: loading the decoder's sets both
    result = model.load_state_dict(state, strict=False)
    bad = [k for k in result.missing_keys if "vision" not in k and not k.startswith("model.encoder.")]
    if bad or [k for k in result.unexpected_keys if "vision" not in k]:
        sys.exit(f"train_demo: {path} does not hold this model's weights (missing {bad[:3]}, "
                 f"unexpected {result.unexpected_keys[:3]})")
    return step


def fit(args: argparse.Namespace, *, data_name: str, log_name: str, out: Path, init: Path | None, steps: int,
        lr: float, warmup: int, batch: int, minutes: float | None, noise_power: float, tail_clean: float,
        append: bool, stop: int | None) -> None:
    """The training loop of ``train`` and ``finetune``: AdamW, warm-up then cosine decay to a
    tenth (over ``steps``, or the time budget ``minutes`` when that ends first), gradient
    clipping, held-out loss every ``--eval-every`` log lines, checkpoints into ``out``. ``stop``:
    end after that many steps of the ``steps``-step schedule (the learning rate still follows
    ``steps``), as a run cut short would have; None runs it all."""
    import torch

    torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    cfg = json.loads((BUILD / "config.json").read_text())
    data = dict(np.load(BUILD / data_name))
    model, config = build_model(cfg, device)
    start = 0
    if init is not None:
        if not init.is_file():
            sys.exit(f"train_demo: {init}: no such checkpoint or GGUF to start from")
        step0 = load_init(model, init)
        start = step0 if append else 0
    params = [p for n, p in model.named_parameters() if "vision" not in n]
    n_params = sum(p.numel() for p in params)
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    # --data-seed gives a later fine-tuning stage batches and noise of its own; with the
    # default every stage would draw the first stage's batches again.
    train_b = Batches(data, False, batch, args.data_seed)
    held_b = Batches(data, True, batch, SEED + 1)
    rng = np.random.default_rng(SEED + 2)
    held_pick = rng.choice(np.flatnonzero(data["held_out"]), size=min(args.held_out, held_b.n), replace=False)
    gen = torch.Generator(device=device)
    gen.manual_seed(args.data_seed)
    log_path = BUILD / log_name
    log = log_path.open("a" if append else "w")
    budget = f"{minutes} min max" if minutes else "no time limit"
    print(f"{out.stem}: {n_params / 1e6:.2f}M parameters, {train_b.n} train / {held_b.n} held-out examples "
          f"({data_name}), from {init or 'random weights'}, device {device}, {args.threads} threads, batch {batch}, "
          f"{steps} steps, {budget}", flush=True)
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
                for s in range(0, len(group), batch):
                    p, c = held_b.take(group[s:s + batch])
                    loss = diffusion_loss(model, config, torch.from_numpy(p).long().to(device),
                                          torch.from_numpy(c).long().to(device), g)
                    losses.append((loss.item(), len(p)))
        model.train()
        return sum(l * n for l, n in losses) / sum(n for _, n in losses)

    t0 = time.time()
    step, ema, end = start, None, start + (min(stop, steps) if stop else steps)
    if not append and args.eval_every:
        rec = {"step": step, "seconds": 0.0, "held_out_loss": round(held_out_loss(), 4)}
        print(json.dumps(rec), flush=True)
        log.write(json.dumps(rec) + "\n")
        t0 = time.time()
    model.train()
    while step < end and (not minutes or time.time() - t0 < minutes * 60):
        cur = lr * min(1.0, (step - start + 1) / warmup)
        frac = (step - start) / steps
        if minutes:
            frac = max(frac, (time.time() - t0) / (minutes * 60))
        cur *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
        for g_ in opt.param_groups:
            g_["lr"] = cur
        p, c = train_b.sample()
        with amp:
            loss = diffusion_loss(model, config, torch.from_numpy(p).long().to(device),
                                  torch.from_numpy(c).long().to(device), gen, noise_power=noise_power,
                                  tail_clean=tail_clean)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % args.log_every == 0:
            rec = {"step": step, "seconds": round(time.time() - t0, 1), "train_loss": round(ema, 4), "lr": cur}
            if args.eval_every and step % (args.log_every * args.eval_every) == 0 and step < end:
                rec["held_out_loss"] = round(held_out_loss(), 4)
                save(model, out, step, args.out)
            print(json.dumps(rec), flush=True)
            log.write(json.dumps(rec) + "\n")
            log.flush()
    rec = {"step": step, "seconds": round(time.time() - t0, 1), "train_loss": round(ema, 4),
           "held_out_loss": round(held_out_loss(), 4), "final": True}
    print(json.dumps(rec), flush=True)
    log.write(json.dumps(rec) + "\n")
    log.close()
    save(model, out, step, args.out)


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
    state = torch.load(Path(args.ckpt) if args.ckpt else BUILD / "ckpt_listen.pt", map_location="cpu")["state"]
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
    """The loss curves: the base training's into ``docs/demo-loss.png``, the fine-tuning's
    into ``docs/demo-finetune-loss.png`` (each where its log exists)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for log_name, png, title in (("train_log.jsonl", "demo-loss.png", "Demo DiffusionGemma on the KJV Bible"),
                                 ("finetune_log.jsonl", "demo-finetune-loss.png",
                                  "Demo DiffusionGemma: fine-tuning to the prompt")):
        if not (BUILD / log_name).is_file():
            print(f"plot: no {BUILD / log_name}, {png} left as it is")
            continue
        recs = [json.loads(line) for line in (BUILD / log_name).read_text().splitlines()]
        fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
        trained = [r for r in recs if "train_loss" in r]
        ax.plot([r["step"] for r in trained], [r["train_loss"] for r in trained], label="train (EMA)")
        held = [r for r in recs if "held_out_loss" in r]
        ax.plot([r["step"] for r in held], [r["held_out_loss"] for r in held], "o-", label="held-out chapters")
        ax.set_xlabel("step")
        ax.set_ylabel("canvas cross-entropy (nats/token)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        out = ROOT / "docs" / png
        fig.savefig(out)
        plt.close(fig)
        print(f"plot: {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["prepare", "train", "finetune", "merge_parts", "export", "defaults", "evaluate",
                                      "plot", "all"])
    ap.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--data-seed", type=int, default=SEED,
                    help="train, finetune: seed of the batches and the noise (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--minutes", type=float, default=7.5,
                    help="training wall-time budget (the shipped model: 7.5 on one H100)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--init", default=None,
                    help="finetune: start from this checkpoint or GGUF (default: build/demo/ckpt.pt)")
    ap.add_argument("--ft-steps", type=int, default=450, help="finetune: steps")
    ap.add_argument("--ft-stop", type=int, default=None,
                    help="finetune: end after this many steps of the --ft-steps schedule (default: all of them)")
    ap.add_argument("--ft-batch", type=int, default=16, help="finetune: batch")
    ap.add_argument("--ft-lr", type=float, default=1.2e-3, help="finetune: peak learning rate")
    ap.add_argument("--ft-warmup", type=int, default=30, help="finetune: warm-up steps")
    ap.add_argument("--held-out", type=int, default=256, help="held-out examples for the held-out loss")
    ap.add_argument("--ckpt", default=None, help="export: the checkpoint (default: build/demo/ckpt_listen.pt)")
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
    stages = ["prepare", "train", "finetune", "export", "evaluate", "plot"] if args.stage == "all" else [args.stage]
    for s in stages:
        globals()[s](args)


if __name__ == "__main__":
    main()
