"""Checkpointer: bitwise round trips of train states (keys included), shardings, crash safety."""

import os
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts_lib

from mgrpo_jax import checkpoint, exchange, models, sharding
from mgrpo_jax.rl import train_step as ts

CFG = models.Qwen3Config(vocab_size=61, hidden_size=24, intermediate_size=37, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1e4)


TX = ts.make_optimizer(learning_rate=1e-3)


@jax.jit
def _train(state: ts.TrainState, seed) -> ts.TrainState:
  """Three updates, the middle one NaN (skipped and counted by apply_if_finite)."""
  def update(carry, scale):
    params, opt_state = carry
    # Cheap, seed-dependent gradients (RNG here would slow the compile).
    grads = jax.tree.map(lambda p: scale * jnp.sin(p * 37.0 * (seed + scale)), params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return (jax.tree.map(jnp.add, params, updates), opt_state), None

  (params, opt_state), _ = jax.lax.scan(update, (state.params, state.opt_state),
                                        jnp.array([1.0, jnp.nan, 0.5]))
  return state.replace(step=state.step + 7 + seed, params=params, opt_state=opt_state)


def _params(seed: int):
  """Random Qwen3 parameters without compiling the initialiser (numpy fills the shapes)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype),
                      models.abstract_params(CFG))


def _state(seed: int, *, key_impl: str = "threefry2x32") -> ts.TrainState:
  """A state whose params, Adam moments, counts and non-finite counter are non-trivial."""
  state = ts.init_state(_params(seed), TX, jax.random.key(0))
  # The key stays outside jit so both key implementations share one compilation.
  return _train(state, seed).replace(key=jax.random.key(seed + 100, impl=key_impl))


def _leaves_bytes(tree):
  """(dtype, shape, raw bytes) of every leaf; typed keys compared by their key data."""
  out = []
  for x in jax.tree.leaves(tree):
    dtype = x.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    x = np.asarray(x)
    out.append((str(dtype), x.shape, x.tobytes()))
  return out


@pytest.fixture(scope="module")
def states():
  return {"main": _state(0), "sub": _state(1, key_impl="rbg")}


def test_round_trip_is_bitwise(tmp_path, states):
  # The fixture is not trivial: a skipped update was counted, moments are non-zero.
  assert int(states["main"].opt_state.total_notfinite) == 1
  moments = [x for path, x in jax.tree_util.tree_flatten_with_path(states["sub"].opt_state)[0]
             if ".mu" in jax.tree_util.keystr(path) or ".nu" in jax.tree_util.keystr(path)]
  assert len(moments) == 2 * len(jax.tree.leaves(states["sub"].params))
  assert all(np.all(np.asarray(m) != 0) for m in moments)
  meta = {"step": np.int64(8), "data_pos": 123, "seeds": [1, 2], "config": {"lr": 1e-3}}
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    assert ckpt.save(8, states, meta)
    ckpt.wait()
    assert ckpt.latest_step() == 8
    restored, restored_meta = ckpt.restore(abstract_states=checkpoint.abstract_like(states))
  assert restored_meta == {"step": 8, "data_pos": 123, "seeds": [1, 2], "config": {"lr": 1e-3}}
  assert jax.tree.structure(restored) == jax.tree.structure(states)
  assert _leaves_bytes(restored) == _leaves_bytes(states)
  assert restored["main"].step.dtype == jnp.int32
  assert jax.random.key_impl(restored["sub"].key) == jax.random.key_impl(states["sub"].key)
  # The restored key draws the same numbers: a resumed run is bit-identical.
  np.testing.assert_array_equal(jax.random.uniform(restored["sub"].key, (4,)),
                                jax.random.uniform(states["sub"].key, (4,)))


def test_keys_are_stored_as_plain_data(tmp_path, states):
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, states, {})
    ckpt.wait()
    raw, _ = ckpt.restore()  # Inspection mode: orbax's own tree, keys left as data.
  np.testing.assert_array_equal(raw["sub"]["key"], jax.random.key_data(states["sub"].key))
  assert raw["sub"]["key"].dtype == np.uint32


def test_save_then_delete_source_arrays(tmp_path):
  """Async save copies off the devices before returning, so the caller may donate."""
  state = _state(2)
  expected = _leaves_bytes(state)
  abstract = checkpoint.abstract_like(state)
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, {"a": state}, {})
    for x in jax.tree.leaves(state):
      x.delete()
    ckpt.wait()
    restored, _ = ckpt.restore(abstract_states={"a": abstract})
  assert _leaves_bytes(restored["a"]) == expected


def test_key_impl_mismatch_raises(tmp_path, states):
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, {"k": states["sub"].key}, {})
    ckpt.wait()
    # Same key-data shape as rbg ((4,) uint32) but another implementation.
    wrong = jax.ShapeDtypeStruct((), jax.random.key(0, impl="unsafe_rbg").dtype)
    with pytest.raises(ValueError, match="saved as 'rbg'"):
      ckpt.restore(abstract_states={"k": wrong})


@pytest.mark.devices(8)
def test_restore_onto_mesh_shardings(tmp_path, states):
  mesh = sharding.make_mesh((2, 2, 2))
  shardings = ts.state_shardings(states["main"], mesh)
  keys_sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp", "tensor")))
  extra = {"keys": jax.random.split(jax.random.key(3), 8)}  # A key array split over devices.
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.save(2, {"main": states["main"], "extra": extra}, {})
    ckpt.wait()
    abstract = {
        "main": jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                             states["main"], shardings),
        "extra": {"keys": jax.ShapeDtypeStruct((8,), extra["keys"].dtype, sharding=keys_sh)},
    }
    restored, _ = ckpt.restore(abstract_states=abstract)
  flat_sh = jax.tree.leaves(shardings)
  flat = jax.tree.leaves(restored["main"])
  assert len(flat) == len(flat_sh)
  for x, s in zip(flat, flat_sh):
    assert x.sharding.is_equivalent_to(s, x.ndim), (x.shape, x.sharding, s)
  embed = restored["main"].params["embed"][...]
  assert len(embed.sharding.device_set) == 8 and not embed.sharding.is_fully_replicated
  assert restored["extra"]["keys"].sharding.is_equivalent_to(keys_sh, 1)
  assert _leaves_bytes(restored) == _leaves_bytes({"main": states["main"], "extra": extra})


def test_key_restored_onto_a_one_device_mesh_stays_a_scalar(tmp_path):
  # One GPU with a mesh config: the wrapped key data's P(None,) once stuck to the scalar key,
  # and the next restore (MAGRPO's warm-start step 0) failed in abstract_like.
  mesh = sharding.make_mesh({"data": -1}, devices=jax.devices()[:1])
  scalar = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  state = {"key": jax.device_put(jax.random.key(4), scalar),
           "w": jax.device_put(jnp.ones(3), scalar)}
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.save(0, {"a": state}, {})
    ckpt.wait()
    restored, _ = ckpt.restore(abstract_states={"a": state})
  key = restored["a"]["key"]
  assert key.sharding == scalar
  assert checkpoint.abstract_like(key) == jax.ShapeDtypeStruct((), key.dtype, sharding=scalar)
  assert _leaves_bytes(restored["a"]) == _leaves_bytes(state)


def test_uncommitted_steps_are_ignored(tmp_path):
  tree = {"x": jnp.arange(5, dtype=jnp.float32)}
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, tree, {"step": 1})
  # A crash mid-save: a step directory without its commit marker (object-store style)
  # and an orbax temporary directory (local-disk style).
  os.makedirs(tmp_path / "2" / "states")
  (tmp_path / "2" / "states" / "junk").write_text("half written")
  os.makedirs(tmp_path / "3.orbax-checkpoint-tmp-1234567" / "states")
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    assert ckpt.latest_step() == 1
    assert ckpt.all_steps() == [1]
    _, meta = ckpt.restore(abstract_states=tree)
    assert meta == {"step": 1}
    with pytest.raises(FileNotFoundError):
      ckpt.restore(2, abstract_states=tree)
    # The resumed run reaches step 2 again: the leftover must not block the save.
    assert ckpt.save(2, {"x": tree["x"] + 1}, {"step": 2})
    ckpt.wait()
    assert ckpt.latest_step() == 2
    restored, _ = ckpt.restore(abstract_states=tree)
  np.testing.assert_array_equal(restored["x"], np.arange(5) + 1)


def test_crash_before_the_digests_keeps_the_previous_step(tmp_path, monkeypatch):
  """A step counts once its digests are written; pruning waits for that."""
  tree = {"x": jnp.arange(3, dtype=jnp.float32)}
  with checkpoint.Checkpointer(tmp_path, max_to_keep=1) as ckpt:
    ckpt.save(1, tree, {"step": 1})
    ckpt.wait()

    def crash(root):
      raise OSError(f"killed before the digests of {root}")
    monkeypatch.setattr(checkpoint, "write_digests", crash)
    ckpt.save(2, {"x": tree["x"] + 2}, {"step": 2})
    with pytest.raises(RuntimeError, match="Finishing a checkpoint"):
      ckpt.wait()
  monkeypatch.undo()
  assert (tmp_path / "2" / "commit_success.txt").exists()  # Orbax had committed it.
  with checkpoint.Checkpointer(tmp_path, max_to_keep=1) as ckpt:
    assert ckpt.all_steps() == [1]
    _, meta = ckpt.restore(abstract_states=tree)
    assert meta == {"step": 1}
    assert ckpt.save(2, {"x": tree["x"] + 4}, {"step": 2})
    ckpt.wait()
    assert ckpt.all_steps() == [2]
    restored, _ = ckpt.restore(abstract_states=tree)
  np.testing.assert_array_equal(restored["x"], np.arange(3) + 4)


def test_no_checkpoint(tmp_path):
  with checkpoint.Checkpointer(tmp_path / "empty") as ckpt:
    assert ckpt.latest_step() is None
    with pytest.raises(FileNotFoundError):
      ckpt.restore(abstract_states={"x": jnp.zeros(2)})


def test_max_to_keep_and_interval(tmp_path):
  tree = {"x": jnp.zeros(3)}
  with checkpoint.Checkpointer(tmp_path, max_to_keep=2, save_interval_steps=2) as ckpt:
    saved = [ckpt.save(s, {"x": tree["x"] + s}, {"step": s}) for s in range(6)]
    assert saved == [True, False, True, False, True, False]
    assert ckpt.save(5, tree, {"step": 5}, force=True)
    ckpt.wait()
    assert ckpt.all_steps() == [4, 5]
    restored, meta = ckpt.restore(4, abstract_states=tree)
  assert meta == {"step": 4}
  np.testing.assert_array_equal(restored["x"], np.full(3, 4.0))


def test_meta_must_be_json(tmp_path):
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    with pytest.raises(TypeError):
      ckpt.save(1, {"x": jnp.zeros(1)}, {"bad": object()})
    assert ckpt.latest_step() is None


@pytest.mark.devices(8)
def test_abstract_like_keeps_sharding():
  mesh = sharding.make_mesh((8, 1, 1))
  sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  x = jax.device_put(jnp.arange(16, dtype=jnp.bfloat16), sh)
  out = checkpoint.abstract_like({"x": x, "n": np.int32(3)})
  assert out["x"] == jax.ShapeDtypeStruct((16,), jnp.bfloat16, sharding=sh)
  assert out["n"].shape == () and out["n"].dtype == np.int32


# ------------------------------------------ kvstores orbax cannot write (copied there)


def test_locations_orbax_writes_itself_or_a_kvstore(tmp_path):
  assert checkpoint.resolve_location(str(tmp_path)) == (str(tmp_path), None)
  assert checkpoint.resolve_location(f"file://{tmp_path}/ck/") == (f"{tmp_path}/ck", None)
  assert checkpoint.resolve_location({"driver": "file", "path": "/r/x"}) == ("/r/x", None)
  assert checkpoint.resolve_location("gs://bucket-a/run/ck") == ("gs://bucket-a/run/ck", None)
  _, spec = checkpoint.resolve_location(
      '{"driver": "s3", "bucket": "bucket-a", "path": "r", "endpoint": "http://h:9"}')
  assert spec["path"] == "r/" and spec["endpoint"] == "http://h:9"
  # Orbax itself refuses s3 paths, which is why those go through a local cache.
  from orbax.checkpoint._src.serialization import tensorstore_utils
  with pytest.raises(ValueError, match="absolute"):
    tensorstore_utils.build_kvstore_tspec("s3://bucket-a/run", "x")
  with pytest.raises(ValueError, match="cache_dir"):
    checkpoint.Checkpointer("memory://nowhere/")


def _memory_url():
  return f"memory://{uuid.uuid4().hex}/run/main/checkpoints"


def test_kvstore_copy_round_trip_and_max_to_keep(tmp_path, states):
  url = _memory_url()
  with checkpoint.Checkpointer(url, cache_dir=tmp_path / "a", max_to_keep=2) as ckpt:
    for step in (1, 2, 3):
      assert ckpt.save(step, {"main": states["main"]}, {"step": step})
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3]  # The kvstore's steps, pruned like the cache.
  kv = ts_lib.KvStore.open(exchange.kvstore_spec(url), context=checkpoint._CONTEXT).result()
  assert not any(k.startswith(b"1/") for k in kv.list().result())
  # Another machine: an empty cache, so the step is fetched first.
  with checkpoint.Checkpointer(url, cache_dir=tmp_path / "b") as ckpt:
    restored, meta = ckpt.restore(abstract_states={"main": states["main"]})
  assert meta == {"step": 3} and sorted(os.listdir(tmp_path / "b")) == ["3"]
  assert _leaves_bytes(restored) == _leaves_bytes({"main": states["main"]})


def test_kvstore_copy_cut_short_is_not_a_checkpoint(tmp_path):
  url = _memory_url()
  tree = {"x": jnp.arange(4, dtype=jnp.float32)}
  with checkpoint.Checkpointer(url, cache_dir=tmp_path / "a") as ckpt:
    ckpt.save(1, tree, {"step": 1})
    ckpt.save(2, {"x": tree["x"] + 2}, {"step": 2})
  kv = ts_lib.KvStore.open(exchange.kvstore_spec(url), context=checkpoint._CONTEXT).result()
  # A crash while step 2 was being copied: its files, but no commit marker.
  kv.delete_range(ts_lib.KvStore.KeyRange(inclusive_min="2/commit_success.txt",
                                          exclusive_max="2/commit_success.txu")).result()
  with checkpoint.Checkpointer(url, cache_dir=tmp_path / "a") as ckpt:
    assert ckpt.all_steps() == [1]
    assert sorted(os.listdir(tmp_path / "a")) == ["1"]  # The cached step 2 was dropped.
    restored, meta = ckpt.restore(abstract_states=tree)
    assert meta == {"step": 1}
    ckpt.save(2, {"x": tree["x"] + 5}, {"step": 2})  # The resumed run saves step 2 again.
  with checkpoint.Checkpointer(url, cache_dir=tmp_path / "c") as ckpt:
    restored, meta = ckpt.restore(abstract_states=tree)
  assert meta == {"step": 2}
  np.testing.assert_array_equal(restored["x"], np.arange(4) + 5)


def test_cache_of_another_save_is_not_used(tmp_path):
  """A cached step with the same number from another run is fetched again."""
  tree = {"x": jnp.zeros(3)}
  first, second = _memory_url(), _memory_url()
  with checkpoint.Checkpointer(first, cache_dir=tmp_path / "cache") as ckpt:
    ckpt.save(1, {"x": tree["x"] + 1}, {"step": 1})
  with checkpoint.Checkpointer(second, cache_dir=tmp_path / "other") as ckpt:
    ckpt.save(1, {"x": tree["x"] + 7}, {"step": 1})
  with checkpoint.Checkpointer(second, cache_dir=tmp_path / "cache") as ckpt:
    restored, _ = ckpt.restore(abstract_states=tree)
  np.testing.assert_array_equal(restored["x"], np.full(3, 7.0))
