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

Verification: once orbax has committed a step, the sha256 of every file in it goes into
`_DIGESTS` (itself headed by the sha256 of its body), written last by an atomic rename;
a step counts as saved only with that file. `restore` checks every file against it
before orbax reads anything; a mismatch falls back to the previous step with a warning
that names the bad one (which is moved aside to `corrupt-<step>-<id>`), and when no step
checks out the restore raises rather than let the run start over. Old steps are pruned
here, after the new step's digests are written, so a crash never leaves no saved step.

Where checkpoints can go: a local path or `file://` URL, and `gs://` (orbax writes
there itself: tensorstore's GCS driver for the arrays, etils epath for the rest). Orbax
0.12 cannot write arrays to any other kvstore (it builds `file` specs for every path
but `gs://`; an `s3://` path fails with "Checkpoint path should be absolute"), so for
those (`s3://`, a JSON spec with an endpoint, `memory://`) each step is written to a
local cache directory by orbax and then copied into the kvstore with tensorstore,
`commit_success.txt` last: the object-store commit protocol, so a copy cut short by
a crash is never seen as a checkpoint. The kvstore is then the truth: on start-up,
local steps it lacks are dropped, and a step missing locally is fetched before restore.
"""

import concurrent.futures
import hashlib
import importlib.util
import json
import os
import shutil
import threading
import uuid

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from absl import logging
from etils import epath
from jax.experimental import multihost_utils
import logging as py_logging

from mgrpo_jax import distributed
from mgrpo_jax import exchange as exchange_lib


class _QuietOrbax(py_logging.Filter):
  """Drops orbax's INFO chatter (dozens of lines per save) from the absl log; keeps warnings."""

  def filter(self, record):
    return record.levelno >= py_logging.WARNING or "/orbax/" not in record.pathname


logging.get_absl_handler().addFilter(_QuietOrbax())

_COMMIT_MARKER = "commit_success.txt"  # Written last by both orbax commit protocols.
_METADATA = "_CHECKPOINT_METADATA"  # Orbax's, with the commit time: tells saves apart.
_DIGESTS = "_DIGESTS"  # Ours, written last: the sha256 of every other file of the step.
_ITEMS = ("states", "meta", "prng_impls")
_CONTEXT = ts.Context()  # One per process: memory:// checkpoints are shared within it.


def resolve_location(location) -> tuple[str | None, dict | None]:
  """(a directory orbax writes itself, None) or (None, a kvstore spec to copy steps into).

  `location` is a local path, a URL (`file://`, `gs://`, `s3://`, `memory://`) or a
  kvstore JSON spec (dict or string), as for `Exchange`.
  """
  if isinstance(location, os.PathLike):
    location = os.fspath(location)
  if isinstance(location, str) and location.startswith("gs://"):
    return location.rstrip("/"), None
  if isinstance(location, str) and "://" not in location and not location.lstrip().startswith("{"):
    return os.path.abspath(location), None
  spec = exchange_lib.kvstore_spec(location)
  if spec.get("driver") == "file":
    return spec["path"].rstrip("/"), None
  if spec.get("driver") == "gcs" and set(spec) <= {"driver", "bucket", "path"}:
    return f"gs://{spec['bucket']}/{spec.get('path', '').rstrip('/')}".rstrip("/"), None
  return None, spec


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
  keys = [(jax.tree_util.keystr(path), x)
          for path, x in jax.tree_util.tree_flatten_with_path(abstract)[0] if _is_key(x)]
  expected = {name: x.dtype for name, x in keys}
  shardings = {name: x.sharding for name, x in keys if getattr(x, "sharding", None) is not None}

  def one(path, x):
    name = jax.tree_util.keystr(path)
    if name not in expected:
      return x  # The caller asked for plain data here (or it never was a key).
    if name not in impls:
      raise ValueError(f"Checkpoint holds plain data at {name}, but a PRNG key was expected.")
    if expected[name] != _key_dtype(impls[name]):
      raise ValueError(f"PRNG key at {name} was saved as {impls[name]!r}, but the restore "
                       f"target expects {expected[name]}.")
    key = jax.random.wrap_key_data(x, impl=impls[name])
    # The target's own sharding: on a one-device mesh the wrapped key keeps its data's
    # rank-1 spec, P(None,), which no scalar may carry (abstract_like of it fails).
    if name in shardings and key.sharding != shardings[name]:
      key = jax.device_put(key, shardings[name])
    return key
  return jax.tree_util.tree_map_with_path(one, tree)


def _to_json(x):
  """json.dumps fallback: numpy/jax scalars and small arrays become Python values."""
  if isinstance(x, (np.ndarray, np.generic, jax.Array)):
    return np.asarray(x).tolist()
  raise TypeError(f"Checkpoint meta holds a {type(x).__name__}, which is not JSON-serialisable.")


class CorruptCheckpointError(ValueError):
  """A saved step whose files do not match the digests written with it."""


def _file_sha256(path: epath.Path) -> str:
  h = hashlib.sha256()
  with path.open("rb") as f:
    while chunk := f.read(1 << 24):  # hashlib drops the GIL on big chunks: threads scale.
      h.update(chunk)
  return h.hexdigest()


def _files_under(path: epath.Path):
  for child in path.iterdir():  # epath has no recursive glob on gs://; steps are shallow.
    if child.is_dir():
      yield from _files_under(child)
    else:
      yield child


def _step_digests(root: epath.Path) -> dict[str, str]:
  """{path relative to root: sha256} of every file in a step directory but `_DIGESTS`."""
  files = sorted(p for p in _files_under(root) if p.name != _DIGESTS
                 and not p.name.startswith(f"{_DIGESTS}."))
  with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
    digests = list(pool.map(_file_sha256, files))
  return {str(p.relative_to(root)): d for p, d in zip(files, digests)}


def write_digests(root) -> None:
  """Writes `root/_DIGESTS` for the files now in the step directory `root`."""
  root = epath.Path(root)
  body = json.dumps({"sha256": _step_digests(root)}, sort_keys=True, separators=(",", ":"))
  # The header digest makes a flipped bit in this file itself as detectable as elsewhere.
  text = hashlib.sha256(body.encode()).hexdigest() + "\n" + body
  tmp = root / f"{_DIGESTS}.{uuid.uuid4().hex}"
  tmp.write_text(text)
  tmp.replace(root / _DIGESTS)  # Atomic on a local disk: the step is saved from here on.


def verify_digests(root) -> None:
  """Raises CorruptCheckpointError naming the first file of `root` that fails its digest."""
  root = epath.Path(root)
  try:
    head, body = (root / _DIGESTS).read_text().split("\n", 1)
  except (OSError, UnicodeDecodeError, ValueError) as e:
    raise CorruptCheckpointError(f"{root}: unreadable {_DIGESTS} ({e!r}).") from e
  if hashlib.sha256(body.encode()).hexdigest() != head:
    raise CorruptCheckpointError(f"{root}/{_DIGESTS} does not match its own digest.")
  expected = json.loads(body)["sha256"]
  found = _step_digests(root)
  for name in sorted(set(expected) | set(found)):
    if name not in found:
      raise CorruptCheckpointError(f"{root}/{name} is missing.")
    if name not in expected:
      raise CorruptCheckpointError(f"{root}/{name} is not one of the files saved.")
    if found[name] != expected[name]:
      raise CorruptCheckpointError(f"{root}/{name} does not match its sha256 digest.")


class Checkpointer:
  """Saves and restores (states pytree, meta dict) pairs under `location`.

  `location` is a local path, `gs://...`, or any kvstore URL or JSON spec (see
  `resolve_location`); for the last kind, `cache_dir` names the local directory that
  orbax writes to before each step is copied there. Saves are asynchronous: `save`
  returns once the arrays are copied off the devices (so the caller may donate or
  overwrite them) and the files are written (and copied) in the background; `wait()`
  blocks until the last save is committed at `location`.
  """

  def __init__(self, location, *, cache_dir=None, max_to_keep: int | None = 3,
               save_interval_steps: int = 1, async_save: bool = True):
    if max_to_keep is not None and max_to_keep < 1:
      # 0 would delete each step as soon as it is saved, and a relaunch would start over.
      raise ValueError(f"max_to_keep={max_to_keep!r}: must be >= 1 (or None to keep every "
                       "step).")
    if save_interval_steps < 1:
      raise ValueError(f"save_interval_steps={save_interval_steps!r}: must be >= 1.")
    directory, self._mirror_spec = resolve_location(location)
    self.location, self.max_to_keep = location, max_to_keep
    self._mirror, self._finalize_thread, self._finalize_error = None, None, None
    if self._mirror_spec is not None:
      if cache_dir is None:
        raise ValueError(f"Checkpoints at {location!r} are copied from a local directory; "
                         "pass cache_dir.")
      if jax.process_count() > 1:
        # Each host would hold only its own shards in its cache; orbax must write there.
        raise NotImplementedError(f"Multi-host checkpoints at {location!r}: use a shared "
                                  "filesystem path or gs://.")
      self._mirror = ts.KvStore.open(self._mirror_spec, context=_CONTEXT).result()
      directory = os.path.abspath(cache_dir)
      logging.info("Checkpoints go to %s by way of the local cache %s (orbax cannot write "
                   "arrays to that kvstore itself).", json.dumps(self._mirror_spec), directory)
    elif directory.startswith("gs://") and importlib.util.find_spec("gcsfs") is None:
      # Orbax reaches the bucket's non-array files through etils epath, i.e. fsspec.
      raise ImportError(f"Checkpoints at {directory} need gcsfs: pip install "
                        "'mgrpo_jax[gcs]' (or pip install gcsfs).")
    self.directory = epath.Path(directory)
    # Pruning is ours (`_prune`): orbax would drop the last verified step before the new
    # one's digests are written.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None, save_interval_steps=save_interval_steps, create=True,
        enable_async_checkpointing=async_save)
    if self._mirror is not None:
      self._drop_cached_steps_not_in_mirror()
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=_ITEMS)

  def save(self, step: int, states, meta: dict | None = None, *, force: bool = False) -> bool:
    """Starts saving `states` and `meta` as `step`; False when the interval skips it.

    `meta` must be JSON-serialisable (numpy/jax scalars are converted); it is checked
    here, before anything is written, so a bad value fails loudly at the call site.
    """
    meta = json.loads(json.dumps(dict(meta or {}), default=_to_json))
    self._join_finalize()  # Steps are finished in order; a failed one raises here.
    self._drop_uncommitted(int(step))
    if not force and not self._manager.should_save(int(step)):
      return False
    data, impls = _keys_to_data(states)
    args = ocp.args.Composite(states=ocp.args.StandardSave(data), meta=ocp.args.JsonSave(meta),
                              prng_impls=ocp.args.JsonSave(impls))
    saved = self._manager.save(int(step), args=args, force=force)
    if saved:
      logging.info("Checkpoint of step %d started in %s.", step, self.directory)
      self._finalize_thread = threading.Thread(target=self._finalize, args=(int(step),),
                                             daemon=True)
      self._finalize_thread.start()
    return saved

  def _committed(self, step: int) -> bool:
    """Saved whole: orbax committed it and its digests are written (they come last)."""
    path = self.directory / str(step)
    return (path / _COMMIT_MARKER).exists() and (path / _DIGESTS).exists()

  def _drop_uncommitted(self, step: int):
    """Deletes a crashed run's half-written `step` directory before saving over it.

    Orbax would otherwise see the step as taken and silently skip the save. Only
    this run writes here, and its own earlier saves are finished first, so an
    uncommitted directory at this point is garbage.
    """
    path = self.directory / str(step)
    # Every process must take the same branch (the barrier below), and process 0 may be
    # deleting the directory while another looks at it: process 0's view decides.
    stale = distributed.broadcast_object(path.exists() and not self._committed(step))
    if not stale:
      return
    self._manager.wait_until_finished()
    if distributed.broadcast_object(self._committed(step)):
      return
    logging.warning("Deleting uncommitted checkpoint directory %s (left by a crash).", path)
    if jax.process_index() == 0:
      path.rmtree()
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"mgrpo_jax.checkpoint.drop_{step}")
    self._manager.reload()

  def all_steps(self) -> list[int]:
    """Committed steps, ascending (rescanned, so other writers' saves show)."""
    if self._mirror is not None:
      return self._mirror_steps()
    self._manager.reload()
    return sorted(s for s in self._manager.all_steps() if self._committed(s))

  def latest_step(self) -> int | None:
    """The newest committed step, or None when there is none."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def restore(self, step: int | None = None, *, abstract_states=None):
    """Returns (states, meta) of `step` (default: the latest step that checks out).

    `abstract_states` is a pytree like the saved one, of `jax.ShapeDtypeStruct`s or
    concrete arrays: each restored array takes that leaf's dtype and sharding (so a
    run may resume onto a different mesh). Without it, the tree comes back as
    orbax's nested dicts with typed keys left as raw uint32 key data: for
    inspection, not for resuming.

    Every file is checked against its digest first. A given `step` that fails raises
    CorruptCheckpointError; by default a failing step is skipped with a warning (and
    moved aside) for the one before it, and when none is left the error is raised:
    a run with checkpoints never silently starts over.
    """
    steps = self.all_steps()
    if step is not None and step not in steps:
      raise FileNotFoundError(f"Step {step} in {self._where()} is missing or uncommitted.")
    if not steps:
      raise FileNotFoundError(f"No committed checkpoint in {self._where()}.")
    bad = []
    for candidate in [step] if step is not None else steps[::-1]:
      try:
        self._verify(candidate)
      except CorruptCheckpointError as e:
        if step is not None:
          raise
        logging.warning("Checkpoint step %d in %s is corrupt and is NOT restored: %s",
                        candidate, self._where(), e)
        bad.append((candidate, e))
        continue
      out = self._restore_verified(candidate, abstract_states)
      self._set_aside([b for b, _ in bad])
      return out
    raise CorruptCheckpointError(
        f"No usable checkpoint in {self._where()}: steps {[b for b, _ in bad]} all fail "
        "their digests, so the run stops instead of starting over. Move the directory "
        "aside to start afresh.") from bad[0][1]

  def _verify(self, step: int) -> None:
    if self._mirror is not None and not self._cached(step):
      self._download(step)
      verify_digests(self.directory / str(step))
      return
    try:
      verify_digests(self.directory / str(step))
    except CorruptCheckpointError:
      if self._mirror is None:
        raise
      # The cached copy went bad; the kvstore's may still be good.
      self._download(step)
      verify_digests(self.directory / str(step))

  def _restore_verified(self, step: int, abstract_states):
    self._manager.reload()  # The step may come from another writer since we started.
    target = None if abstract_states is None else _restore_target(abstract_states)
    states_args = (ocp.args.StandardRestore() if target is None
                   else ocp.args.StandardRestore(target))
    out = self._manager.restore(int(step), args=ocp.args.Composite(
        states=states_args, meta=ocp.args.JsonRestore(), prng_impls=ocp.args.JsonRestore()))
    states = out.states
    if abstract_states is not None:
      states = _data_to_keys(states, out.prng_impls or {}, abstract_states)
    logging.info("Restored step %d from %s.", step, self._where())
    return states, dict(out.meta or {})

  def _set_aside(self, steps: list[int]) -> None:
    """Moves corrupt steps out of the way (kept for inspection); the run saves them anew."""
    if not steps or jax.process_index() != 0:
      return
    for step in steps:
      if self._mirror is not None:
        self._delete_mirror_step(step, keep_files=True)
      path = self.directory / str(step)
      if path.exists():
        dest = self.directory / f"corrupt-{step}-{uuid.uuid4().hex[:8]}"
        path.rename(dest)
        logging.warning("Moved corrupt checkpoint step %d to %s.", step, dest)
    self._manager.reload()

  def wait(self):
    """Blocks until every started save is committed at the checkpoint location."""
    self._manager.wait_until_finished()
    self._join_finalize()

  def close(self):
    """Waits for pending saves and releases orbax's background resources."""
    self.wait()
    self._manager.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # Copies into a kvstore that orbax cannot write to (see the module docstring).

  def _where(self) -> str:
    return str(self.directory) if self._mirror is None else json.dumps(self._mirror_spec)

  def _mirror_steps(self) -> list[int]:
    keys = self._mirror.list().result()
    names = (k.decode("utf-8").split("/") for k in keys)
    return sorted(int(n[0]) for n in names
                  if len(n) == 2 and n[1] == _COMMIT_MARKER and n[0].isdigit())

  def _cached(self, step: int) -> bool:
    """Whether the cache holds this very save of `step` (not one of another run's)."""
    if not self._committed(step):
      return False
    meta = self._mirror.read(f"{step}/{_METADATA}").result()
    path = self.directory / str(step) / _METADATA
    return meta.state == "value" and path.exists() and path.read_bytes() == meta.value

  def _drop_cached_steps_not_in_mirror(self):
    """The kvstore is the truth: a cached step it lacks (a copy cut short) is redone."""
    if not self.directory.exists():
      return
    kept = set(self._mirror_steps())
    for path in self.directory.iterdir():
      if path.name.isdigit() and not (int(path.name) in kept and self._cached(int(path.name))):
        logging.warning("Dropping cached checkpoint %s: %s does not hold it.", path,
                        self._where())
        path.rmtree()

  def _finalize(self, step: int):
    """After orbax commits `step`: its digests, then pruning, then the kvstore copy."""
    try:
      self._manager.wait_until_finished()  # Orbax has committed the step locally.
      if jax.process_index() == 0:
        write_digests(self.directory / str(step))
        if self._mirror is not None:
          self._upload(step)
        self._prune()
    except Exception as e:  # Raised by the next save or wait, on the caller's thread.
      self._finalize_error = e

  def _prune(self):
    if self.max_to_keep is None:
      return
    local = sorted(int(p.name) for p in self.directory.iterdir()
                   if p.name.isdigit() and self._committed(int(p.name)))
    for old in local[:-self.max_to_keep]:
      # The digests go first, so no reader takes a half-deleted step for a checkpoint.
      (self.directory / str(old) / _DIGESTS).unlink()
      (self.directory / str(old)).rmtree()
    if self._mirror is not None:
      for old in self._mirror_steps()[:-self.max_to_keep]:
        self._delete_mirror_step(old)

  def _delete_mirror_step(self, step: int, *, keep_files: bool = False):
    # The marker goes first, so no reader takes a half-deleted step for a checkpoint.
    marker = f"{step}/{_COMMIT_MARKER}"
    self._mirror.delete_range(ts.KvStore.KeyRange(inclusive_min=marker,
                                                exclusive_max=marker + "\0")).result()
    if not keep_files:
      self._mirror.delete_range(exchange_lib.prefix_range(f"{step}/")).result()

  def _upload(self, step: int):
    root = os.path.join(self.directory, str(step))
    files = sorted(os.path.relpath(os.path.join(d, f), root)
                   for d, _, fs in os.walk(root) for f in fs)
    prefix = f"{step}/"
    # Leftovers of a copy that a crash cut short (it has no marker, so nobody read it).
    self._mirror.delete_range(exchange_lib.prefix_range(prefix)).result()
    rest = [f for f in files if f != _COMMIT_MARKER]
    for future in [self._mirror.write(prefix + f, _read(root, f)) for f in rest]:
      future.result()
    self._mirror.write(prefix + _COMMIT_MARKER, _read(root, _COMMIT_MARKER)).result()
    logging.info("Checkpoint of step %d copied to %s.", step, self._where())

  def _join_finalize(self):
    if self._finalize_thread is not None:
      self._finalize_thread.join()
      self._finalize_thread = None
    if self._finalize_error is not None:
      error, self._finalize_error = self._finalize_error, None
      raise RuntimeError(f"Finishing a checkpoint in {self._where()} failed.") from error

  def _download(self, step: int):
    """Fetches `step` into the cache, then puts it in place with a local rename."""
    prefix = f"{step}/"
    keys = [k.decode("utf-8") for k in
            self._mirror.list(exchange_lib.prefix_range(prefix)).result()]
    tmp = os.path.join(self.directory, f".download-{step}-{uuid.uuid4().hex}")
    for key, future in [(k, self._mirror.read(k)) for k in keys]:
      path = os.path.join(tmp, key[len(prefix):])
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(path, "wb") as f:
        f.write(future.result().value)
    dest = os.path.join(self.directory, str(step))
    if os.path.exists(dest):
      shutil.rmtree(dest)  # Uncommitted leftovers, or another save of this step number.
    os.rename(tmp, dest)
    logging.info("Fetched checkpoint step %d from %s.", step, self._where())


def _read(root: str, rel: str) -> bytes:
  with open(os.path.join(root, rel), "rb") as f:
    return f.read()
