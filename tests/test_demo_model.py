"""The trained demo model (mlx_dgemma/data/, made by scripts/train_demo.py): shipped in the
published file's format, loaded by ``load_demo``, and a model that has learned something, so
that its entropy falls and its stop rule fires (the random demo's does neither)."""

import argparse
import json
import re
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from mlx_dgemma.convert.metadata import args_from_metadata, read_metadata
from mlx_dgemma.convert.source import open_gguf
from mlx_dgemma.loader import load, load_demo
from mlx_dgemma.schema import generation_defaults
from mlx_dgemma.convert.names import expected_tensors
from mlx_dgemma.demo import demo_file, trained_demo_path
from mlx_dgemma.errors import ParameterError
from mlx_dgemma.events import DoneEvent, StepEvent
from mlx_dgemma.generation import ChatSession
from mlx_dgemma.convert.tokenizer_data import SPECIALS
from tests.scripts import load_script

# The file's optional sampler keys and the generation parameters they set.
EB_KEYS = {"diffusion.eb_max_steps": "max_denoising_steps", "diffusion.eb_t_min": "t_min",
           "diffusion.eb_t_max": "t_max", "diffusion.eb_entropy_bound": "entropy_bound",
           "diffusion.eb_stability_threshold": "stability_threshold",
           "diffusion.eb_confidence_threshold": "confidence_threshold"}
HEADER = Path(__file__).resolve().parents[2] / "shared" / "reference" / \
    "diffusiongemma-26b-a4b-it-q4_k_m.header.json"
# Lines of the corpus (KJV) that the model saw; the continuation of Genesis 1:1 is 1:2.
GENESIS_1_1 = "In the beginning God created the heaven and the earth."
GENESIS_1_2 = ("And the earth was without form, and void; and darkness was upon the face of the deep. "
               "And the Spirit of God moved upon the face of the waters.")


@pytest.fixture(scope="module")
def demo():
    return load_demo()


@pytest.fixture(scope="module")
def reader():
    """The demo file's header as the converter reads it (tests/test_header.py holds that reading
    to gguf-py's)."""
    return open_gguf(trained_demo_path(), architecture=None)


def test_shipped_inside_the_package_and_small():
    path = trained_demo_path()
    assert path.is_file()
    assert path.parent.parent == Path(__import__("mlx_dgemma").__file__).parent
    assert path.stat().st_size <= 20 * 2**20


def test_file_has_the_published_metadata_keys_and_inventory(reader):
    md = read_metadata(reader)
    assert md["general.architecture"] == "diffusion-gemma"
    if HEADER.is_file():
        published = set(json.loads(HEADER.read_text())["metadata"])
        assert published <= set(md), sorted(published - set(md))
    cfg = args_from_metadata(md, vocab_size=len(md["tokenizer.ggml.tokens"]))
    assert "full_attention" in cfg.layer_types and "sliding_attention" in cfg.layer_types
    names = [t.name for t in reader.tensors]
    assert sorted(names) == sorted(e.name for e in expected_tensors(cfg))
    types = {t.tensor_type for t in reader.tensors}
    assert types <= {T.Q8_0, T.F32}
    assert T.Q8_0 in types


def test_tokenizer_is_gemma4_with_the_special_ids(demo):
    tok = demo.tokenizer
    assert tok.kind == "gemma4"
    for i, t in SPECIALS.items():
        assert tok.tokens[i] == t
    assert tok.tokens[108] == "<0x00>" and tok.tokens[363] == "<0xFF>"
    ids = tok.encode(GENESIS_1_2)
    assert tok.decode(ids) == GENESIS_1_2
    assert not any(108 <= i < 364 for i in ids)  # a corpus sentence needs no byte fallback
    assert len(ids) < len(GENESIS_1_2.split()) * 1.5  # real merges: ~1 token per word
    assert tok.decode(tok.encode("naïve café")) == "naïve café"  # byte fallback elsewhere
    assert tok.chat_template and "<|turn>" in tok.chat_template


def test_load_demo_kinds(demo, monkeypatch, tmp_path):
    assert demo.is_demo and demo.demo_kind == "trained"
    assert demo.model.args.canvas_length == 64 and demo.tokenizer.vocab_size == 4096
    monkeypatch.setenv("MLX_DGEMMA_CACHE", str(tmp_path))
    rnd = load_demo(kind="random")
    assert rnd.demo_kind == "random" and rnd.tokenizer.vocab_size != demo.tokenizer.vocab_size
    assert demo_file("random").parent == tmp_path
    with pytest.raises(ParameterError, match="demo kind 'bogus'"):
        load_demo(kind="bogus")


def test_load_exposes_the_files_sampler_defaults(demo, reader):
    """The file carries its own schedule in diffusion.eb_* keys; load() puts exactly those into
    the runtime's generation_config and the reference's defaults everywhere else."""
    rt = demo
    keys = {k: v for k, v in read_metadata(reader).items() if k.startswith("diffusion.eb_")}
    assert keys and set(keys) <= set(EB_KEYS), keys
    for key, name in EB_KEYS.items():
        want = keys.get(key, generation_defaults()[name])
        assert rt.generation_config[name] == pytest.approx(want), name


def test_defaults_stage_rewrites_only_the_sampler_keys(tmp_path, monkeypatch, reader):
    """scripts/train_demo.py's 'defaults' stage: new sampler keys reach load(), the tensor data
    stays byte for byte; rewritten back with the shipped values, the file is the shipped file."""
    script = load_script("scripts/train_demo.py")
    shipped = trained_demo_path()
    path = tmp_path / shipped.name
    shutil.copy(shipped, path)
    args = argparse.Namespace(output=str(path))
    monkeypatch.setattr(script, "SAMPLER_DEFAULTS", {"diffusion.eb_t_max": 0.3, "diffusion.eb_max_steps": 40})
    script.defaults(args)
    data = shipped.stat().st_size - reader.data_offset  # the tensor data: the file's tail
    assert path.read_bytes()[-data:] == shipped.read_bytes()[-data:]
    assert path.read_bytes() != shipped.read_bytes()
    gc = load(path, dtype=mx.float32).generation_config
    assert (gc["t_max"], gc["max_denoising_steps"]) == (pytest.approx(0.3), 40)
    assert gc["t_min"] == generation_defaults()["t_min"]  # dropped from the file: the reference's again
    monkeypatch.undo()
    script.defaults(args)
    assert path.read_bytes() == shipped.read_bytes()


def _canvas_loss(model, prompt_ids: list[int], clean: list[int], noisy: list[int]) -> tuple[float, float]:
    cache = model.make_cache()
    model.prefill(mx.array([prompt_ids], dtype=mx.int32), cache)
    logits = model.denoise(mx.array([noisy], dtype=mx.int32), cache)[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    nll = -mx.take_along_axis(logp, mx.array(clean)[:, None], axis=-1)[:, 0]
    ent = -mx.sum(mx.exp(logp) * logp, axis=-1)
    return float(nll.mean()), float(ent.mean())


def test_model_denoises_a_corpus_continuation(demo):
    """Half the canvas replaced by uniform noise: the trained model puts the clean tokens
    back far better than chance (ln 4096 = 8.3 nats)."""
    rt = demo
    model, tok = rt.model, rt.tokenizer
    from mlx_dgemma.chat_template import render_chat

    prompt = tok.encode(render_chat([{"role": "user", "content": GENESIS_1_1}], tok.chat_template))
    clean = tok.encode(GENESIS_1_2) + [106]
    clean += [0] * (64 - len(clean))
    rng = np.random.default_rng(0)
    noisy = np.where(rng.random(64) < 0.5, rng.integers(0, tok.vocab_size, 64), clean).tolist()
    nll, entropy = _canvas_loss(model, prompt, clean, noisy)
    assert nll < 2.0, nll
    assert entropy < 2.5, entropy


def test_entropy_falls_and_the_stop_rule_fires_over_two_turns(demo):
    """A two-turn chat with the file's sampler defaults (as the app runs it): in each turn's
    block the mean entropy drops below the confidence threshold, the stop rule ends the block
    well before the step limit, and the answer is made of words."""
    rt = demo
    model, tok = rt.model, rt.tokenizer
    session = ChatSession(rt)
    limit = rt.generation_config["max_denoising_steps"]
    for turn, prompt in enumerate([GENESIS_1_1, "And God said, Let there be light: and there was light."]):
        steps: list[StepEvent] = []
        done = None
        for ev in session.stream(prompt, seed=3 + turn, max_new_tokens=64):
            if isinstance(ev, StepEvent):
                steps.append(ev)
            elif isinstance(ev, DoneEvent):
                done = ev
        assert done is not None and done.finish_reason == "eos", (turn, done)
        assert steps[-1].stopped and len(steps) < limit / 2, (turn, len(steps))
        assert steps[-1].mean_entropy < 0.005 < steps[0].mean_entropy
        assert len(re.findall(r"[A-Za-z]+", done.text)) >= 5, done.text
    assert len(session.messages) == 4


# -- the fine-tuning that makes the demo listen (scripts/train_demo.py, benchmarks/listens.py) -----------

TOY_CHAPTERS = {
    ("Genesis", 1): [GENESIS_1_1, GENESIS_1_2, "And God said, Let there be light: and there was light."],
    ("Exodus", 14): ["And Moses stretched forth his hand over the sea; and the LORD caused the sea to go back.",
                     "And the children of Israel went into the midst of the sea upon the dry ground.",
                     "And the Egyptians pursued, and went in after them to the midst of the sea."],
    ("Psalms", 23): ["The LORD is my shepherd; I shall not want.",
                     "He maketh me to lie down in green pastures: he leadeth me beside the still waters.",
                     "He restoreth my soul: he leadeth me in the paths of righteousness for his name's sake."],
}


def test_listen_examples_answer_what_the_prompt_names_or_continue_it(demo, monkeypatch):
    """Every fine-tuning pair depends on its user turn: a question naming a word of the corpus
    is answered with a verse holding that word; the start of a verse with its rest (or the next
    verse); a follow-up holds a whole first exchange and asks again. Answers are canvas blocks
    (tokens, <turn|>, pads); held-out pairs answer from held-out chapters only."""
    from mlx_dgemma.chat_template import render_chat

    script = load_script("scripts/train_demo.py")
    monkeypatch.setattr(script, "LISTEN_EXAMPLES", 60)
    monkeypatch.setattr(script, "LISTEN_HELD_OUT", 20)
    tok = demo.tokenizer

    def block(text):
        ids = tok.encode(text) + [106]
        return ids + [0] * (64 - len(ids)) if len(ids) <= 64 else None

    held = {("Psalms", 23)}
    data = script.listen_examples(TOY_CHAPTERS, held, tok.encode, block,
                                  entities=(["Moses", "Israel", "LORD"], ["sea", "light", "soul"]))
    assert len(data["canvas"]) == 80 and data["held_out"].sum() == 20
    verses = [v for vs in TOY_CHAPTERS.values() for v in vs]
    user = re.compile(r"<\|turn>user\n(.*?)<turn\|>", re.S)
    kinds = set()
    for i in range(80):
        prefix = tok.decode(data["prefix"][data["offsets"][i]:data["offsets"][i + 1]].tolist())
        canvas = data["canvas"][i].tolist()
        assert 106 in canvas and set(canvas[canvas.index(106) + 1:]) <= {0}
        answer = tok.decode(canvas[:canvas.index(106)])
        asked = user.findall(prefix)
        assert asked and prefix.endswith(render_chat([{"role": "user", "content": asked[-1]}], tok.chat_template)
                                         .removeprefix("<bos>"))
        if len(asked) == 2:
            kinds.add("follow-up")
        q = asked[-1]
        if data["held_out"][i]:
            assert any(answer in v or v in answer for v in TOY_CHAPTERS[("Psalms", 23)]), answer
        named = [w for t in script.NAME_PROMPTS + script.THING_PROMPTS if (w := _filled(t, q))]
        if named and any(re.search(rf"\b{re.escape(w)}\b", answer) for w in named):
            kinds.add("about")
        elif any((q + " " + answer).startswith(v) or v.startswith(q + " " + answer.split()[0]) for v in verses):
            kinds.add("continue")
        else:
            raise AssertionError(f"{q!r} -> {answer!r}: neither names the word asked for nor continues a verse")
    assert kinds == {"about", "continue", "follow-up"}, kinds


def _filled(template: str, text: str) -> str | None:
    """The word ``template`` (one ``{}``) was filled with to give ``text``, else None."""
    head, tail = template.split("{}")
    if text.startswith(head) and text.endswith(tail) and len(text) > len(head) + len(tail):
        return text[len(head):len(text) - len(tail)]
    return None


def test_corrupt_keeps_the_tail_clean_as_the_samplers_canvases_have_it():
    """Fine-tuning's noise: at level 1 every position is noise, except, in the rows asked for,
    the tail from <turn|> on, which the sampler accepts first and so is clean from its second step."""
    torch = pytest.importorskip("torch")
    script = load_script("scripts/train_demo.py")
    clean = torch.tensor([[500] * 20 + [106] + [0] * 43] * 64)
    gen = torch.Generator().manual_seed(0)
    kept = script.corrupt(clean, torch.ones(64, 1), 4096, gen, tail_clean=1.0)
    assert torch.equal(kept[:, 20:], clean[:, 20:])
    assert (kept[:, :20] != 500).float().mean() > 0.99
    noised = script.corrupt(clean, torch.ones(64, 1), 4096, gen, tail_clean=0.0)
    assert (noised[:, 20:] != clean[:, 20:]).float().mean() > 0.99
    half = script.corrupt(clean, torch.ones(64, 1), 4096, gen, tail_clean=0.5)
    rows_kept = torch.all(half[:, 20:] == clean[:, 20:], dim=1).float().mean()
    assert 0.25 < rows_kept < 0.75


def test_listens_overlap_figures():
    """benchmarks/listens.py: answers that ignore the prompt (one text per seed) overlap fully
    across prompts and not at all across seeds; answers fixed by the prompt, the reverse."""
    listens = load_script("benchmarks/listens.py")
    word = re.compile(r"[A-Za-z]+")
    texts = ["alpha beta gamma", "delta epsilon zeta", "eta theta iota"]
    deaf = {(p, s): texts[s] for p in range(3) for s in range(3)}
    r = listens.overlap(deaf, word)
    assert (r["across_prompts_same_seed"], r["same_prompt_across_seeds"]) == (1.0, 0.0)
    assert r["prompts_sharing_last_words_per_seed"] == {0: 3, 1: 3, 2: 3}
    listening = {(p, s): texts[p] for p in range(3) for s in range(3)}
    r = listens.overlap(listening, word)
    assert (r["across_prompts_same_seed"], r["same_prompt_across_seeds"]) == (0.0, 1.0)
    assert listens.jaccard({"a", "b"}, {"b", "c"}) == pytest.approx(1 / 3)


@pytest.mark.slow
def test_finetune_stop_cuts_the_schedule_and_keeps_its_learning_rates(tmp_path, monkeypatch):
    """``finetune --ft-stop N`` (how the shipped stage 1 was cut) ends after N steps with the
    learning rates of the whole ``--ft-steps`` schedule, and saves that step's checkpoint; without
    it the run goes to the end of its schedule."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    script = load_script("scripts/train_demo.py")
    monkeypatch.setattr(script, "BUILD", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"text_config": script.text_config(), "canvas_length": 64}))
    rng = np.random.default_rng(0)
    canvas = rng.integers(364, 4096, (8, 64)).astype(np.int32)
    canvas[:, 20], canvas[:, 21:] = 106, 0
    np.savez(tmp_path / "listen.npz", prefix=rng.integers(364, 4096, 8 * 6).astype(np.int32),
             offsets=np.arange(0, 8 * 6 + 1, 6, dtype=np.int64), canvas=canvas,
             held_out=np.array([False] * 6 + [True] * 2))

    real_fit = script.fit  # from random weights: the test has no base checkpoint to start from
    monkeypatch.setattr(script, "fit", lambda a, **kw: real_fit(a, **{**kw, "init": None}))

    def run(stop):
        args = argparse.Namespace(init=None, ft_steps=6, ft_lr=1e-3, ft_warmup=1, ft_batch=2, ft_stop=stop,
                                  threads=1, device="cpu", held_out=2, log_every=1, eval_every=0, out=None)
        script.finetune(args)
        return [json.loads(line) for line in (tmp_path / "finetune_log.jsonl").read_text().splitlines()]

    full, cut = run(None), run(3)
    assert [r["step"] for r in full if "lr" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in cut if "lr" in r] == [1, 2, 3] and cut[-1]["final"] and cut[-1]["step"] == 3
    assert [r["lr"] for r in cut if "lr" in r] == [r["lr"] for r in full if "lr" in r][:3]
    assert torch.load(tmp_path / "ckpt_listen.pt")["step"] == 3
