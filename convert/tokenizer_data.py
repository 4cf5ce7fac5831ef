"""A small synthetic ``gemma4`` vocabulary (tests and the demo model).

Special tokens sit at the ids the published DiffusionGemma tokenizer uses; the rest is a
byte-fallback BPE vocabulary trained on a short built-in text, so that encoding real text
exercises merges, byte fallback and special-token splitting.
"""

from __future__ import annotations

from collections import Counter

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPECIALS: dict[int, str] = {
    0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>",
    46: "<|tool>", 47: "<tool|>", 48: "<|tool_call>", 49: "<tool_call|>", 50: "<|tool_response>",
    51: "<tool_response|>", 52: '<|"|>', 98: "<|think|>", 100: "<|channel>", 101: "<channel|>",
    105: "<|turn>", 106: "<turn|>",
}
N_RESERVED = 108  # ids below this are special or unused placeholders

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Diffusion models denoise a canvas of tokens "
    "step by step, accepting the most confident positions first. Why is the sky blue? Because "
    "air scatters short wavelengths of sunlight more than long ones. Hello world! This is a "
    "tiny test of the tokenizer, with numbers 0123456789 and punctuation: (a, b); c - d? "
    "user model thought answer the of and to in is that for it with as on be at by this"
)


def _train_merges(text: str, n_merges: int) -> tuple[list[str], list[str]]:
    """Plain BPE over words (space written as U+2581 and kept at the word start)."""
    words = Counter("\u2581" + w if i else w for i, w in enumerate(text.split(" ")))
    seqs = {w: list(w) for w in words}
    alphabet = sorted({c for w in words for c in w})
    merges: list[str] = []
    tokens: list[str] = list(alphabet)
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for w, n in words.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += n
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        for w in words:
            s, out, i = seqs[w], [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return tokens, merges


def synthetic_gemma4_vocab(vocab_size: int) -> dict:
    """GGUF tokenizer metadata (``tokenizer.ggml.*``) for a ``vocab_size``-token vocabulary."""
    if vocab_size < N_RESERVED + 256 + 32:
        raise ValueError(f"vocab_size must be at least {N_RESERVED + 256 + 32}")
    tokens = [f"<unused{i}>" for i in range(N_RESERVED)]
    types = [UNUSED] * N_RESERVED
    for i, t in SPECIALS.items():
        tokens[i] = t
        types[i] = CONTROL
    types[3] = UNKNOWN
    tokens[90], types[90] = "<custom_marker>", USER_DEFINED  # user-defined: must stay whole
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE] * 256
    room = vocab_size - len(tokens)
    pieces, merges = _train_merges(_CORPUS, room)
    pieces = pieces[:room]
    tokens += pieces
    types += [NORMAL] * len(pieces)
    keep = set(pieces)
    merges = [m for m in merges if m.replace(" ", "") in keep]
    while len(tokens) < vocab_size:
        tokens.append(f"<unused{len(tokens)}>")
        types.append(UNUSED)
    return {
        "tokenizer.ggml.model": "gemma4",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * vocab_size,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.mask_token_id": 4,
        "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.ggml.add_bos_token": True,
    }
