"""Qwen3Config: presets against the published configs, HF config.json I/O, validation."""

import dataclasses
import json

import jax
import numpy as np
import pytest
import torch
import transformers

from mgrpo_jax import models
from mgrpo_jax.models import ConfigError, Qwen3Config

# Numbers copied from each release's config.json on the Hub (all: vocab 151936, head_dim
# 128, 8 kv heads, rope_theta 1e6, rms_norm_eps 1e-6, 40960 positions) and the total /
# non-embedding parameter counts (billions, as printed) stated on the model cards.
PUBLISHED = {
    # name: (hidden, intermediate, layers, heads, kv, tied, total_b, non_embedding_b)
    "qwen3_0p6b": (1024, 3072, 28, 16, 8, True, "0.6", "0.44"),
    "qwen3_1p7b": (2048, 6144, 28, 16, 8, True, "1.7", "1.4"),
    "qwen3_4b": (2560, 9728, 36, 32, 8, True, "4.0", "3.6"),
    "qwen3_8b": (4096, 12288, 36, 32, 8, False, "8.2", "6.95"),
    "qwen3_14b": (5120, 17408, 40, 40, 8, False, "14.8", "13.2"),
    "qwen3_32b": (5120, 25600, 64, 64, 8, False, "32.8", "31.2"),
}

# Qwen/Qwen3-0.6B config.json as published (transformers 4.51 era: rope_theta at the top).
QWEN3_0P6B_CONFIG_JSON = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_match_published_configs(name):
  hidden, inter, layers, heads, kv, tied, _, _ = PUBLISHED[name]
  c = models.get_preset(name)
  assert (c.hidden_size, c.intermediate_size, c.num_layers) == (hidden, inter, layers)
  assert (c.num_heads, c.num_kv_heads, c.head_dim) == (heads, kv, 128)
  assert c.tie_embeddings == tied
  assert (c.vocab_size, c.rope_theta, c.rms_norm_eps) == (151936, 1e6, 1e-6)
  assert c.max_position_embeddings == 40960


def _half_last_digit(number: str) -> float:
  return 0.5 * 10.0**-len(number.partition(".")[2])


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_num_params_matches_model_cards_and_transformers(name):
  *_, total_b, non_embedding_b = PUBLISHED[name]
  c = models.get_preset(name)
  n = c.num_params()
  embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_embeddings else 2)
  # The cards round: allow half a unit in the last digit they print.
  assert n / 1e9 == pytest.approx(float(total_b), abs=_half_last_digit(total_b))
  assert (n - embeddings) / 1e9 == pytest.approx(float(non_embedding_b),
                                                 abs=_half_last_digit(non_embedding_b))
  # Exact count of transformers' own model, built on the meta device (no memory).
  with torch.device("meta"):
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**c.to_hf_dict()))
  assert n == sum(p.numel() for p in hf.parameters())


def test_num_params_0p6b_is_about_0p6b():
  n = models.get_preset("qwen3_0p6b").num_params()
  assert 0.5e9 < n < 0.8e9  # Counting the tied embedding twice would give 0.75e9.
  assert n == 596_049_920


@pytest.mark.parametrize("tie", [True, False])
def test_num_params_counts_the_parameter_state(tie):
  c = models.get_preset("tiny", tie_embeddings=tie)
  sizes = [int(np.prod(x.shape)) for x in jax.tree.leaves(models.abstract_params(c))]
  assert c.num_params() == sum(sizes)


def test_published_config_json_gives_the_preset():
  c = Qwen3Config.from_hf_dict(QWEN3_0P6B_CONFIG_JSON)
  assert c == models.get_preset("qwen3_0p6b", param_dtype="bfloat16")


def test_from_hf_json_reads_a_file(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(QWEN3_0P6B_CONFIG_JSON))
  assert Qwen3Config.from_hf_json(str(tmp_path)) == Qwen3Config.from_hf_json(
      str(tmp_path / "config.json"))
  assert Qwen3Config.from_hf_json(str(tmp_path)).num_layers == 28


def test_rope_theta_from_transformers5_rope_parameters():
  hf = dict(QWEN3_0P6B_CONFIG_JSON)
  del hf["rope_theta"], hf["rope_scaling"]
  hf["rope_parameters"] = {"rope_theta": 250000.0, "rope_type": "default"}
  assert Qwen3Config.from_hf_dict(hf).rope_theta == 250000.0
  # And what transformers 5 itself writes.
  written = transformers.Qwen3Config(rope_theta=123456.0, head_dim=64).to_dict()
  assert "rope_theta" not in written  # Guard: this really is the new layout.
  assert Qwen3Config.from_hf_dict(written).rope_theta == 123456.0


def test_rope_theta_top_level():
  hf = dict(QWEN3_0P6B_CONFIG_JSON, rope_theta=5e5)
  assert Qwen3Config.from_hf_dict(hf).rope_theta == 5e5


@pytest.mark.parametrize("config", [
    models.get_preset("tiny"),
    models.get_preset("qwen3_8b"),
    models.get_preset("qwen3_0p6b", param_dtype="bfloat16"),
    Qwen3Config(vocab_size=131,
                hidden_size=46,
                intermediate_size=58,
                num_layers=3,
                num_heads=6,
                num_kv_heads=3,
                head_dim=14,
                rope_theta=12345.0,
                rms_norm_eps=1e-5,
                max_position_embeddings=777),
])
def test_to_hf_dict_round_trip(config):
  hf = config.to_hf_dict()
  assert Qwen3Config.from_hf_dict(json.loads(json.dumps(hf))) == config
  # transformers reads the same architecture from it.
  t = transformers.Qwen3Config(**hf)
  assert (t.num_attention_heads, t.num_key_value_heads,
          t.head_dim) == (config.num_heads, config.num_kv_heads, config.head_dim)
  assert t.rope_parameters["rope_theta"] == config.rope_theta
  assert t.tie_word_embeddings == config.tie_embeddings


@pytest.mark.parametrize("field, value", [
    ("rope_scaling", {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768
    }),
    ("rope_scaling", {
        "type": "dynamic",
        "factor": 2.0
    }),
    ("rope_parameters", {
        "rope_type": "linear",
        "factor": 2.0,
        "rope_theta": 1e6
    }),
])
def test_unsupported_rope_scaling_raises(field, value):
  hf = dict(QWEN3_0P6B_CONFIG_JSON, **{field: value})
  kind = value.get("rope_type") or value.get("type")
  with pytest.raises(ConfigError, match=rf"rope.*{kind}"):
    Qwen3Config.from_hf_dict(hf)


@pytest.mark.parametrize("update, message", [
    ({
        "model_type": "llama"
    }, r"model_type='llama'"),
    ({
        "attention_bias": True
    }, r"attention_bias"),
    ({
        "hidden_act": "gelu"
    }, r"hidden_act='gelu'"),
    ({
        "use_sliding_window": True
    }, r"use_sliding_window"),
    ({
        "num_key_value_heads": 5
    }, r"num_heads=16 .*num_kv_heads=5"),
    ({
        "head_dim": 127
    }, r"head_dim=127"),
    ({
        "hidden_size": 0
    }, r"hidden_size"),
])
def test_unsupported_or_bad_fields_raise(update, message):
  with pytest.raises(ConfigError, match=message):
    Qwen3Config.from_hf_dict(dict(QWEN3_0P6B_CONFIG_JSON, **update))


@pytest.mark.parametrize("field", ["vocab_size", "num_hidden_layers", "num_attention_heads"])
def test_missing_required_field_is_named(field):
  hf = dict(QWEN3_0P6B_CONFIG_JSON)
  del hf[field]
  with pytest.raises(ConfigError, match=field):
    Qwen3Config.from_hf_dict(hf)


def test_from_hf_json_errors_name_the_file(tmp_path):
  path = tmp_path / "config.json"
  path.write_text("[1, 2]")
  with pytest.raises(ConfigError, match=r"config\.json.*JSON object"):
    Qwen3Config.from_hf_json(str(path))
  path.write_text(json.dumps(dict(QWEN3_0P6B_CONFIG_JSON, num_hidden_layers="many")))
  with pytest.raises(ConfigError, match=r"config\.json.*num_hidden_layers"):
    Qwen3Config.from_hf_json(str(path))


def test_config_is_frozen_and_hashable():
  c = models.get_preset("tiny")
  assert hash(c) == hash(models.get_preset("tiny"))
  with pytest.raises(dataclasses.FrozenInstanceError):
    c.num_layers = 3  # type: ignore[misc]
  assert c.replace(num_layers=3).num_layers == 3 and c.num_layers == 2


def test_bad_dtype_and_unknown_preset():
  with pytest.raises(ConfigError, match=r"param_dtype='int8'"):
    models.get_preset("tiny", param_dtype="int8")
  with pytest.raises(ConfigError, match=r"qwen3_7b"):
    models.get_preset("qwen3_7b")
