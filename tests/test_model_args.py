"""ModelArgs' fields declare their GGUF key, kind, range and rules once (``schema.ArgSpec``): the GGUF
reader, the GGUF's checks and config.json's validation all take them from there (issue 34, item 4)."""

from __future__ import annotations

import copy
import json
import sys
from dataclasses import dataclass

import pytest

from mlx_dgemma.convert import GGUFSource
from mlx_dgemma.convert.synthetic import TinySpec, write_tiny_gguf
from mlx_dgemma.errors import ModelArgsError, ModelFilesError
from mlx_dgemma.schema import ArgSpec, ModelArgs, arg, arg_specs
from mlx_dgemma.validate import check_config

P = "diffusion-gemma."


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> dict:
    src = write_tiny_gguf(tmp_path_factory.mktemp("args") / "m.gguf", TinySpec(), types="f32")
    with GGUFSource(src) as s:
        return s.config({})


def gguf_error(tmp_path, **metadata) -> str:
    """The one-line error of opening a tiny GGUF whose metadata holds ``metadata``."""
    src = write_tiny_gguf(tmp_path / "m.gguf", BrokenSpec(extra_metadata=metadata), types="f32")
    with pytest.raises(ModelFilesError) as e:
        GGUFSource(src)
    return str(e.value)


def config_error(config: dict, top: dict | None = None, **text_config) -> str:
    cfg = copy.deepcopy(config)
    cfg.update(top or {})
    cfg["text_config"].update(text_config)
    with pytest.raises(ModelFilesError) as e:
        check_config(cfg, "m/config.json")
    return str(e.value)


class BrokenSpec(TinySpec):
    """The default tiny model's tensors, its metadata edited by ``extra_metadata``."""

    def text_config(self):
        return TinySpec().text_config()

    def metadata(self) -> dict:  # a key given as None is left out
        return {k: v for k, v in super().metadata().items() if v is not None}


@pytest.mark.parametrize("key, field, value", [
    (P + "attention.sliding_window", "sliding_window", 0),
    (P + "embedding_length", "hidden_size", 1 << 21),
    (P + "attention.layer_norm_rms_epsilon", "rms_norm_eps", 2.0),
    (P + "final_logit_softcapping", "final_logit_softcapping", 0.0),
])
def test_a_fields_range_is_said_in_the_same_words_for_a_gguf_and_a_directory(tmp_path, config, key, field, value):
    rule = arg_specs()[field].rule
    assert gguf_error(tmp_path, **{key: value}).endswith(
        f"{key} = {value!r}: expected {rule}; the file is not a valid DiffusionGemma GGUF")
    assert config_error(config, **{field: value}) == \
        f"m/config.json: text_config.{field} = {value!r}: expected {rule}; convert the model again"


def test_the_rules_between_fields_name_each_sources_keys(tmp_path, config):
    # one rule text (ModelArgs.check), each front end naming the fields its way
    assert "expert_used_count = 9: expected at most expert_count = 8;" in gguf_error(
        tmp_path, **{P + "expert_used_count": 9})
    assert "text_config.top_k_experts = 9: expected at most num_experts = 8;" in config_error(config, top_k_experts=9)
    assert "head_count_kv = [3, 3, 1]: expected a divisor of head_count = 2;" in gguf_error(
        tmp_path, **{P + "attention.head_count_kv": [3, 3, 1]})
    assert "text_config.num_key_value_heads = 3: expected a divisor of num_attention_heads = 2;" in \
        config_error(config, num_key_value_heads=3)
    assert "text_config.eos_token_id = 512: expected at most 511, below vocab_size = 512 (a token id" \
        in config_error(config, eos_token_id=512)
    absent = gguf_error(tmp_path, **{P + "context_length": 100, "diffusion.canvas_length": None})
    assert "diffusion.canvas_length = 256 (absent: the default): expected at most 99, below " \
           "diffusion-gemma.context_length = 100 (a canvas" in absent


def test_a_value_inside_a_field_is_named_by_its_path(config):
    cfg = copy.deepcopy(config)
    cfg["text_config"]["rope_parameters"]["full_attention"]["partial_rotary_factor"] = 2
    with pytest.raises(ModelFilesError, match=r"^m/config.json: text_config\.rope_parameters\.full_attention\."
                                              r"partial_rotary_factor = 2: expected a number in \(0, 1\]; "):
        check_config(cfg, "m/config.json")


def test_a_wrong_layer_type_is_named_by_its_index_and_a_missing_text_config_as_missing(config):
    n = config["text_config"]["num_hidden_layers"]
    types = list(config["text_config"]["layer_types"])
    types[n - 1] = "weird"
    assert config_error(config, layer_types=types) == (
        f"m/config.json: text_config.layer_types[{n - 1}] = 'weird': expected 'sliding_attention' or "
        "'full_attention'; convert the model again")
    # the count is still the list's rule
    short = config_error(config, layer_types=["sliding_attention"])
    assert f"text_config.layer_types = ['sliding_attention']: expected {n} entries of" in short
    assert short.endswith(", one a layer (it has 1); convert the model again"), short
    cfg = copy.deepcopy(config)
    del cfg["text_config"]
    with pytest.raises(ModelFilesError, match=r"^m/config.json: text_config is missing \(the model's shape\); "
                                              r"convert the model again$"):
        check_config(cfg, "m/config.json")


def test_a_null_softcap_is_refused_before_the_model_divides_by_it(config):
    # before: "a number > 0 or null" passed null, and the output head computed x / None
    assert "text_config.final_logit_softcapping = None: expected a finite number" in config_error(
        config, final_logit_softcapping=None)


def test_check_names_the_field_and_takes_the_sources_names(config):
    args = ModelArgs.from_config(config)
    args.check()  # a converted config is valid
    bad = ModelArgs.from_config({**config, "text_config": {**config["text_config"], "num_experts": 1}})
    with pytest.raises(ModelArgsError) as e:
        bad.check(lambda f: f"<{f}>")
    assert (e.value.field, e.value.name, e.value.rule, e.value.value) == \
        ("top_k_experts", "<top_k_experts>", "at most <num_experts> = 1", 2)


def test_a_mistyped_declaration_fails_at_once():
    with pytest.raises(ValueError, match="read is one of value, sliding"):
        ArgSpec("int", 1, 2, gguf="x", read="per_layer")


def test_a_new_field_is_its_declaration(tmp_path, config, monkeypatch):
    """The count in docs/architecture.md ("new config field: 2 edits / 2 files"): a field declared
    with its GGUF key and range, and nothing else, is read from the GGUF, written to config.json,
    read back for the model, and refused out of range by both front ends in the same words."""
    key = P + "attn_logit_softcapping"

    @dataclass(kw_only=True)
    class WithNew(ModelArgs):
        attn_logit_softcapping: float = arg(ArgSpec("float", 1.0, 100.0, gguf=key, required=False), 50.0)

    for module in list(sys.modules.values()):  # every module that took ModelArgs by name
        if vars(module).get("ModelArgs") is ModelArgs:
            monkeypatch.setattr(module, "ModelArgs", WithNew)
    src = write_tiny_gguf(tmp_path / "new.gguf", TinySpec(extra_metadata={key: 20.0}), types="f32")
    with GGUFSource(src) as s:
        cfg = json.loads(json.dumps(s.config({})))  # as config.json holds it
    assert cfg["text_config"]["attn_logit_softcapping"] == 20.0
    check_config(cfg, "m/config.json")
    assert WithNew.from_config(cfg).attn_logit_softcapping == 20.0  # what the model is built from
    with GGUFSource(write_tiny_gguf(tmp_path / "absent.gguf", TinySpec(), types="f32")) as s:
        assert s.args.attn_logit_softcapping == 50.0  # absent: the default
    rule = "a finite number in [1, 100]"
    assert gguf_error(tmp_path, **{key: 500.0}).endswith(f"{key} = 500.0: expected {rule}; the file is not a valid "
                                                         "DiffusionGemma GGUF")
    assert config_error(cfg, attn_logit_softcapping=500.0).endswith(
        f"text_config.attn_logit_softcapping = 500.0: expected {rule}; convert the model again")
