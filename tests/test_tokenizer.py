"""Our tokenizer against transformers' own GGUF tokenizer loader, on the real Gemma 3 file
(SentencePiece ``llama`` type) and on a synthetic ``gemma4`` BPE file with merges."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_dgemma.convert.source import open_gguf, tokenizer_payload
from mlx_dgemma.tokenizer import Tokenizer

gguf_tok = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping",
                               reason="transformers' GGUF tokenizer loader (transformers >= 5.23)")

TEXTS = [
    "Hello world!", "  leading spaces and   runs of them", "Why is the sky blue?\nBecause...",
    "<|turn>user\nhi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>", "emoji 🤖 and ünïcödé, 中文字符",
    "tabs\tand\nnewlines\n\n", "<bos>x<eos>", "", " ", "a<custom_marker>b <custom_marker>",
    "The quick brown fox jumps over the lazy dog. Diffusion models denoise tokens.",
    "numbers 0123456789 (a, b); c - d?", "\u2581literal U+2581", "<mask><unk><pad>",
]


def reference(path: Path):
    arch, tok_dict, _ = gguf_tok.get_gguf_tokenizer(str(path))
    backend, _ = gguf_tok.convert_gguf_tokenizer(arch, tok_dict)
    return backend


def check_same(ours: Tokenizer, ref, texts):
    for text in texts:
        want = ref.encode(text, add_special_tokens=False).ids
        got = ours.encode(text)
        assert got == want, text
        assert ours.decode(got) == ref.decode(want, skip_special_tokens=False), text
        assert ours.decode(got, skip_special=True) == ref.decode(want, skip_special_tokens=True), text


def test_gemma4_bpe_matches_transformers(tiny_gguf):
    ours = Tokenizer(tokenizer_payload(open_gguf(tiny_gguf)))
    assert ours.kind == "gemma4"
    check_same(ours, reference(tiny_gguf), TEXTS)
    # special and user-defined tokens stay whole
    assert ours.encode("<|turn>") == [105] and ours.encode("<turn|>") == [106]
    assert ours.encode("<custom_marker>") == [90]
    assert ours.encode("x", add_bos=True) == [2, *ours.encode("x")]


def test_tokenizer_from_converted_dir(tiny_model_dir, tiny_gguf):
    a = Tokenizer.from_dir(tiny_model_dir)
    b = Tokenizer(tokenizer_payload(open_gguf(tiny_gguf)))
    assert a.chat_template and "<|turn>" in a.chat_template
    for text in TEXTS:
        assert a.encode(text) == b.encode(text)


@pytest.fixture(scope="module")
def gemma3_path(gemma3_gguf):
    return gemma3_gguf


def test_gemma3_sentencepiece_matches_transformers(gemma3_path):
    ours = Tokenizer(tokenizer_payload(open_gguf(gemma3_path, architecture=None)))  # any GGUF's tokenizer
    assert ours.kind == "llama" and ours.vocab_size == 262144
    check_same(ours, reference(gemma3_path), TEXTS + ["<start_of_turn>user\nhello<end_of_turn>\n"])
