"""Sharding rules on 8 fake CPU devices: meshes from config, sharded forward == unsharded."""

import functools

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from mgrpo_jax import models, sharding
from mgrpo_jax.sharding import ShardingError

# Meshes of up to 8 devices (8 fake CPU devices in the test session).
pytestmark = pytest.mark.devices(8)

B, T = 8, 9  # B divisible by data * fsdp on every mesh below.
LENGTHS = (9, 3, 1, 7, 9, 5, 2, 8)

_jit_logits = jax.jit(models.logits, static_argnums=0)


def test_eight_fake_devices():
  assert jax.device_count() == 8  # tests/conftest.py must run before JAX is imported.


@pytest.fixture(scope="module")
def model(h, hf_checkpoints):
  """(config, unsharded params, tokens, mask, unsharded logits) of SHARDABLE."""
  path, _ = hf_checkpoints(h.SHARDABLE)
  config, params = models.load_hf(path)
  tokens, mask = h.right_padded_batch(config.vocab_size, LENGTHS, T, seed=8)
  ref = np.asarray(_jit_logits(config, params, tokens, mask))
  return config, params, tokens, mask, ref


@pytest.mark.parametrize("axes", [(8, 1, 1), (2, 2, 2), (1, 2, 4)])
def test_sharded_logits_equal_unsharded(model, axes):
  config, params, tokens, mask, ref = model
  mesh = sharding.make_mesh(axes)
  p_shard = sharding.param_shardings(params, mesh)
  sharded = jax.device_put(params, sharding.param_shardings(params, mesh))
  q = nnx.to_pure_dict(sharded)["layers"]["attn"]["q"]
  assert q.sharding.spec == P(None, "fsdp", "tensor", None)  # [L, D, H, Dh]
  if axes[1] * axes[2] > 1:  # Some parameter really is split.
    assert q.addressable_shards[0].data.size < q.size
  batch = sharding.batch_sharding(mesh)
  fn = jax.jit(functools.partial(models.logits, config), in_shardings=(p_shard, batch, batch))
  out = fn(sharded, jax.device_put(tokens, batch), jax.device_put(mask, batch))
  real = mask.astype(bool)
  np.testing.assert_allclose(np.asarray(out)[real], ref[real], atol=1e-5, rtol=0)


def test_cached_decode_with_sharded_cache(model):
  config, params, _, _, _ = model
  mesh = sharding.make_mesh((2, 2, 2))
  p_shard = sharding.param_shardings(params, mesh)
  batch = sharding.batch_sharding(mesh)
  cache_sh = sharding.cache_sharding(mesh, config.num_kv_heads)
  # The cache spec shards batch and (2 kv heads on tensor=2) heads, whatever the layout.
  assert "tensor" in tuple(cache_sh.spec) and sharding.BATCH in tuple(cache_sh.spec)
  step = jax.jit(functools.partial(models.forward, config),
                 in_shardings=(p_shard, batch, batch, cache_sh),
                 out_shardings=(batch, cache_sh))
  rng = np.random.default_rng(9)
  full = rng.integers(1, config.vocab_size, size=(B, T)).astype(np.int32)
  ref = np.asarray(_jit_logits(config, params, full, np.ones_like(full)))
  prompt_lens = np.array([3, 1, 5, 2, 6, 4, 1, 3])
  prefill = np.where(np.arange(T)[None] < prompt_lens[:, None], full, 0).astype(np.int32)
  positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
  cache = jax.device_put(models.init_cache(config, B, T), cache_sh)
  sharded = jax.device_put(params, sharding.param_shardings(params, mesh))
  out, cache = step(sharded, prefill, positions, cache)
  rows = np.arange(B)
  errs = [np.abs(np.asarray(out)[rows, prompt_lens - 1] - ref[rows, prompt_lens - 1]).max()]
  for i in range(3):  # Three decode steps at per-row positions.
    pos_B = (prompt_lens + i).astype(np.int32)
    out, cache = step(sharded, full[rows, pos_B][:, None], pos_B[:, None], cache)
    errs.append(np.abs(np.asarray(out)[:, 0] - ref[rows, pos_B]).max())
  assert jax.tree.leaves(cache)[0].sharding.is_equivalent_to(cache_sh, 5)
  assert max(errs) < 1e-5, errs


def test_cache_sharding_drops_tensor_when_heads_do_not_divide():
  mesh = sharding.make_mesh((1, 2, 4))
  assert "tensor" not in tuple(sharding.cache_sharding(mesh, 2).spec)
  assert "tensor" in tuple(sharding.cache_sharding(mesh, 8).spec)


def test_param_spec_drops_axes_that_do_not_divide():
  mesh = sharding.make_mesh((1, 2, 4))
  # 2 kv heads cannot split over tensor=4; 47 rows cannot split over fsdp=2.
  assert sharding.param_spec("layers/attn/k", (3, 48, 2, 12), mesh) == P(None, "fsdp", None, None)
  assert sharding.param_spec("layers/mlp/gate", (3, 47, 80), mesh) == P(None, None, "tensor")
  assert sharding.param_spec("final_norm/scale", (48,), mesh) == P()


def test_param_spec_unknown_parameter_is_named():
  mesh = sharding.make_mesh((8, 1, 1))
  with pytest.raises(ShardingError, match="layers/attn/rotary"):
    sharding.param_spec("layers/attn/rotary", (4, 4), mesh)


@pytest.mark.parametrize("axes, shape", [
    ((-1, 1, 1), (8, 1, 1, 1)),
    ((-1, 2, 2), (2, 2, 2, 1)),
    ((1, 2, -1), (1, 2, 4, 1)),
    ((1, 2, 1, -1), (1, 2, 1, 4)),
    ({
        "tensor": -1,
        "fsdp": 2
    }, (1, 2, 4, 1)),
    ({
        "data": 8
    }, (8, 1, 1, 1)),
    ({
        "expert": 8
    }, (1, 1, 1, 8)),
])
def test_mesh_resolves_minus_one(axes, shape):
  assert sharding.mesh_shape(axes, 8) == shape
  mesh = sharding.make_mesh(axes)
  assert mesh.axis_names == sharding.MESH_AXES
  assert tuple(mesh.devices.shape) == shape


@pytest.mark.parametrize("axes, message", [
    ((3, 1, 1), r"needs 3 devices.*8"),
    ((4, 4, 1), r"needs 16 devices.*8"),
    ((-1, -1, 2), r"one mesh axis may be -1"),
    ((3, -1, 1), r"8 devices are not a multiple of 3"),
    ((0, 8, 1), r"positive or -1"),
    ((2, 4), r"3 or 4 sizes"),
    ({
        "model": 2,
        "data": 4
    }, r"'model'"),
])
def test_bad_meshes_raise(axes, message):
  with pytest.raises(ShardingError, match=message):
    sharding.make_mesh(axes)
