"""Tokenizer from GGUF metadata (``tokenizer_gguf.json`` as ``convert`` saves it).

Two vocabulary types are supported:

* ``gemma4``: BPE with the file's merges, byte fallback, spaces written as U+2581 and no
  pre-tokenizer split (Gemma 4 / DiffusionGemma files);
* ``llama`` (SentencePiece BPE of Gemma 3-style files): the file has no merges, so they are
  recovered from the vocabulary order, and tokens made only of spaces are respelled.

Control tokens (type 3) are special and user-defined tokens (type 4) stay whole, as
llama.cpp and transformers' GGUF loader treat them. The backend is the ``tokenizers``
library (already installed with mlx-lm); tests compare against transformers' own loader.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer as _Backend, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from .errors import ModelFilesError, ParameterError
from .validate import check_tokenizer_data, read_json

CONTROL, USER_DEFINED = 3, 4
_SPACE = "\u2581"


def merges_from_vocab(tokens: Sequence[str]) -> list[tuple[str, str]]:
    """Merges implied by a merge-less SentencePiece BPE vocabulary, best first.

    Gemma's scores do not follow its merge order; the order of the tokens in the file does,
    so a token's rank (earlier = better) orders the merges that build it (as transformers'
    ``generate_merges`` with scores = -index).
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    ranks = {t: i for i, t in enumerate(tokens)}  # a repeated token keeps its last rank
    merges = []
    for token, rank in ranks.items():
        local = [(token[:k], token[k:]) for k in range(1, len(token))
                 if token[:k] in vocab and token[k:] in vocab]
        local.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        merges.extend((left, right, rank) for left, right in local)
    merges.sort(key=lambda m: (-m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def check_text(text: str, name: str = "prompt") -> None:
    """Text must be encodable UTF-8: undecodable bytes (argv, files) arrive as lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start].encode("utf-8", "surrogateescape")
        raise ParameterError(f"{name}: not valid UTF-8 (byte {bad!r} at character {e.start}); give the "
                             "text in UTF-8", param=name, rule="UTF-8 text") from None


class Tokenizer:
    """Encode/decode, the special (control) ids, and a token's piece for the canvas view."""

    def __init__(self, data: dict[str, Any], chat_template: str | None = None, source: str = "tokenizer data"):
        check_tokenizer_data(data, source)  # types, ids in range, merges of known tokens
        kind = data.get("tokenizer.ggml.model")
        tokens: list[str] = list(data["tokenizer.ggml.tokens"])
        types: list[int] = list(data.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        if kind == "llama":
            tokens = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
            merges = merges_from_vocab(tokens)
        elif kind == "gemma4":
            merges = [tuple(m.split(" ", 1)) for m in data.get("tokenizer.ggml.merges", [])]
        else:
            raise ModelFilesError(f"tokenizer type {kind!r} is not supported (expected 'gemma4' or 'llama')")
        self.kind = kind
        self.vocab_size = len(tokens)
        self.tokens = tokens
        self.bos_id = int(data.get("tokenizer.ggml.bos_token_id", 2))
        self.chat_template = chat_template
        # the named special tokens stay whole (generation reads eos/pad/mask from the model's configs)
        unk_id = int(data.get("tokenizer.ggml.unknown_token_id", 3))
        named = {unk_id, self.bos_id, int(data.get("tokenizer.ggml.eos_token_id", 1)),
                 int(data.get("tokenizer.ggml.padding_token_id", 0)), int(data.get("tokenizer.ggml.mask_token_id", 4))}
        vocab = {t: i for i, t in enumerate(tokens)}
        try:
            backend = _Backend(BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token=tokens[unk_id],
                                   byte_fallback=True, dropout=None))
        except Exception as e:  # the tokenizers backend raises its own exception type
            raise ModelFilesError(f"{source}: the tokenizer cannot be built ({e}); convert the model again") from None
        backend.normalizer = normalizers.Replace(" ", _SPACE)
        backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous")
        backend.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(),
                                             decoders.Fuse()])
        special = [t for i, (t, ty) in enumerate(zip(tokens, types)) if ty == CONTROL or i in named]
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
        user = [t for t, ty in zip(tokens, types) if ty == USER_DEFINED]
        if user:
            backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
        self._backend = backend
        self.special_ids = frozenset(vocab[t] for t in special)

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        f = path / "tokenizer_gguf.json"
        if not f.is_file():
            raise ModelFilesError(f"{path}: tokenizer_gguf.json is missing; convert the model again")
        tmpl = path / "chat_template.jinja"
        return cls(read_json(f), tmpl.read_text(encoding="utf-8") if tmpl.is_file() else None, source=str(f))

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        check_text(text)
        ids = self._backend.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token adds to decoded text (a byte-fallback token ``<0xNN>``: that byte)."""
        t = self.tokens[token_id]
        if t.startswith("<0x") and t.endswith(">") and len(t) == 6:
            return bytes([int(t[3:5], 16)])
        return t.replace(_SPACE, " ").encode("utf-8")

    def piece(self, token_id: int) -> str:
        """How one token reads on its own (for the canvas view): bytes and U+2581 resolved."""
        t = self.tokens[token_id] if 0 <= token_id < self.vocab_size else "?"
        if t.startswith("<0x") and t.endswith(">") and len(t) == 6:
            b = int(t[3:5], 16)
            return chr(b) if 32 <= b < 127 else f"\\x{b:02x}"
        return t.replace(_SPACE, " ")
