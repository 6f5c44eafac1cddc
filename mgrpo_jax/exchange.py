"""The exchange: the only channel between role programs (architecture.md, algorithm.md 1.6).

Small JSON records live in a tensorstore `KvStore`, numeric statistics (such as
`R_M[Q,K]`) in zarr arrays beside them. The same code runs on `memory://` (one
process), `file://` (one machine or a shared filesystem) and object stores (`gs://`,
`s3://`), since it uses only what all of them offer: atomic whole-object writes,
create-if-absent conditional writes, reads and prefix listing. It never renames or
locks a file.

Layout under the store's base path (numbers zero-padded so listing order is step
order on every backend; leaves end in `.json` so that keys of different depths never
make one name both a file and a directory on `file://`):

  {run}/{kind}/{step:08d}[/{q:04d}[/{k:04d}[/{call:04d}]]].json   records
  {run}/_mark/{kind}/{step:08d}.json                            step markers
  {run}/_array/{name}/{step:08d}.json                           array commit records
  {run}/_array_data/{name}/{step:08d}/{attempt}/                zarr array data

Exactly-once: every record is written with the condition "only if absent"
(`if_equal` = the no-value generation), which the backends enforce atomically:
in-process for `memory://`; by a per-key OS lock inside tensorstore for `file://`
(safe across processes); by `x-goog-if-generation-match: 0` on GCS; by
`If-None-Match: *` on S3 (see `kvstore_spec`). A write that finds the key taken
reads the winner back: an identical record makes `put` return False (a restarted
writer re-putting what it wrote before), a different one raises `ExchangeConflict`.
Records are therefore expected to be deterministic functions of their key and inputs.

Arrays are published the way object stores allow without rename: the data is
written under a fresh attempt path nobody else reads, then a small commit record
naming that path and the data's checksum is put (create-if-absent). Readers wait
for the commit record, so they never see a half-written array; a writer killed in
between leaves only an unreferenced attempt directory.

Every record carries a schema version, its own key and the sha256 of its canonical
JSON; arrays are checked against the checksum in their commit record. Anything that
fails these checks raises `ExchangeCorrupt` naming the key; nothing is skipped.

One writer per role: `lease.acquire_lease` holds a role's lease on an exchange.
"""

import hashlib
import json
import os
import re
import threading
import time
import uuid
from typing import Any, Sequence

import numpy as np
import tensorstore as ts

from mgrpo_jax import distributed

SCHEMA_VERSION = 1
_WIDTHS = (8, 4, 4, 4)  # step, query, rollout, call.
NO_VALUE = b"\x02"  # tensorstore's StorageGeneration::NoValue: "only if the key is absent".
_MAX_POLL_S = 1.0  # Backoff cap: object stores bill per request.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")  # Kinds and array names: one path segment.
# One context per process, so that every Exchange (and its zarr arrays) on memory://
# sees the same in-memory store, as the colocated trainer needs.
_CONTEXT = ts.Context()

Key = tuple[int, ...]
# URL schemes of run locations that hold both the exchange and orbax checkpoints (tested).
SCHEMES = ("file://", "memory://", "s3://", "gs://")


class ExchangeError(Exception):
  """Base class of the exchange's errors."""


class ExchangeConflict(ExchangeError):
  """A different record already exists under the key (`existing` is the winner's)."""

  def __init__(self, key: str, existing: Any, attempted: Any):
    super().__init__(f"Exchange conflict at {key!r}: a different record is already stored "
                     f"there (stored {_brief(existing)}, attempted {_brief(attempted)}).")
    self.key, self.existing, self.attempted = key, existing, attempted


class ExchangeTimeout(ExchangeError, TimeoutError):
  """Records did not appear in time; `missing` lists their keys."""

  def __init__(self, message: str, missing: Sequence[str]):
    super().__init__(message)
    self.missing = list(missing)


class ExchangeCorrupt(ExchangeError):
  """A stored record or array fails its checks (JSON, schema, key or checksum)."""

  def __init__(self, key: str, reason: str):
    super().__init__(f"Corrupt exchange record {key!r}: {reason}.")
    self.key = key


def _brief(record: Any, limit: int = 200) -> str:
  text = json.dumps(record, sort_keys=True, default=repr)
  return text if len(text) <= limit else text[:limit] + "..."


def _canonical(record: Any) -> bytes:
  # NaN is not JSON; refusing it keeps records readable by any JSON parser.
  return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                    allow_nan=False).encode("utf-8")


def encode_record(path: str, record: dict) -> bytes:
  body = _canonical(record)
  envelope = {"v": SCHEMA_VERSION, "key": path, "sha256": hashlib.sha256(body).hexdigest(),
              "record": record}
  return _canonical(envelope)


def decode_record(path: str, raw: bytes) -> dict:
  try:
    envelope = json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ExchangeCorrupt(path, f"not valid JSON ({e})") from None
  if not isinstance(envelope, dict) or set(envelope) != {"v", "key", "sha256", "record"}:
    raise ExchangeCorrupt(path, "not an exchange envelope")
  if envelope["v"] != SCHEMA_VERSION:
    raise ExchangeCorrupt(path, f"schema version {envelope['v']!r}, this code reads "
                                f"{SCHEMA_VERSION}")
  if envelope["key"] != path:
    raise ExchangeCorrupt(path, f"it holds the record of {envelope['key']!r}")
  if hashlib.sha256(_canonical(envelope["record"])).hexdigest() != envelope["sha256"]:
    raise ExchangeCorrupt(path, "checksum mismatch")
  return envelope["record"]


def kvstore_spec(url_or_spec, subpath: str = "") -> dict:
  """A kvstore JSON spec from a URL, a JSON spec (dict or string) or a local path.

  The spec's path ends in "/" (keys are appended to it); `subpath` names a directory
  below the location, e.g. kvstore_spec("s3://bucket/run1", "main/checkpoints").
  """
  if isinstance(url_or_spec, ts.KvStore.Spec):
    spec = url_or_spec.to_json()
  elif isinstance(url_or_spec, dict):
    spec = dict(url_or_spec)
  elif isinstance(url_or_spec, str) and url_or_spec.lstrip().startswith("{"):
    spec = json.loads(url_or_spec)
  elif isinstance(url_or_spec, str) and "://" in url_or_spec:
    try:
      spec = ts.KvStore.Spec(url_or_spec).to_json()
    except ValueError as e:
      raise ExchangeError(f"Run location {url_or_spec!r}: {e}. Locations that work: "
                          f"{', '.join(SCHEMES)}, a local path, or a kvstore JSON spec.") from e
  elif isinstance(url_or_spec, (str, os.PathLike)):
    spec = {"driver": "file", "path": os.path.abspath(url_or_spec)}
  else:
    raise TypeError(f"Exchange location must be a URL, a kvstore spec or a path, "
                    f"got {url_or_spec!r}.")
  # Keys are appended to the path without a separator: make the base a directory.
  if spec.get("path") and not spec["path"].endswith("/"):
    spec["path"] += "/"
  if subpath:
    spec["path"] = spec.get("path", "") + subpath.strip("/") + "/"
  if spec.get("driver") == "s3":
    # tensorstore sends If-None-Match only to AWS endpoints by default and emulates the
    # condition with HEAD + PUT (racy) elsewhere; S3-compatible stores (MinIO, moto)
    # implement the header, so ask for it unless the spec says otherwise.
    spec.setdefault("use_conditional_write", True)
  return spec


def check_name(what: str, name: str) -> str:
  if not isinstance(name, str) or not _NAME.fullmatch(name):
    raise ValueError(f"Exchange {what} must match {_NAME.pattern}, got {name!r}.")
  return name


def _segments(key: Sequence[int]) -> list[str]:
  key = tuple(key)
  if not 1 <= len(key) <= len(_WIDTHS) and key != ():
    raise ValueError(f"Exchange keys are (step[, query[, rollout[, call]]]), got {key!r}.")
  out = []
  for value, width in zip(key, _WIDTHS):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
      raise ValueError(f"Exchange key parts must be non-negative ints, got {key!r}.")
    out.append(f"{int(value):0{width}d}")
  return out


def _parse(rel: str) -> Key | None:
  """The key of a relative leaf path, or None for names that are not ours."""
  if not rel.endswith(".json"):
    return None  # E.g. a backend's temporary or lock file.
  parts = rel[:-len(".json")].split("/")
  if not 1 <= len(parts) <= len(_WIDTHS) or not all(p.isdigit() for p in parts):
    return None
  return tuple(int(p) for p in parts)


def prefix_range(prefix: str) -> ts.KvStore.KeyRange:
  """The range of every key that starts with `prefix` (non-empty)."""
  # Keys are ASCII, so bumping the last character bounds every key with this prefix.
  return ts.KvStore.KeyRange(inclusive_min=prefix,
                             exclusive_max=prefix[:-1] + chr(ord(prefix[-1]) + 1))


def _array_meta(array: np.ndarray) -> dict:
  if array.dtype.hasobject:
    raise ValueError(f"Exchange arrays must be numeric, got dtype {array.dtype}.")
  # The checksum covers dtype and shape, so a reinterpreted buffer also fails it.
  digest = hashlib.sha256(f"{array.dtype.str}{array.shape}".encode())
  digest.update(np.ascontiguousarray(array).tobytes())
  return {"dtype": array.dtype.str, "shape": list(array.shape), "sha256": digest.hexdigest()}


class Exchange:
  """Keyed, exactly-once records and arrays in a tensorstore kvstore.

  Args:
    url_or_spec: "memory://", "file:///abs/path", "gs://bucket/prefix",
      "s3://bucket/prefix", a local path, or a kvstore JSON spec (dict or string), e.g.
      {"driver": "s3", "bucket": "b", "path": "run1", "endpoint": "http://host:9000",
      "aws_region": "us-east-1"}.
    run: the namespace of this run inside the store (may contain "/").
    context: a tensorstore context; by default one shared by the whole process, so
      that two Exchanges on memory:// see the same records.
    writer: whether `put`, `mark` and `put_array` write. By default process 0 of a
      multi-process program writes and the others only read (they compute the same
      records: a non-writer's write returns False and stores nothing); every process
      writes its own process-local memory:// store.
  """

  def __init__(self, url_or_spec, *, run: str = "run", context: ts.Context | None = None,
               writer: bool | None = None):
    if not run or run.startswith("/") or run.endswith("/") or ".." in run.split("/"):
      raise ValueError(f"Exchange run must be a relative path, got {run!r}.")
    self.spec = kvstore_spec(url_or_spec)
    if writer is None:
      writer = distributed.is_primary() or self.spec.get("driver") == "memory"
    self.writer = writer
    self.run = run
    self._context = _CONTEXT if context is None else context
    self._store = ts.KvStore.open(self.spec, context=self._context).result()
    self._lock = threading.Lock()
    self._stats: dict[str, dict[str, int]] = {}

  def __repr__(self):
    return f"Exchange({json.dumps(self.spec, sort_keys=True)}, run={self.run!r})"

  # Records.

  def put(self, kind: str, key: Sequence[int], record: dict) -> bool:
    """Writes `record` under (kind, key) once: True if new, False if already there.

    Raises ExchangeConflict (naming the key) if a different record is stored there.
    """
    if not self.writer:
      return False
    return self._put(self._record_path(kind, key), record, kind)

  def try_get(self, kind: str, key: Sequence[int]) -> dict | None:
    """The record under (kind, key), or None if there is none yet (no waiting)."""
    path = self._record_path(kind, key)
    return self._decode_read(path, self._store.read(path).result(), kind)

  def try_get_many(self, kind: str, keys: Sequence[Sequence[int]]) -> list[dict | None]:
    """The records under `keys` (None where there is none yet), read concurrently: one
    round trip however many keys."""
    paths = [self._record_path(kind, k) for k in keys]
    futures = [self._store.read(path) for path in paths]
    return [self._decode_read(path, f.result(), kind) for path, f in zip(paths, futures)]

  def get(self, kind: str, key: Sequence[int], *, timeout_s: float | None = None,
          poll_s: float = 0.05) -> dict:
    """The record under (kind, key), waiting for it up to `timeout_s` (None: forever)."""
    return self.get_many(kind, [key], timeout_s=timeout_s, poll_s=poll_s)[0]

  def get_many(self, kind: str, keys: Sequence[Sequence[int]], *,
               timeout_s: float | None = None, poll_s: float = 0.05) -> list[dict]:
    """The records under `keys`, in order, read concurrently; waits for all of them.

    Raises ExchangeTimeout listing every key still missing after `timeout_s`.
    """
    return self._wait([self._record_path(kind, k) for k in keys], kind, timeout_s, poll_s)

  # Step markers ("main finished step s rollouts", ...).

  def mark(self, kind: str, step: int, record: dict | None = None) -> bool:
    """Marks `step` as done for `kind` (exactly once, like `put`)."""
    if not self.writer:
      return False
    return self._put(self._mark_path(kind, step), record or {}, f"_mark/{kind}")

  def wait_mark(self, kind: str, step: int, *, timeout_s: float | None = None,
                poll_s: float = 0.05) -> dict:
    """The marker record of `step`, waiting for it up to `timeout_s`."""
    return self._wait([self._mark_path(kind, step)], f"_mark/{kind}", timeout_s, poll_s)[0]

  def try_mark(self, kind: str, step: int) -> dict | None:
    """The marker record of `step`, or None if it is not there yet (no waiting)."""
    path = self._mark_path(kind, step)
    return self._decode_read(path, self._store.read(path).result(), f"_mark/{kind}")

  def marks(self, kind: str) -> list[int]:
    """The marked steps of `kind`, ascending (where a restarted program resumes)."""
    prefix = f"{self.run}/_mark/{check_name('kind', kind)}/"
    return sorted(k[0] for k in self._list_under(prefix, "") if len(k) == 1)

  # Arrays.

  def put_array(self, name: str, step: int, array) -> bool:
    """Publishes `array` as (name, step) once: True if new, False if already there.

    The data goes to a fresh attempt path first and becomes visible only through
    the commit record written after it (create-if-absent), since object stores
    cannot rename. Raises ExchangeConflict if different data is committed there.
    """
    if not self.writer:
      return False
    array = np.asarray(array)
    meta = _array_meta(array)
    commit, kind = self._array_path(name, step), f"_array/{name}"
    existing = self._decode_read(commit, self._store.read(commit).result(), kind)
    if existing is not None:  # A restarted writer: skip rewriting the data.
      return self._same_array(commit, existing, meta)
    data_path = f"{self.run}/_array_data/{name}/{int(step):08d}/{uuid.uuid4().hex}/"
    self._write_zarr(data_path, array)
    try:
      self._put(commit, {**meta, "path": data_path}, kind)
    except ExchangeConflict as e:  # A concurrent writer committed first.
      self._store.delete_range(prefix_range(data_path)).result()  # Unreachable now.
      return self._same_array(commit, e.existing, meta)
    self._count(kind, "bytes_written", array.nbytes)
    self._count(kind, "arrays_written", 1)
    return True

  def get_array(self, name: str, step: int, *, timeout_s: float | None = None,
                poll_s: float = 0.05) -> np.ndarray:
    """The committed array (name, step), waiting for its commit up to `timeout_s`."""
    commit, kind = self._array_path(name, step), f"_array/{name}"
    meta = self._wait([commit], kind, timeout_s, poll_s)[0]
    try:
      dest = ts.open(self._zarr_spec(meta["path"]), open=True, context=self._context).result()
      array = dest.read().result()
    except (ValueError, KeyError, TypeError) as e:  # tensorstore raises ValueError.
      raise ExchangeCorrupt(commit, f"its array data cannot be read ({e})") from None
    if _array_meta(array) != {k: meta[k] for k in ("dtype", "shape", "sha256")}:
      raise ExchangeCorrupt(commit, f"array data at {meta['path']!r} fails its checksum")
    self._count(kind, "bytes_read", array.nbytes)
    self._count(kind, "arrays_read", 1)
    return array

  def array_steps(self, name: str) -> list[int]:
    """The committed steps of array `name`, ascending."""
    prefix = f"{self.run}/_array/{check_name('array name', name)}/"
    return sorted(k[0] for k in self._list_under(prefix, "") if len(k) == 1)

  # Accounting.

  def stats(self, *, reset: bool = False) -> dict:
    """Bytes and counts moved by this object: totals plus `by_kind`.

    Record bytes are the stored JSON (envelope included); array bytes are the raw
    data (stored uncompressed) plus the commit record, leaving out zarr's ~150-byte
    `.zarray` metadata. `polls` counts reads that found nothing yet. Snapshot (or
    reset) around a step for the bytes exchanged per step.
    """
    with self._lock:
      by_kind = {k: dict(v) for k, v in sorted(self._stats.items())}
      if reset:
        self._stats = {}
    fields = ("bytes_written", "bytes_read", "records_written", "records_read",
              "arrays_written", "arrays_read", "polls")
    totals = {f: sum(v.get(f, 0) for v in by_kind.values()) for f in fields}
    return {**totals, "by_kind": by_kind}

  # Internals.

  def _record_path(self, kind: str, key: Sequence[int]) -> str:
    segments = _segments(key)
    if not segments:
      raise ValueError("Exchange record keys need at least a step.")
    return f"{self.run}/{check_name('kind', kind)}/{'/'.join(segments)}.json"

  def _mark_path(self, kind: str, step: int) -> str:
    return f"{self.run}/_mark/{check_name('kind', kind)}/{_segments([step])[0]}.json"

  def _array_path(self, name: str, step: int) -> str:
    return f"{self.run}/_array/{check_name('array name', name)}/{_segments([step])[0]}.json"

  def _count(self, kind: str, field: str, n: int):
    with self._lock:
      counts = self._stats.setdefault(kind, {})
      counts[field] = counts.get(field, 0) + n

  def _put(self, path: str, record: dict, kind: str) -> bool:
    if not isinstance(record, dict):
      raise TypeError(f"Exchange records are dicts, got {type(record).__name__}.")
    data = encode_record(path, record)
    stamp = self._store.write(path, data, if_equal=NO_VALUE).result()
    if stamp.generation:  # An empty generation means the condition failed: key taken.
      self._count(kind, "bytes_written", len(data))
      self._count(kind, "records_written", 1)
      return True
    existing = self._decode_read(path, self._store.read(path).result(), kind)
    if existing is None:  # Nothing deletes records, so this is a broken store.
      raise ExchangeError(f"Exchange key {path!r} refused a create-if-absent write but "
                          f"reads as absent.")
    if _canonical(existing) == _canonical(record):
      return False
    raise ExchangeConflict(path, existing, record)

  def _decode_read(self, path: str, result, kind: str) -> dict | None:
    if result.state != "value":
      self._count(kind, "polls", 1)
      return None
    self._count(kind, "bytes_read", len(result.value))
    self._count(kind, "records_read", 1)
    return decode_record(path, result.value)

  def _wait(self, paths: list[str], kind: str, timeout_s: float | None,
            poll_s: float) -> list[dict]:
    records: list[dict | None] = [None] * len(paths)
    pending = list(range(len(paths)))
    start = time.monotonic()
    delay = poll_s
    while True:
      # Issue every read before waiting on any, so one poll costs one round trip.
      futures = [(i, self._store.read(paths[i])) for i in pending]
      pending = []
      for i, future in futures:
        records[i] = self._decode_read(paths[i], future.result(), kind)
        if records[i] is None:
          pending.append(i)
      if not pending:
        return records
      waited = time.monotonic() - start
      if timeout_s is not None and waited >= timeout_s:
        missing = [paths[i] for i in pending]
        raise ExchangeTimeout(
            f"Timed out after {waited:.1f} s waiting for {len(missing)} of {len(paths)} "
            f"exchange records in {self!r}; missing: {', '.join(missing)}", missing)
      sleep = delay if timeout_s is None else min(delay, timeout_s - waited)
      time.sleep(max(sleep, 0.0))
      delay = min(delay * 1.5, max(_MAX_POLL_S, poll_s))

  def _zarr_spec(self, data_path: str) -> dict:
    kvstore = {**self.spec, "path": self.spec.get("path", "") + data_path}
    return {"driver": "zarr", "kvstore": kvstore}

  def _write_zarr(self, data_path: str, array: np.ndarray):
    spec = self._zarr_spec(data_path)
    # One uncompressed chunk: arrays here are small statistics, and storing the raw
    # bytes keeps the bytes-exchanged measurement honest.
    spec["metadata"] = {"dtype": array.dtype.str, "shape": list(array.shape),
                        "chunks": [max(1, d) for d in array.shape], "compressor": None}
    # Chunks equal to the fill value would otherwise not be stored at all.
    spec["store_data_equal_to_fill_value"] = True
    dest = ts.open(spec, create=True, context=self._context).result()
    dest.write(array).result()

  def _same_array(self, commit: str, existing: dict, meta: dict) -> bool:
    if {k: existing.get(k) for k in meta} == meta:
      return False
    raise ExchangeConflict(commit, {k: existing.get(k) for k in meta}, meta)

  def _list_under(self, base: str, rest: str) -> list[Key]:
    keys = self._store.list(prefix_range(base + rest)).result()
    parsed = (_parse(k.decode("utf-8")[len(base):]) for k in keys)
    return [k for k in parsed if k is not None]

  # Last, so the name does not shadow the builtin in the annotations above.
  def list(self, kind: str, prefix: Sequence[int] = ()) -> list[Key]:
    """The keys of `kind` that start with `prefix`, sorted (e.g. prefix=(step,))."""
    prefix = tuple(prefix)
    base = f"{self.run}/{check_name('kind', kind)}/"
    # No trailing separator: (step,) also matches the leaf `{step}.json`.
    keys = self._list_under(base, "/".join(_segments(prefix)))
    return sorted(k for k in keys if k[:len(prefix)] == prefix)
