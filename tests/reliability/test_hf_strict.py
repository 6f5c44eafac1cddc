"""HF checkpoints are read strictly: typed config.json, only named files, float weights."""

import json
import os
import shutil
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mgrpo_jax import models
from mgrpo_jax.models import safetensors_io

CFG = models.get_preset("tiny", tie_embeddings=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """An untied tiny checkpoint, single-file and sharded, and its parameters."""
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda x: jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype),
                        models.abstract_params(CFG))
  root = tmp_path_factory.mktemp("hf")
  models.save_hf(str(root / "single"), CFG, params)
  models.save_hf(str(root / "sharded"), CFG, params, max_shard_bytes=64 << 10)
  return root, params


@pytest.fixture
def single(saved, tmp_path):
  shutil.copytree(saved[0] / "single", tmp_path / "ckpt")
  return tmp_path / "ckpt"


def _read_all(path):
  f = safetensors_io.SafetensorsFile(str(path / "model.safetensors"))
  return {n: np.array(f.read(n)) for n in f.names()}


def _edit_config(path, **fields):
  hf = json.loads((path / "config.json").read_text())
  hf.update(fields)
  (path / "config.json").write_text(json.dumps(hf))


def test_string_false_is_not_true(single):
  _edit_config(single, tie_word_embeddings="false")
  with pytest.raises(models.ConfigError, match="tie_word_embeddings"):
    models.load_hf(str(single))


def test_stray_safetensors_file_overrides_nothing(single, saved):
  tensors = {n: np.full_like(a, 7.0) for n, a in _read_all(single).items()}
  safetensors_io.write(str(single / "zz-extra.safetensors"), tensors)
  _, params = models.load_hf(str(single))
  np.testing.assert_array_equal(np.asarray(params["embed"][...]),
                                np.asarray(saved[1]["embed"][...]))


def test_index_pointing_outside_the_directory_is_refused(saved, tmp_path):
  ckpt = tmp_path / "inside" / "ckpt"
  shutil.copytree(saved[0] / "sharded", ckpt)
  index = json.loads((ckpt / "model.safetensors.index.json").read_text())
  shard = sorted(set(index["weight_map"].values()))[0]
  shutil.move(str(ckpt / shard), str(tmp_path / "inside" / shard))  # Now outside ckpt.
  index["weight_map"] = {n: (f"../{f}" if f == shard else f)
                         for n, f in index["weight_map"].items()}
  (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(models.CheckpointError, match=r"\.\./"):
    models.load_hf(str(ckpt))


def test_integer_tensor_for_a_float_weight_is_refused(single):
  tensors = _read_all(single)
  name = "model.layers.0.mlp.up_proj.weight"
  tensors[name] = (tensors[name] * 100).astype(np.int32)
  safetensors_io.write(str(single / "model.safetensors"), tensors)
  with pytest.raises(models.CheckpointError, match=f"{name}.*I32"):
    models.load_hf(str(single))


def test_huge_sizes_fail_by_name_before_allocating(single):
  _edit_config(single, num_hidden_layers=1_000_000)
  tracemalloc.start()
  try:
    with pytest.raises(models.ConfigError, match="num_hidden_layers"):
      models.load_hf(str(single))
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert peak < 16 << 20, peak  # At 2819582: 2.3 GB of per-layer names first.


def test_model_vocabulary_smaller_than_the_tokenizer_is_named():
  with pytest.raises(models.ConfigError, match=r"vocab_size=300.*vocab_size=384"):
    models.check_vocab_size(300, 384)
  models.check_vocab_size(384, 384)
