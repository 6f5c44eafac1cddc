"""Checkpoints: flipped bits are never restored silently; no run silently starts over."""

import logging
import os
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mgrpo_jax import checkpoint


def _tree(offset: float):
  """Every kind of leaf the train state has: floats, bfloat16, ints and a typed key."""
  return {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3) + offset,
          "b": jnp.full((5,), offset, jnp.bfloat16), "step": jnp.int32(offset),
          "key": jax.random.key(int(offset))}


def _files(root) -> list[str]:
  return sorted(os.path.relpath(os.path.join(d, f), root)
                for d, _, fs in os.walk(root) for f in fs)


def _flip(path, bit: int):
  with open(path, "r+b") as f:
    f.seek(bit // 8)
    byte = f.read(1)[0]
    f.seek(bit // 8)
    f.write(bytes([byte ^ (1 << bit % 8)]))


def _saved(path, steps=(1, 2), **kwargs):
  with checkpoint.Checkpointer(path, **kwargs) as ckpt:
    for s in steps:
      ckpt.save(s, _tree(float(s)), {"step": s})


def _assert_equal(a, b):
  a, b = (jax.tree.map(lambda x: np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.prng_key) else x), t) for t in (a, b))
  jax.tree.map(np.testing.assert_array_equal, a, b)


def test_max_to_keep_zero_is_refused(tmp_path):
  # At 2819582 it was accepted, deleted every step, and a relaunch started from step 0.
  with pytest.raises(ValueError, match="max_to_keep=0"):
    checkpoint.Checkpointer(tmp_path, max_to_keep=0)


def test_100_random_bit_flips_are_never_restored_silently(tmp_path):
  _saved(tmp_path)
  root = os.path.join(tmp_path, "2")
  files = _files(root)
  assert {"commit_success.txt", "_CHECKPOINT_METADATA", "meta/metadata"} <= set(files)
  rng = np.random.default_rng(0)
  silent, errors = [], []
  abstract = checkpoint.abstract_like(_tree(2.0))
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    for i in range(100):
      name = files[i] if i < len(files) else files[rng.integers(len(files))]  # Each kind.
      path = os.path.join(root, name)
      bit = int(rng.integers(os.path.getsize(path) * 8))
      _flip(path, bit)
      try:
        ckpt.restore(2, abstract_states=abstract)
      except Exception as e:  # pylint: disable=broad-except
        errors.append((name, e))
      else:
        silent.append((name, bit))
      _flip(path, bit)
    restored, _ = ckpt.restore(2, abstract_states=abstract)  # Undone: it loads again.
  assert not silent, f"restored without a word: {silent}"
  for name, e in errors:  # Each one caught by the digests, naming the file.
    assert isinstance(e, checkpoint.CorruptCheckpointError), (name, e)
    assert name in str(e) or "_DIGESTS" in str(e), (name, e)
  _assert_equal(restored, _tree(2.0))


def test_corrupt_step_falls_back_to_the_previous_with_a_warning(tmp_path, caplog):
  _saved(tmp_path)
  data = [f for f in _files(os.path.join(tmp_path, "2")) if "/d/" in f]
  _flip(os.path.join(tmp_path, "2", data[0]), 77)
  with checkpoint.Checkpointer(tmp_path) as ckpt, caplog.at_level(logging.WARNING):
    restored, meta = ckpt.restore(abstract_states=checkpoint.abstract_like(_tree(0.0)))
    assert meta == {"step": 1}
    _assert_equal(restored, _tree(1.0))
    assert "step 2" in caplog.text and data[0] in caplog.text
    # The bad step is kept aside for inspection, out of the way of the resumed run.
    assert [n for n in os.listdir(tmp_path) if n.startswith("corrupt-2-")]
    assert ckpt.all_steps() == [1]
    assert ckpt.save(2, _tree(5.0), {"step": 2})
    ckpt.wait()
    restored, meta = ckpt.restore(abstract_states=checkpoint.abstract_like(_tree(0.0)))
  assert meta == {"step": 2}
  _assert_equal(restored, _tree(5.0))


def test_relaunch_without_a_usable_checkpoint_stops(tmp_path):
  _saved(tmp_path, steps=(1,), max_to_keep=1)
  _flip(os.path.join(tmp_path, "1", "meta", "metadata"), 3)
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    assert ckpt.latest_step() == 1  # A relaunch sees a saved step ...
    with pytest.raises(ValueError, match="No usable checkpoint"):
      ckpt.restore(abstract_states=checkpoint.abstract_like(_tree(0.0)))  # ... and stops.
  with checkpoint.Checkpointer(tmp_path) as ckpt:  # Still so on the next relaunch.
    with pytest.raises(ValueError, match="No usable checkpoint"):
      ckpt.restore(abstract_states=checkpoint.abstract_like(_tree(0.0)))


def test_corrupt_kvstore_copy_falls_back(tmp_path):
  import tensorstore as ts
  from mgrpo_jax import exchange
  url = f"memory://{uuid.uuid4().hex}/ck"
  _saved(url, cache_dir=tmp_path / "a")
  kv = ts.KvStore.open(exchange.kvstore_spec(url), context=checkpoint._CONTEXT).result()
  key = next(k.decode() for k in kv.list().result() if k.startswith(b"2/states/") and b"/d/" in k)
  value = bytearray(kv.read(key).result().value)
  value[len(value) // 2] ^= 0x10
  kv.write(key, bytes(value)).result()
  with checkpoint.Checkpointer(url, cache_dir=tmp_path / "b") as ckpt:
    restored, meta = ckpt.restore(abstract_states=checkpoint.abstract_like(_tree(0.0)))
  assert meta == {"step": 1}
  _assert_equal(restored, _tree(1.0))
