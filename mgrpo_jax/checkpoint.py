"""Orbax checkpoints of a run: several agents' train states plus JSON host-side data.

One checkpoint step is a directory `<directory>/<step>/` with three orbax items:

  states      the device pytree (e.g. {"main": TrainState, "sub": TrainState}), saved
              with `StandardSave`, restored onto the shardings the caller asks for
  meta        a JSON object: step, data position, host RNG seeds, the config, ...
  prng_impls  a JSON object {key path: PRNG implementation} for the typed keys

Typed PRNG keys (`jax.random.key`) are stored as their raw `uint32` key data and
re-wrapped on restore. Recent orbax does this by itself, but doing it here keeps the
on-disk format plain arrays that any orbax (or tensorstore) version reads, and lets
restore check that the key implementation matches the one the caller expects.

Crash safety: orbax writes each step to a temporary directory and commits it by an
atomic rename (local disks) or by writing `commit_success.txt` last (object stores).
`latest_step`/`restore` additionally require that marker, so a step directory left
half-written by any writer is never resumed from.
"""

import json

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils
import logging as py_logging


class _QuietOrbax(py_logging.Filter):
  """Drops orbax's INFO chatter (dozens of lines per save) from the absl log; keeps warnings."""

  def filter(self, record):
    return record.levelno >= py_logging.WARNING or "/orbax/" not in record.pathname


logging.get_absl_handler().addFilter(_QuietOrbax())

_COMMIT_MARKER = "commit_success.txt"  # Written last by both orbax commit protocols.
_ITEMS = ("states", "meta", "prng_impls")


def _is_key(x) -> bool:
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def abstract_like(tree):
  """ShapeDtypeStructs (keeping each jax.Array's sharding) of a concrete pytree.

  Leaves that are not jax arrays (numpy arrays, Python scalars) get no sharding, so
  `Checkpointer.restore` places them on the default device.
  """
  def one(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      return x
    if isinstance(x, jax.Array):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    x = np.asarray(x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  return jax.tree.map(one, tree)


def _keys_to_data(tree):
  """Replaces typed PRNG keys by their uint32 data; returns (tree, {path: impl})."""
  impls = {}

  def one(path, x):
    if not _is_key(x):
      return x
    impls[jax.tree_util.keystr(path)] = str(jax.random.key_impl(x))
    return jax.random.key_data(x)
  return jax.tree_util.tree_map_with_path(one, tree), impls


def _key_dtype(impl: str):
  return jax.random.key(0, impl=impl).dtype


def _abstract_key_data(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
  """The stored form of an abstract key: its sharding, plus unsharded key-data axes."""
  data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
  sharding = x.sharding
  if isinstance(sharding, jax.sharding.NamedSharding):
    spec = tuple(sharding.spec) + (None,) * (len(data.shape) - len(sharding.spec))
    sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
  elif sharding is not None and not isinstance(sharding, jax.sharding.SingleDeviceSharding):
    # Other shardings are rank-specific; replicating key data costs a few bytes.
    sharding = jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.asarray(list(sharding.device_set)), ("_",)),
        jax.sharding.PartitionSpec())
  return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)


def _restore_target(abstract):
  """Abstract tree for orbax: typed-key leaves swapped for their key-data form."""
  def one(x):
    return _abstract_key_data(x) if _is_key(x) else x
  return jax.tree.map(one, abstract_like(abstract))


def _data_to_keys(tree, impls: dict, abstract):
  """Re-wraps the key data saved at `impls`' paths, checking the expected impl."""
  expected = {jax.tree_util.keystr(path): x.dtype
              for path, x in jax.tree_util.tree_flatten_with_path(abstract)[0] if _is_key(x)}

  def one(path, x):
    name = jax.tree_util.keystr(path)
    if name not in expected:
      return x  # The caller asked for plain data here (or it never was a key).
    if name not in impls:
      raise ValueError(f"Checkpoint holds plain data at {name}, but a PRNG key was expected.")
    if expected[name] != _key_dtype(impls[name]):
      raise ValueError(f"PRNG key at {name} was saved as {impls[name]!r}, but the restore "
                       f"target expects {expected[name]}.")
    return jax.random.wrap_key_data(x, impl=impls[name])
  return jax.tree_util.tree_map_with_path(one, tree)


def _to_json(x):
  """json.dumps fallback: numpy/jax scalars and small arrays become Python values."""
  if isinstance(x, (np.ndarray, np.generic, jax.Array)):
    return np.asarray(x).tolist()
  raise TypeError(f"Checkpoint meta holds a {type(x).__name__}, which is not JSON-serialisable.")


class Checkpointer:
  """Saves and restores (states pytree, meta dict) pairs under `directory`.

  `directory` is a local path or any URL etils/epath understands (`gs://...`).
  Saves are asynchronous: `save` returns once the arrays are copied off the
  devices (so the caller may donate or overwrite them) and the files are written
  in the background; `wait()` blocks until the last save is committed.
  """

  def __init__(self, directory, *, max_to_keep: int | None = 3, save_interval_steps: int = 1,
               async_save: bool = True):
    self.directory = epath.Path(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, save_interval_steps=save_interval_steps, create=True,
        enable_async_checkpointing=async_save)
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=_ITEMS)

  def save(self, step: int, states, meta: dict | None = None, *, force: bool = False) -> bool:
    """Starts saving `states` and `meta` as `step`; False when the interval skips it.

    `meta` must be JSON-serialisable (numpy/jax scalars are converted); it is checked
    here, before anything is written, so a bad value fails loudly at the call site.
    """
    meta = json.loads(json.dumps(dict(meta or {}), default=_to_json))
    self._drop_uncommitted(int(step))
    if not force and not self._manager.should_save(int(step)):
      return False
    data, impls = _keys_to_data(states)
    args = ocp.args.Composite(states=ocp.args.StandardSave(data), meta=ocp.args.JsonSave(meta),
                              prng_impls=ocp.args.JsonSave(impls))
    saved = self._manager.save(int(step), args=args, force=force)
    if saved:
      logging.info("Checkpoint of step %d started in %s.", step, self.directory)
    return saved

  def _committed(self, step: int) -> bool:
    return (self.directory / str(step) / _COMMIT_MARKER).exists()

  def _drop_uncommitted(self, step: int):
    """Deletes a crashed run's half-written `step` directory before saving over it.

    Orbax would otherwise see the step as taken and silently skip the save. Only
    this run writes here, and its own earlier saves are finished first, so an
    uncommitted directory at this point is garbage.
    """
    path = self.directory / str(step)
    if not path.exists() or self._committed(step):
      return
    self._manager.wait_until_finished()
    if self._committed(step):
      return
    logging.warning("Deleting uncommitted checkpoint directory %s (left by a crash).", path)
    if jax.process_index() == 0:
      path.rmtree()
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"mgrpo_jax.checkpoint.drop_{step}")
    self._manager.reload()

  def all_steps(self) -> list[int]:
    """Committed steps on disk, ascending (rescanned, so other writers' saves show)."""
    self._manager.reload()
    return sorted(s for s in self._manager.all_steps() if self._committed(s))

  def latest_step(self) -> int | None:
    """The newest committed step, or None when there is none."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def restore(self, step: int | None = None, *, abstract_states=None):
    """Returns (states, meta) of `step` (default: the latest committed step).

    `abstract_states` is a pytree like the saved one, of `jax.ShapeDtypeStruct`s or
    concrete arrays: each restored array takes that leaf's dtype and sharding (so a
    run may resume onto a different mesh). Without it, the tree comes back as
    orbax's nested dicts with typed keys left as raw uint32 key data: for
    inspection, not for resuming.
    """
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(f"No committed checkpoint in {self.directory}.")
    elif not self._committed(step):
      raise FileNotFoundError(f"Step {step} in {self.directory} is missing or uncommitted.")
    else:
      self._manager.reload()  # The step may come from another writer since we started.
    target = None if abstract_states is None else _restore_target(abstract_states)
    states_args = (ocp.args.StandardRestore() if target is None
                   else ocp.args.StandardRestore(target))
    out = self._manager.restore(int(step), args=ocp.args.Composite(
        states=states_args, meta=ocp.args.JsonRestore(), prng_impls=ocp.args.JsonRestore()))
    states = out.states
    if abstract_states is not None:
      states = _data_to_keys(states, out.prng_impls or {}, abstract_states)
    logging.info("Restored step %d from %s.", step, self.directory)
    return states, dict(out.meta or {})

  def wait(self):
    """Blocks until every started save is committed to storage."""
    self._manager.wait_until_finished()

  def close(self):
    """Waits for pending saves and releases orbax's background resources."""
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
