"""HF checkpoint I/O: save/load both ways with transformers, sharding, and malformed input."""

import copy
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from flax import nnx
from jax.sharding import PartitionSpec as P

from mgrpo_jax import models, sharding

LENGTHS = (11, 4, 8, 1)
SEQ_LEN = 11

_jit_logits = jax.jit(models.logits, static_argnums=0)


@pytest.fixture(scope="module")
def ckpt(h, hf_checkpoints):
  """(dir, torch model, config, params) of the single-file SHARDABLE checkpoint."""
  path, model = hf_checkpoints(h.SHARDABLE)
  return (path, model, *models.load_hf(path))


def _pure(params):
  return jax.tree.map(np.asarray, nnx.to_pure_dict(params))


def _assert_trees_equal(a, b):
  a, b = _pure(a), _pure(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape, path
    np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


def _random_params(config, seed):
  """Params drawn in NumPy, independent of any HF checkpoint: matrices N(0, 0.2^2),
  norm scales 1 + 0.1 N(0, 1), so the save path is tested on its own. (Filled into
  `abstract_params` rather than `init_params`, whose eager NNX init takes seconds.)"""
  params = models.abstract_params(config)
  rng = np.random.default_rng(seed)

  def draw(path, x):
    noise = rng.standard_normal(x.shape).astype(np.float32)
    is_norm = "scale" in jax.tree_util.keystr(path)
    return jnp.asarray(1.0 + 0.1 * noise if is_norm else 0.2 * noise, x.dtype)

  pure = jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(params))
  nnx.replace_by_pure_dict(params, pure)
  return params


def _hf_from_pretrained(path):
  model, info = transformers.AutoModelForCausalLM.from_pretrained(path,
                                                                  dtype=torch.float32,
                                                                  attn_implementation="eager",
                                                                  output_loading_info=True)
  assert not info["missing_keys"] and not info["unexpected_keys"], info
  assert not info["mismatched_keys"], info
  return model.eval()


def _assert_logits_match_hf(h, config, params, model, tol=1e-5):
  tokens, mask = h.right_padded_batch(config.vocab_size, LENGTHS, SEQ_LEN, seed=7)
  ref = h.hf_logits(model, tokens, mask)
  out = np.asarray(_jit_logits(config, params, tokens, mask))
  real = mask.astype(bool)
  rel = np.abs(out - ref)[real].max() / np.abs(ref[real]).max()
  assert rel < tol, rel


# --- Writing -------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_save_hf_is_loaded_by_transformers(tmp_path, h, ckpt, tie):
  config = ckpt[2].replace(tie_embeddings=tie)
  params = _random_params(config, seed=11)
  models.save_hf(str(tmp_path), config, params)
  model = _hf_from_pretrained(str(tmp_path))
  hf_cfg = model.config
  assert (hf_cfg.num_attention_heads, hf_cfg.num_key_value_heads,
          hf_cfg.head_dim) == (config.num_heads, config.num_kv_heads, config.head_dim)
  assert hf_cfg.tie_word_embeddings == tie
  assert model.config.rope_parameters["rope_theta"] == config.rope_theta
  _assert_logits_match_hf(h, config, params, model)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_load_save_load_is_bit_exact(tmp_path, ckpt, dtype):
  path = ckpt[0]
  config, params = models.load_hf(path, dtype=dtype)
  models.save_hf(str(tmp_path), config, params)
  config2, params2 = models.load_hf(str(tmp_path), dtype=dtype)
  assert config2 == config
  _assert_trees_equal(params2, params)
  # The file keeps the parameters' dtype; in float32 it is the HF file, tensor for tensor.
  saved = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
  with open(tmp_path / "config.json") as f:
    assert json.load(f)["torch_dtype"] == jnp.dtype(dtype).name
  if dtype == jnp.float32:
    original = safetensors.numpy.load_file(os.path.join(path, "model.safetensors"))
    assert sorted(saved) == sorted(original)
    for name in original:
      np.testing.assert_array_equal(saved[name], original[name], err_msg=name)


def test_save_hf_shards_with_index(tmp_path, h, ckpt):
  _, _, config, params = ckpt
  limit = 40_000  # Bytes; the largest tensor (the 136 x 48 float32 embedding) is 26 KB.
  models.save_hf(str(tmp_path), config, params, max_shard_bytes=limit)
  shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
  assert len(shards) >= 3 and "model.safetensors" not in shards
  with open(tmp_path / "model.safetensors.index.json") as f:
    index = json.load(f)
  assert sorted(set(index["weight_map"].values())) == shards
  for shard in shards:
    assert (tmp_path / shard).stat().st_size <= limit + 4096  # + header.
  total = sum(np.asarray(x).nbytes for x in jax.tree.leaves(_pure(params)))
  assert index["metadata"]["total_size"] == total
  _assert_logits_match_hf(h, config, params, _hf_from_pretrained(str(tmp_path)))
  _assert_trees_equal(models.load_hf(str(tmp_path))[1], params)


@pytest.mark.parametrize("first_shard_bytes, second_shard_bytes", [(40_000, 2**30),
                                                                   (2**30, 40_000)],
                         ids=["sharded-then-single", "single-then-sharded"])
def test_save_hf_over_an_earlier_save(tmp_path, ckpt, first_shard_bytes, second_shard_bytes):
  _, _, config, params = ckpt
  old = _random_params(config, seed=21)
  models.save_hf(str(tmp_path), config, old, max_shard_bytes=first_shard_bytes)
  models.save_hf(str(tmp_path), config, params, max_shard_bytes=second_shard_bytes)
  _assert_trees_equal(models.load_hf(str(tmp_path))[1], params)
  # Exactly one layout is left, so every loader reads the same (new) weights.
  single = (tmp_path / "model.safetensors").exists()
  index = (tmp_path / "model.safetensors.index.json").exists()
  assert single != index


# --- Reading -------------------------------------------------------------------------


def test_transformers_sharded_checkpoint_loads(h, hf_checkpoints, ckpt):
  path, model = hf_checkpoints(h.SHARDABLE, max_shard_size="20KB")
  assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
  assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) >= 3
  config, params = models.load_hf(path)
  assert config == ckpt[2]
  _assert_trees_equal(params, ckpt[3])
  _assert_logits_match_hf(h, config, params, model, tol=1e-4)


def test_bfloat16_checkpoint_loads_as_float32(tmp_path, ckpt):
  # A bf16 file (as the released Qwen3 weights are) is widened exactly on load.
  path, model, _, _ = ckpt
  copy.deepcopy(model).to(torch.bfloat16).save_pretrained(str(tmp_path))
  config, params = models.load_hf(str(tmp_path))
  assert config.param_dtype == "float32"
  pure = nnx.to_pure_dict(params)
  want = model.model.layers[1].mlp.down_proj.weight.detach().to(torch.bfloat16)
  np.testing.assert_array_equal(np.asarray(pure["layers"]["mlp"]["down"][1]),
                                want.to(torch.float32).numpy().T)
  assert pure["embed"].dtype == jnp.float32


@pytest.mark.parametrize("axes", [(2, 2, 2), (1, 2, 4)])
@pytest.mark.devices(8)
def test_load_with_mesh_places_shards(ckpt, axes):
  path, _, config, params = ckpt
  mesh = sharding.make_mesh(axes)
  _, sharded = models.load_hf(path, mesh=mesh)
  pure = nnx.to_pure_dict(sharded)
  q = pure["layers"]["attn"]["q"]  # [L, D, H, Dh] = [2, 48, 4, 12]
  assert q.sharding.spec == P(None, "fsdp", "tensor", None)
  assert q.addressable_shards[0].data.shape == (2, 48 // axes[1], 4 // axes[2], 12)
  k = pure["layers"]["attn"]["k"]  # 2 kv heads: split on tensor=2, kept whole on tensor=4.
  k_heads = "tensor" if 2 % axes[2] == 0 else None
  assert k.sharding.spec == P(None, "fsdp", k_heads, None)
  assert pure["embed"].sharding.spec == P("tensor", "fsdp")
  assert pure["lm_head"].sharding.spec == P("fsdp", "tensor")
  assert pure["lm_head"].addressable_shards[0].data.shape == (48 // axes[1], 136 // axes[2])
  assert pure["final_norm"]["scale"].sharding.is_fully_replicated
  assert len(q.sharding.device_set) == 8
  _assert_trees_equal(sharded, params)


# --- Malformed checkpoints -----------------------------------------------------------


@pytest.fixture
def broken(tmp_path, ckpt):
  """A writable copy of the single-file checkpoint."""
  dst = tmp_path / "ckpt"
  shutil.copytree(ckpt[0], dst)
  return dst


def _edit_tensors(path, edit):
  file = str(path / "model.safetensors")
  tensors = safetensors.numpy.load_file(file)
  edit(tensors)
  safetensors.numpy.save_file(tensors, file, metadata={"format": "pt"})


def _edit_config(path, edit):
  with open(path / "config.json") as f:
    hf = json.load(f)
  edit(hf)
  with open(path / "config.json", "w") as f:
    json.dump(hf, f)


def test_missing_tensor_is_named(broken):
  name = "model.layers.1.mlp.up_proj.weight"
  _edit_tensors(broken, lambda t: t.pop(name))
  with pytest.raises(models.CheckpointError, match=rf"missing .*{re.escape(name)}"):
    models.load_hf(str(broken))


def test_unexpected_tensor_is_named(broken):
  name = "model.layers.0.self_attn.extra_proj.weight"
  _edit_tensors(broken, lambda t: t.update({name: np.zeros((3, 5), np.float32)}))
  with pytest.raises(models.CheckpointError, match=rf"unexpected .*{re.escape(name)}"):
    models.load_hf(str(broken))


def test_wrong_shape_is_named(broken):
  name = "model.layers.0.mlp.down_proj.weight"  # [48, 80] -> [80, 48]
  _edit_tensors(broken, lambda t: t.update({name: np.ascontiguousarray(t[name].T)}))
  with pytest.raises(models.CheckpointError,
                     match=rf"{re.escape(name)}.*shape \(80, 48\).*\(48, 80\)"):
    models.load_hf(str(broken))


def test_invalid_config_json(broken):
  (broken / "config.json").write_text('{"hidden_size": 48,')
  with pytest.raises(models.ConfigError, match=r"config\.json.*not valid JSON"):
    models.load_hf(str(broken))


def test_config_missing_field_is_named(broken):
  _edit_config(broken, lambda hf: hf.pop("hidden_size"))
  with pytest.raises(models.ConfigError, match=r"config\.json.*missing.*hidden_size"):
    models.load_hf(str(broken))


def test_config_heads_not_multiple_of_kv_heads(broken):
  _edit_config(broken, lambda hf: hf.update(num_key_value_heads=3))
  with pytest.raises(models.ConfigError, match=r"num_heads=4.*num_kv_heads=3"):
    models.load_hf(str(broken))


def test_missing_config_json(broken):
  (broken / "config.json").unlink()
  with pytest.raises(models.ConfigError, match=r"config\.json"):
    models.load_hf(str(broken))


def test_missing_directory(tmp_path):
  missing = str(tmp_path / "no_such_checkpoint")
  with pytest.raises(models.CheckpointError, match=re.escape(missing)):
    models.load_hf(missing)


def test_no_safetensors_files(broken):
  (broken / "model.safetensors").unlink()
  with pytest.raises(models.CheckpointError, match=r"No model\.safetensors"):
    models.load_hf(str(broken))


@pytest.fixture
def broken_sharded(tmp_path, h, hf_checkpoints):
  path, _ = hf_checkpoints(h.SHARDABLE, max_shard_size="20KB")
  dst = tmp_path / "sharded"
  shutil.copytree(path, dst)
  return dst


def test_index_names_missing_shard(broken_sharded):
  with open(broken_sharded / "model.safetensors.index.json") as f:
    shard = sorted(set(json.load(f)["weight_map"].values()))[1]
  (broken_sharded / shard).unlink()
  with pytest.raises(models.CheckpointError, match=rf"{re.escape(shard)}.*missing"):
    models.load_hf(str(broken_sharded))


def test_index_maps_tensor_to_wrong_shard(broken_sharded):
  index_file = broken_sharded / "model.safetensors.index.json"
  index = json.loads(index_file.read_text())
  name = "model.layers.1.self_attn.o_proj.weight"
  others = sorted(set(index["weight_map"].values()) - {index["weight_map"][name]})
  index["weight_map"][name] = others[0]
  index_file.write_text(json.dumps(index))
  with pytest.raises(models.CheckpointError, match=re.escape(name)):
    models.load_hf(str(broken_sharded))


def test_truncated_safetensors_data(broken):
  # The header is intact but the last tensor's bytes are cut off.
  file = broken / "model.safetensors"
  size = file.stat().st_size
  with open(file, "r+b") as f:
    f.truncate(size - 1000)
  with pytest.raises(models.CheckpointError, match=r"model\.safetensors"):
    models.load_hf(str(broken))


def test_truncated_safetensors_header(broken):
  file = broken / "model.safetensors"
  with open(file, "r+b") as f:
    f.truncate(100)
  with pytest.raises(models.CheckpointError, match=r"model\.safetensors"):
    models.load_hf(str(broken))
